//! ZeRO-3 (FSDP): every rank keeps a share of the rows of every parameter, and a layer's
//! parameters are whole only while it runs.
//!
//! **Row shards**, as PyTorch's FSDP2 lays them out: a parameter of `rows` rows (dimension 0) is
//! padded with zero rows to `world * share` rows, `share = ceil(rows / world)` (rounded up to a
//! multiple of 128 for a weight gathered as FP8 codes, below), and rank `r`
//! keeps rows `r * share .. (r + 1) * share`. The padding rows stay zero: their gradient is zero,
//! and AdamW moves a zero weight with zero moments by nothing. Every rank holds the same number of
//! elements of every parameter, so an all-gather of the shards, rank 0's first, is the padded
//! parameter and a reduce-scatter of its padded gradient hands each rank its rows' mean.
//!
//! **The gather is an autodiff op** ([`RowGather::gather_rows`]): its forward all-gathers the
//! shard (in the dtype the shard computes in: the compute copy's bf16 or f16 shard of a
//! projection, f32 for the embedding and the norms' gains) and trims the padding; its backward
//! pads the whole gradient, cast to f32, and reduce-scatters its mean over the ranks onto the
//! shard. The gradients that reach the optimizer are each rank's shares,
//! averaged, and no step of the trainer averages them again. A block's gather takes the deepest
//! tensor entering the block as a second input that only places it in the graph (as
//! `parallel::overlap`'s hook does): Burn's backward runs the deepest nodes first, so the
//! reduce-scatter of a block's gradients runs as soon as the block's backward is done with them,
//! and its whole gradients are freed then.
//!
//! **The hooks** ([`GatherBlocks`] under autodiff, [`GatherBlocksPlain`] for evaluation) hand the
//! model's forward ([`model::BlockHook`]) each block with its parameters gathered just before it
//! runs, the embedding before the lookup, and the final norm and an untied LM head just before
//! they run (anchored at the stream entering the final norm). With `model.recompute = "full"` a
//! block's gathered weights live only while it runs: its first run keeps nothing, and the
//! backward gathers them again to run it again (FSDP with activation checkpointing). Without,
//! Burn's backward keeps what the block's ops saved, the gathered weights among them, until the
//! block's backward.
//!
//! **FP8 on the wire** (`fp8.gather_codes`, [`RowShards::with_fp8_wire`]): the weight of a
//! projection that computes in FP8 with 128 x 128 block scales (powers of two) is then gathered as
//! FP8 codes and block scales: each rank quantizes its row shard as the FP8 linear layer quantizes
//! a weight, the codes (four to an i32) and the f32 scales of every rank travel in one NCCL group,
//! and the gathered codes are dequantized to the shard's dtype (exactly: an E4M3 code times a power
//! of two is a bf16 or f32 value). Such a parameter's shards are a multiple of 128 rows, so that no
//! block straddles two ranks: the shards' codes and scales, concatenated, are the whole weight's,
//! and no rank needs another's amax. The FP8 linear layer's own quantization of the gathered weight
//! then gives the values it would give the whole weight (the same scale, or half of it where a
//! block's largest code rounded down), so the forward and its gradients are those of one GPU's FP8
//! step; about half the bytes of a bf16 gather travel (one per element, four per 128 x 128 block).
//! The gradient travels as before, in f32.
//!
//! The collectives run in the order of the forward and of Burn's backward, which are the same on
//! every rank: the graph is built by the same code over tensors of the same shapes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::Int;
use burn::tensor::{FloatDType, Shape, Tensor, TensorPrimitive};
use kernels::collective::{CollectiveBackend, Flat, ProcessGroup, ReduceOp};
use kernels::{Fp8Tensor, QuantSpec};
use model::gpt::Block;
use model::{BlockHook, Gpt, Outside};

use crate::checkpoint::RowRange;
use crate::optim::{to_prim, to_tensor, with_grad, AdamW, Moments};

/// Rows a rank keeps of a parameter of `rows` rows over `world` ranks (the padded parameter has
/// `world` times as many).
pub fn share(rows: usize, world: usize) -> usize {
    rows.div_ceil(world)
}

/// How the ranks of a ZeRO-3 run split the parameters: every parameter's whole row count, and
/// this rank's place.
#[derive(Debug, Clone)]
pub struct RowShards {
    pub rank: usize,
    pub world: usize,
    /// Rows (dimension 0) of each whole parameter, and the elements of one row.
    rows: HashMap<ParamId, (usize, usize)>,
    /// The 2-D parameters gathered as FP8 codes, with the quantization of their shards (128 x 128
    /// blocks): their shards are a multiple of 128 rows.
    fp8_wire: HashMap<ParamId, QuantSpec>,
}

impl RowShards {
    /// The split of `model`'s parameters (whole, as every rank builds them) for rank `rank` of
    /// `world`.
    pub fn new<B: Backend, M: Module<B>>(model: &M, rank: usize, world: usize) -> Self {
        assert!(rank < world, "rank {rank} of a world of {world}");
        struct Rows(HashMap<ParamId, (usize, usize)>);
        impl<B: Backend> ModuleVisitor<B> for Rows {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let dims = param.shape().dims::<D>();
                self.0
                    .insert(param.id, (dims[0], dims[1..].iter().product()));
            }
        }
        let mut r = Rows(HashMap::new());
        model.visit(&mut r);
        Self {
            rank,
            world,
            rows: r.0,
            fp8_wire: HashMap::new(),
        }
    }

    /// The split with the 2-D parameters of `wire` gathered as FP8 codes quantized by their spec
    /// (128 x 128 blocks with power-of-two scales, along the columns), their shards rounded up to
    /// a multiple of 128 rows. Only where that rounding adds at most an eighth to a shard's rows
    /// ([`fp8_wire_pays`]): more padding would cost more in the state each rank keeps and in the
    /// f32 reduce-scatter of the gradient than the gather saves, and such weights (small ones over
    /// many ranks) keep travelling as values. Made before the model is cut ([`RowShards::shard`]).
    ///
    /// # Panics
    /// If a spec is not of 128 x 128 blocks with power-of-two scales along the columns, or an id
    /// is not a parameter of the split.
    pub fn with_fp8_wire(mut self, wire: HashMap<ParamId, QuantSpec>) -> Self {
        for (id, spec) in &wire {
            assert!(
                spec.granularity == kernels::Fp8Granularity::Block128 && spec.pow2 && !spec.transpose,
                "the FP8 wire takes 128 x 128 blocks with power-of-two scales along the columns ({id}: {spec:?})"
            );
            self.entry(id);
        }
        let world = self.world;
        self.fp8_wire = wire
            .into_iter()
            .filter(|(id, _)| fp8_wire_pays(self.entry(id).0, world))
            .collect();
        self
    }

    /// How many parameters are gathered as FP8 codes.
    pub fn fp8_wire_len(&self) -> usize {
        self.fp8_wire.len()
    }

    /// The quantization of `id`'s shards where it is gathered as FP8 codes.
    pub fn fp8_wire_spec(&self, id: &ParamId) -> Option<QuantSpec> {
        self.fp8_wire.get(id).copied()
    }

    /// Rows of each rank's shard of `id` (padding rows included).
    pub fn share(&self, id: &ParamId) -> usize {
        let rows = share(self.rows(id), self.world);
        match self.fp8_wire.contains_key(id) {
            true => rows.div_ceil(kernels::fp8::TILE) * kernels::fp8::TILE,
            false => rows,
        }
    }

    /// Rows of the whole parameter `id`.
    ///
    /// # Panics
    /// If `id` is not a parameter of the model the split was made from.
    pub fn rows(&self, id: &ParamId) -> usize {
        self.entry(id).0
    }

    /// Elements of the whole parameter `id`.
    pub fn elements(&self, id: &ParamId) -> usize {
        let (rows, per_row) = self.entry(id);
        rows * per_row
    }

    /// Elements of each rank's shard of `id`, padding rows included.
    pub fn shard_elements(&self, id: &ParamId) -> usize {
        self.share(id) * self.entry(id).1
    }

    /// Every parameter of the split.
    pub fn ids(&self) -> impl Iterator<Item = &ParamId> {
        self.rows.keys()
    }

    fn entry(&self, id: &ParamId) -> (usize, usize) {
        *self
            .rows
            .get(id)
            .unwrap_or_else(|| panic!("parameter {id} is not in the row split"))
    }

    /// The first row of this rank's shard of `id` in the padded parameter, and the shard's rows.
    pub fn range(&self, id: &ParamId) -> (usize, usize) {
        let n = self.share(id);
        (self.rank * n, n)
    }

    /// What an all-gather of `id`'s row shard `shard` (flat) carries: its FP8 codes and scales
    /// where `id` travels in FP8 and the shard is in bf16 or f32, else its values.
    pub fn wire<B: kernels::Backend>(&self, id: &ParamId, shard: Tensor<B, 1>) -> Wire<B> {
        let dtype = shard.dtype();
        let fits = matches!(dtype, burn::tensor::DType::BF16 | burn::tensor::DType::F32);
        match self.fp8_wire.get(id) {
            Some(spec) if fits => {
                let (rows, cols) = (self.share(id), self.entry(id).1);
                let q = kernels::fp8_quantize(shard.reshape([rows, cols]), *spec);
                let flat = |t: Tensor<B, 2>| {
                    let n = t.shape().num_elements();
                    t.reshape([n])
                };
                let n = q.payload.shape().num_elements();
                Wire::Fp8 {
                    codes: q.payload.reshape([n]),
                    scales: flat(q.scales),
                }
            }
            _ => Wire::Values(shard),
        }
    }

    /// The padded whole parameter `id` (flat, in `dtype`, the shards' dtype) from what its
    /// all-gather brought: the values, or the FP8 codes dequantized.
    pub fn unwire<B: kernels::Backend>(
        &self,
        id: &ParamId,
        gathered: Wire<B>,
        dtype: burn::tensor::DType,
    ) -> Tensor<B, 1> {
        match gathered {
            Wire::Values(t) => t,
            Wire::Fp8 { codes, scales } => {
                let spec = self.fp8_wire[id];
                let (rows, cols) = (self.share(id) * self.world, self.entry(id).1);
                let words = codes.dims()[0] / rows;
                let q = Fp8Tensor {
                    payload: codes.reshape([rows, words]),
                    scales: scales.reshape([spec.scale_rows(rows), spec.scale_cols(cols)]),
                    rows,
                    k: cols,
                    spec,
                };
                q.dequantize(kernels::float_dtype(dtype))
                    .reshape([rows * cols])
            }
        }
    }

    /// The rows of every parameter this rank keeps, as a checkpoint shard records them.
    pub fn ranges(&self) -> HashMap<ParamId, RowRange> {
        self.rows
            .iter()
            .map(|(id, &(of, _))| {
                let start = self.range(id).0;
                (*id, RowRange { start, of })
            })
            .collect()
    }

    /// `model` with every parameter replaced by this rank's shard of it (padded with zero rows
    /// where the parameter's rows run out), a leaf that trains as the whole one did.
    pub fn shard<AB: AutodiffBackend, M: AutodiffModule<AB>>(&self, model: M) -> M {
        model.map(&mut Cut::<AB::InnerBackend> {
            shards: self,
            moments: None,
        })
    }

    /// Turns a whole replica into this rank's share: every parameter and its AdamW moments cut
    /// to this rank's rows. The optimizer updates every parameter it holds (its shards), and the
    /// compute copies are cast again from the shards. (A run cuts its model with
    /// [`RowShards::shard`] as soon as it is built, and reads a checkpoint's rows into it
    /// directly, so that no whole state is ever on the GPU: then [`RowShards::keep_shards`].)
    pub fn take_share<AB: AutodiffBackend, M: AutodiffModule<AB>>(
        &self,
        model: M,
        opt: &mut AdamW<AB::InnerBackend>,
    ) -> M {
        self.keep_shards(opt);
        model.map(&mut Cut {
            shards: self,
            moments: Some(&mut opt.moments),
        })
    }

    /// Readies the optimizer of a model already cut to this rank's rows (and of moments read as
    /// rows): it updates every parameter it holds, and the compute copies are cast again from the
    /// shards.
    pub fn keep_shards<B: Backend>(&self, opt: &mut AdamW<B>) {
        opt.copies.clear();
        opt.owned = None;
    }
}

/// The projection weights of `model` that a ZeRO-3 run gathers as FP8 codes under `precision`
/// ([`RowShards::with_fp8_wire`]), with the quantization of their shards: those of the projections
/// whose forward and input-gradient GEMMs both take the weight in FP8 with 128 x 128 block scales
/// that are powers of two (the weight is used nowhere else, so the codes lose nothing it would
/// keep). Per-tensor scaling would need the ranks to agree on one amax first: those weights
/// travel as values.
pub fn fp8_wire<B: Backend>(
    model: &Gpt<B>,
    precision: &model::Precision,
) -> HashMap<ParamId, QuantSpec> {
    model
        .fp8_projections(precision)
        .into_iter()
        .filter(|(_, _, cfg)| !cfg.per_tensor && cfg.pow2 && cfg.fprop && cfg.dgrad)
        .map(|(_, linear, cfg)| (linear.weight.id, cfg.weight_spec(false)))
        .collect()
}

/// Whether a weight of `rows` rows over `world` ranks is gathered as FP8 codes: where rounding
/// its shard up to a multiple of 128 rows adds at most an eighth to the shard. Then, per column
/// and rank, the gather saves at least `2 s - 9 s / 8` bytes of bf16's `2 s` (`s` the shard's
/// rows), more than the f32 reduce-scatter of the gradient's padding costs (`4 s / 8`), and the
/// state of such a weight grows by at most an eighth.
pub fn fp8_wire_pays(rows: usize, world: usize) -> bool {
    let tile = kernels::fp8::TILE;
    let s = share(rows, world);
    s.div_ceil(tile) * tile * 8 <= s * 9
}

/// Cuts parameters (and their moments, where given) to a rank's rows.
struct Cut<'a, B: Backend> {
    shards: &'a RowShards,
    moments: Option<&'a mut HashMap<ParamId, Moments<B>>>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Cut<'_, AB::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let grad = tensor.is_require_grad();
        let (start, n) = self.shards.range(&id);
        if let Some(m) = self.moments.as_mut().and_then(|all| all.get_mut(&id)) {
            let cut = |t: &FloatTensor<AB::InnerBackend>| {
                to_prim(rows_of(to_tensor::<AB::InnerBackend, D>(t), start, n))
            };
            *m = Moments {
                m: cut(&m.m),
                v: cut(&m.v),
            };
        }
        let cut = rows_of(tensor.inner(), start, n);
        Param::from_mapped_value(id, with_grad(Tensor::from_inner(cut), grad), mapper)
    }
}

/// Rows `start .. start + n` of `t`, zero rows where `t`'s run out, in a buffer of their own (a
/// slice of rows can be a view that keeps the whole tensor's buffer alive).
fn rows_of<B: Backend, const D: usize>(t: Tensor<B, D>, start: usize, n: usize) -> Tensor<B, D> {
    let rows = t.dims()[0];
    let have = rows.saturating_sub(start).min(n);
    let mut shape = t.dims();
    shape[0] = n;
    let out = Tensor::zeros(shape, (&t.device(), t.dtype()));
    if have == 0 {
        return out;
    }
    // Burn's slice argument: the range of rows (dimension 0), the other dimensions whole.
    #[allow(clippy::single_range_in_vec_init)]
    let kept = [0..have];
    out.slice_assign(kept, t.narrow(0, start, have))
}

/// What an all-gather of one parameter's row shard carries ([`RowShards::wire`]).
pub enum Wire<B: Backend> {
    /// The shard's values, flat, in their dtype.
    Values(Tensor<B, 1>),
    /// The shard's FP8 codes (four to an element, row by row) and their f32 block scales, both
    /// flat: concatenated over the ranks, they are the whole padded weight's.
    Fp8 {
        codes: Tensor<B, 1, Int>,
        scales: Tensor<B, 1>,
    },
}

impl<B: Backend> Wire<B> {
    /// The device its tensors are on.
    fn device(&self) -> B::Device {
        match self {
            Wire::Values(t) => t.device(),
            Wire::Fp8 { scales, .. } => scales.device(),
        }
    }

    /// Whether it carries FP8 codes and scales rather than values.
    fn is_fp8(&self) -> bool {
        matches!(self, Wire::Fp8 { .. })
    }

    /// Bytes it carries: a byte per FP8 code (four an element of `codes`, which are i32 words
    /// on CUDA) and four per scale.
    pub fn bytes(&self) -> usize {
        match self {
            Wire::Values(t) => t.shape().num_elements() * t.dtype().size(),
            Wire::Fp8 { codes, scales } => {
                (codes.shape().num_elements() + scales.shape().num_elements()) * 4
            }
        }
    }

    /// Its tensors, in order, as an all-gather takes them.
    fn into_flats(self, out: &mut Vec<Flat<B>>) {
        match self {
            Wire::Values(t) => out.push(Flat::Float(t)),
            Wire::Fp8 { codes, scales } => {
                out.push(Flat::Int(codes));
                out.push(Flat::Float(scales));
            }
        }
    }

    /// The wires of the kinds of `like` from their tensors, in order ([`Wire::into_flats`]).
    fn from_flats(like: &[bool], flats: Vec<Flat<B>>) -> Vec<Self> {
        let mut flats = flats.into_iter();
        let mut next = || flats.next().expect("a gathered tensor for every one sent");
        like.iter()
            .map(|&fp8| match fp8 {
                true => Wire::Fp8 {
                    codes: next().int(),
                    scales: next().float(),
                },
                false => Wire::Values(next().float()),
            })
            .collect()
    }
}

/// How row shards travel between the ranks: NCCL's all-gather and reduce-scatter in a run of
/// processes ([`ProcessGroup`]). Every tensor is flat; `id` names the parameter, for an exchange
/// that needs it (the CPU tests' stand-in for other ranks).
pub trait RowExchange<B: Backend>: Send + Sync {
    /// How many ranks hold shards.
    fn world(&self) -> usize;
    /// Every rank's `shard` (the same number of elements on every rank, the same kind of wire),
    /// rank 0's first.
    fn all_gather(&self, id: ParamId, shard: Wire<B>) -> Wire<B>;
    /// The mean over the ranks of `whole` (a multiple of the world size in elements), this
    /// rank's equal part of it.
    fn reduce_scatter_mean(&self, id: ParamId, whole: Tensor<B, 1>) -> Tensor<B, 1>;
    /// [`RowExchange::all_gather`] of each shard, started now beside the device's later work; the
    /// results may be read only after [`RowExchange::wait_ahead`], which also comes before any
    /// other call of the exchange. By default they are gathered at once, in order.
    fn all_gather_ahead(&self, shards: Vec<(ParamId, Wire<B>)>) -> Vec<Wire<B>> {
        shards
            .into_iter()
            .map(|(id, shard)| self.all_gather(id, shard))
            .collect()
    }
    /// Makes `device`'s later work wait for the gathers started ahead.
    fn wait_ahead(&self, _device: &B::Device) {}
}

impl<B: CollectiveBackend> RowExchange<B> for ProcessGroup {
    fn world(&self) -> usize {
        ProcessGroup::world(self)
    }
    fn all_gather(&self, _id: ParamId, shard: Wire<B>) -> Wire<B> {
        // One NCCL group: a value wire is one all-gather, an FP8 wire its codes' and scales'.
        let kind = [shard.is_fp8()];
        let mut flats = Vec::new();
        shard.into_flats(&mut flats);
        let mut gathered = Wire::from_flats(&kind, self.all_gather_group(flats));
        gathered.pop().expect("one wire")
    }
    fn reduce_scatter_mean(&self, _id: ParamId, whole: Tensor<B, 1>) -> Tensor<B, 1> {
        self.reduce_scatter(whole, ReduceOp::Mean)
    }
    fn all_gather_ahead(&self, shards: Vec<(ParamId, Wire<B>)>) -> Vec<Wire<B>> {
        let kinds: Vec<bool> = shards.iter().map(|(_, w)| w.is_fp8()).collect();
        let mut flats = Vec::new();
        for (_, wire) in shards {
            wire.into_flats(&mut flats);
        }
        Wire::from_flats(&kinds, self.all_gather_overlapped(flats))
    }
    fn wait_ahead(&self, device: &B::Device) {
        self.wait_overlapped::<B>(device);
    }
}

/// The whole parameter `id` from the ranks' shards, `shard` this rank's, gathered in the wire
/// `shards` gives it.
pub fn gather<B: kernels::Backend, const D: usize>(
    shard: Tensor<B, D>,
    shards: &RowShards,
    id: ParamId,
    exchange: &dyn RowExchange<B>,
) -> Tensor<B, D> {
    let (dims, dtype) = (shard.dims(), shard.dtype());
    let n = shard.shape().num_elements();
    let gathered = exchange.all_gather(id, shards.wire(&id, shard.reshape([n])));
    let padded = shards.unwire(&id, gathered, dtype);
    trimmed(padded, dims, shards.rows(&id))
}

/// The whole parameter of `rows` rows from `padded`, the all-gather of shards shaped `shard`.
fn trimmed<B: Backend, const D: usize>(
    padded: Tensor<B, 1>,
    shard: [usize; D],
    rows: usize,
) -> Tensor<B, D> {
    let per_row: usize = shard[1..].iter().product();
    let mut dims = shard;
    dims[0] = rows;
    padded.narrow(0, 0, rows * per_row).reshape(dims)
}

/// The mean over the ranks of the whole gradient `grad` (any float dtype, summed in f32), this
/// rank's shard of it, shaped `shard`.
fn scatter_grad<B: Backend>(
    grad: FloatTensor<B>,
    shard: &Shape,
    id: ParamId,
    exchange: &dyn RowExchange<B>,
) -> FloatTensor<B> {
    let g = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(grad));
    let g = g.cast(FloatDType::F32);
    let n = g.shape().num_elements();
    let g = g.reshape([n]);
    let padded = shard.num_elements() * exchange.world();
    let g = if padded > n {
        let zeros = Tensor::zeros([padded - n], (&g.device(), burn::tensor::DType::F32));
        Tensor::cat(vec![g, zeros], 0)
    } else {
        g
    };
    let mine = exchange.reduce_scatter_mean(id, g);
    B::float_reshape(mine.into_primitive().tensor(), shard.clone())
}

/// An autodiff backend that gathers row shards as an op of its graph.
pub trait RowGather: AutodiffBackend<InnerBackend: kernels::Backend> {
    /// The whole parameter `id`, `whole` (gathered from this rank's `shard` and the others'),
    /// as an op of the graph: in the backward, the shard receives its rows of the whole gradient
    /// averaged over the ranks (through `exchange`), in f32. `anchor` only places the op in the
    /// graph: one level below it, so that its backward runs after that of everything deeper. An
    /// untracked shard gives `whole` and nothing more.
    fn gather_rows<const D: usize>(
        shard: Tensor<Self, D>,
        whole: Tensor<Self::InnerBackend, D>,
        anchor: Option<&Tensor<Self, 3>>,
        id: ParamId,
        exchange: &Arc<dyn RowExchange<Self::InnerBackend>>,
    ) -> Tensor<Self, D>;
}

/// The backward of the gather: the reduce-scatter onto the shard.
#[derive(Debug)]
struct GatherBackward;

/// What the gather's backward needs: the parameter, the shard's shape and the exchange.
#[derive(Clone)]
struct GatherState<B: Backend> {
    id: ParamId,
    shard: Shape,
    exchange: Arc<dyn RowExchange<B>>,
}

impl<B: Backend> std::fmt::Debug for GatherState<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "gather of {} ({:?})", self.id, self.shard)
    }
}

impl<B: Backend> Backward<B, 2> for GatherBackward {
    type State = GatherState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [shard, _anchor] = ops.parents;
        if let Some(node) = shard {
            let s = ops.state;
            let mine = scatter_grad::<B>(grad, &s.shard, s.id, s.exchange.as_ref());
            grads.register::<B>(node.id, mine);
        }
    }
}

impl<B: kernels::Backend, C: CheckpointStrategy> RowGather for Autodiff<B, C> {
    fn gather_rows<const D: usize>(
        shard: Tensor<Self, D>,
        whole: Tensor<B, D>,
        anchor: Option<&Tensor<Self, 3>>,
        id: ParamId,
        exchange: &Arc<dyn RowExchange<B>>,
    ) -> Tensor<Self, D> {
        let shard_shape = shard.shape();
        let p = shard.into_primitive().tensor();
        if !p.is_tracked() {
            return Tensor::from_inner(whole);
        }
        // Without an anchor the shard stands in for it (the op's level is the shard's).
        let anchor = anchor.map_or_else(
            || p.node.clone(),
            |a| a.clone().into_primitive().tensor().node,
        );
        let out = whole.into_primitive().tensor();
        let state = GatherState {
            id,
            shard: shard_shape,
            exchange: exchange.clone(),
        };
        let out = match GatherBackward
            .prepare::<C>([p.node.clone(), anchor])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }
}

/// `block` (or the parameters outside the blocks) with each parameter gathered through
/// [`RowGather::gather_rows`], anchored at `anchor`; `tracked: false` gathers the shards without
/// their autodiff history, so that nothing enters the graph. A parameter found in `ahead` (its
/// padded all-gather, started earlier and waited for) is taken from there instead of gathered.
struct GatherMapper<'a, AB: RowGather> {
    shards: &'a RowShards,
    exchange: &'a Arc<dyn RowExchange<AB::InnerBackend>>,
    anchor: Option<&'a Tensor<AB, 3>>,
    tracked: bool,
    ahead: HashMap<ParamId, Wire<AB::InnerBackend>>,
}

impl<AB: RowGather> ModuleMapper<AB> for GatherMapper<'_, AB> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let rows = self.shards.rows(&id);
        let whole = match self.ahead.remove(&id) {
            Some(gathered) => {
                let padded = self.shards.unwire(&id, gathered, tensor.dtype());
                trimmed(padded, tensor.dims(), rows)
            }
            None => gather(
                tensor.clone().inner(),
                self.shards,
                id,
                self.exchange.as_ref(),
            ),
        };
        let tensor = match self.tracked {
            true => tensor,
            false => Tensor::from_inner(tensor.inner()),
        };
        let whole = AB::gather_rows(tensor, whole, self.anchor, id, self.exchange);
        Param::from_mapped_value(id, whole, mapper)
    }
}

/// The training forward's hook of a ZeRO-3 rank: each block gathered just before it runs, the
/// parameters outside the blocks before the embedding; in the backward each gathered parameter's
/// gradient is reduce-scattered onto its shard.
///
/// **Prefetch:** while the forward runs (from the embedding's gather to the head's), a block's
/// hook starts the next block's all-gathers ahead ([`RowExchange::all_gather_ahead`], one NCCL
/// launch on the communicator's own stream), so that they run beside this block's compute; the
/// next hook waits for them. The last block starts none, so nothing is in flight when the
/// gathers and reduce-scatters in CubeCL's order (the head's, the backward's) begin. A recomputed
/// block's second run, in the backward, gathers in order.
pub struct GatherBlocks<AB: RowGather> {
    pub shards: Arc<RowShards>,
    pub exchange: Arc<dyn RowExchange<AB::InnerBackend>>,
    ahead: Mutex<Ahead<AB>>,
}

/// The forward's blocks while it runs, and the gathers started ahead for one of them.
struct Ahead<AB: RowGather> {
    blocks: Vec<Block<AB>>,
    next: Option<(usize, HashMap<ParamId, Wire<AB::InnerBackend>>)>,
}

impl<AB: RowGather> GatherBlocks<AB> {
    pub fn new(shards: Arc<RowShards>, exchange: Arc<dyn RowExchange<AB::InnerBackend>>) -> Self {
        Self {
            shards,
            exchange,
            ahead: Mutex::new(Ahead {
                blocks: Vec::new(),
                next: None,
            }),
        }
    }

    fn mapper<'a>(
        &'a self,
        anchor: Option<&'a Tensor<AB, 3>>,
        tracked: bool,
        ahead: HashMap<ParamId, Wire<AB::InnerBackend>>,
    ) -> GatherMapper<'a, AB> {
        GatherMapper {
            shards: &self.shards,
            exchange: &self.exchange,
            anchor,
            tracked,
            ahead,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ahead<AB>> {
        self.ahead.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the gathers started ahead, if any: block `layer`'s, or none if they were for
    /// another block (then they are dropped).
    fn take_ahead(&self, layer: usize) -> HashMap<ParamId, Wire<AB::InnerBackend>> {
        let Some((of, gathered)) = self.lock().next.take() else {
            return HashMap::new();
        };
        if let Some(w) = gathered.values().next() {
            self.exchange.wait_ahead(&w.device());
        }
        if of == layer {
            gathered
        } else {
            HashMap::new()
        }
    }

    /// Starts the gathers of block `layer` ahead, while the forward runs and the block exists.
    fn start_ahead(&self, layer: usize) {
        let mut ahead = self.lock();
        let Some(block) = ahead.blocks.get(layer) else {
            return;
        };
        struct Shards<'a, B: Backend>(&'a RowShards, Vec<(ParamId, Wire<B>)>);
        impl<AB: AutodiffBackend<InnerBackend: kernels::Backend>> ModuleVisitor<AB>
            for Shards<'_, AB::InnerBackend>
        {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                let t = param.val().inner();
                let n = t.shape().num_elements();
                self.1
                    .push((param.id, self.0.wire(&param.id, t.reshape([n]))));
            }
        }
        let mut shards = Shards(&self.shards, Vec::new());
        block.visit(&mut shards);
        let ids: Vec<ParamId> = shards.1.iter().map(|(id, _)| *id).collect();
        let gathered = self.exchange.all_gather_ahead(shards.1);
        ahead.next = Some((layer, ids.into_iter().zip(gathered).collect()));
    }

    /// Block `layer` gathered (from the gathers started ahead where they are its), then the next
    /// block's gathers started.
    fn gathered_block(
        &self,
        layer: usize,
        block: &Block<AB>,
        anchor: Option<&Tensor<AB, 3>>,
        tracked: bool,
    ) -> Block<AB> {
        let ahead = self.take_ahead(layer);
        let whole = block.clone().map(&mut self.mapper(anchor, tracked, ahead));
        self.start_ahead(layer + 1);
        whole
    }
}

impl<AB: RowGather> BlockHook<AB> for GatherBlocks<AB> {
    fn block(&self, layer: usize, block: &Block<AB>, input: &Tensor<AB, 3>) -> Block<AB> {
        self.gathered_block(layer, block, Some(input), true)
    }

    fn block_untracked(
        &self,
        layer: usize,
        block: &Block<AB>,
        _input: &Tensor<AB, 3>,
    ) -> Block<AB> {
        self.gathered_block(layer, block, None, false)
    }

    fn outside(
        &self,
        model: &Gpt<AB>,
        part: Outside,
        input: Option<&Tensor<AB, 3>>,
    ) -> Option<Gpt<AB>> {
        match part {
            // The forward begins: its blocks may be gathered ahead.
            Outside::Embedding => self.lock().blocks = model.blocks.clone(),
            // The forward ends: nothing is gathered ahead from here on.
            Outside::Head => {
                self.take_ahead(usize::MAX);
                self.lock().blocks.clear();
            }
        }
        let mut mapper = self.mapper(input, true, HashMap::new());
        Some(outside_gathered(model, part, &mut mapper))
    }
}

/// The forward's hook of a ZeRO-3 rank without autodiff (evaluation): each block, and the
/// parameters outside the blocks, gathered just before they run.
pub struct GatherBlocksPlain<B: kernels::Backend> {
    pub shards: Arc<RowShards>,
    pub exchange: Arc<dyn RowExchange<B>>,
}

/// [`GatherBlocksPlain`]'s gather of every parameter of a module.
struct PlainMapper<'a, B: kernels::Backend>(&'a GatherBlocksPlain<B>);

impl<B: kernels::Backend> ModuleMapper<B> for PlainMapper<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let whole = gather(tensor, &self.0.shards, id, self.0.exchange.as_ref());
        Param::from_mapped_value(id, whole, mapper)
    }
}

impl<B: kernels::Backend> BlockHook<B> for GatherBlocksPlain<B> {
    fn block(&self, _layer: usize, block: &Block<B>, _input: &Tensor<B, 3>) -> Block<B> {
        block.clone().map(&mut PlainMapper(self))
    }

    fn outside(
        &self,
        model: &Gpt<B>,
        part: Outside,
        _input: Option<&Tensor<B, 3>>,
    ) -> Option<Gpt<B>> {
        Some(outside_gathered(model, part, &mut PlainMapper(self)))
    }
}

/// `model` with its parameters of `part` passed through `mapper`: the embedding, or the final
/// norm and an untied LM head. The rest stays as it is (the blocks are gathered one at a time).
fn outside_gathered<B: Backend, M: ModuleMapper<B>>(
    model: &Gpt<B>,
    part: Outside,
    mapper: &mut M,
) -> Gpt<B> {
    let mut m = model.clone();
    match part {
        Outside::Embedding => m.wte = m.wte.map(mapper),
        Outside::Head => {
            m.norm_f = m.norm_f.map(mapper);
            m.lm_head = m.lm_head.map(|h| h.map(mapper));
        }
    }
    m
}
