//! ZeRO-3 (FSDP): every rank keeps a share of the rows of every parameter, and a layer's
//! parameters are whole only while it runs.
//!
//! **Row shards**, as PyTorch's FSDP2 lays them out: a parameter of `rows` rows (dimension 0) is
//! padded with zero rows to `world * share` rows, `share = ceil(rows / world)`, and rank `r`
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
use burn::tensor::{FloatDType, Shape, Tensor, TensorPrimitive};
use kernels::collective::{CollectiveBackend, ProcessGroup, ReduceOp};
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
        let (rows, per_row) = self.entry(id);
        share(rows, self.world) * per_row
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
        let n = share(self.rows(id), self.world);
        (self.rank * n, n)
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

/// How row shards travel between the ranks: NCCL's all-gather and reduce-scatter in a run of
/// processes ([`ProcessGroup`]). Every tensor is flat; `id` names the parameter, for an exchange
/// that needs it (the CPU tests' stand-in for other ranks).
pub trait RowExchange<B: Backend>: Send + Sync {
    /// How many ranks hold shards.
    fn world(&self) -> usize;
    /// Every rank's `shard` (the same number of elements on every rank), rank 0's first.
    fn all_gather(&self, id: ParamId, shard: Tensor<B, 1>) -> Tensor<B, 1>;
    /// The mean over the ranks of `whole` (a multiple of the world size in elements), this
    /// rank's equal part of it.
    fn reduce_scatter_mean(&self, id: ParamId, whole: Tensor<B, 1>) -> Tensor<B, 1>;
    /// [`RowExchange::all_gather`] of each shard, started now beside the device's later work; the
    /// results may be read only after [`RowExchange::wait_ahead`], which also comes before any
    /// other call of the exchange. By default they are gathered at once, in order.
    fn all_gather_ahead(&self, shards: Vec<(ParamId, Tensor<B, 1>)>) -> Vec<Tensor<B, 1>> {
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
    fn all_gather(&self, _id: ParamId, shard: Tensor<B, 1>) -> Tensor<B, 1> {
        ProcessGroup::all_gather(self, shard)
    }
    fn reduce_scatter_mean(&self, _id: ParamId, whole: Tensor<B, 1>) -> Tensor<B, 1> {
        self.reduce_scatter(whole, ReduceOp::Mean)
    }
    fn all_gather_ahead(&self, shards: Vec<(ParamId, Tensor<B, 1>)>) -> Vec<Tensor<B, 1>> {
        self.all_gather_overlapped(shards.into_iter().map(|(_, s)| s).collect())
    }
    fn wait_ahead(&self, device: &B::Device) {
        self.wait_overlapped::<B>(device);
    }
}

/// The whole parameter of `rows` rows from the ranks' shards, `shard` this rank's.
pub fn gather<B: Backend, const D: usize>(
    shard: Tensor<B, D>,
    rows: usize,
    id: ParamId,
    exchange: &dyn RowExchange<B>,
) -> Tensor<B, D> {
    let dims = shard.dims();
    let n = shard.shape().num_elements();
    trimmed(exchange.all_gather(id, shard.reshape([n])), dims, rows)
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
pub trait RowGather: AutodiffBackend {
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

impl<B: Backend, C: CheckpointStrategy> RowGather for Autodiff<B, C> {
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
    ahead: HashMap<ParamId, Tensor<AB::InnerBackend, 1>>,
}

impl<AB: RowGather> ModuleMapper<AB> for GatherMapper<'_, AB> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let rows = self.shards.rows(&id);
        let whole = match self.ahead.remove(&id) {
            Some(padded) => trimmed(padded, tensor.dims(), rows),
            None => gather(tensor.clone().inner(), rows, id, self.exchange.as_ref()),
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
    next: Option<(usize, HashMap<ParamId, Tensor<AB::InnerBackend, 1>>)>,
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
        ahead: HashMap<ParamId, Tensor<AB::InnerBackend, 1>>,
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
    fn take_ahead(&self, layer: usize) -> HashMap<ParamId, Tensor<AB::InnerBackend, 1>> {
        let Some((of, gathered)) = self.lock().next.take() else {
            return HashMap::new();
        };
        if let Some(t) = gathered.values().next() {
            self.exchange.wait_ahead(&t.device());
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
        struct Shards<B: Backend>(Vec<(ParamId, Tensor<B, 1>)>);
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Shards<AB::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                let t = param.val().inner();
                let n = t.shape().num_elements();
                self.0.push((param.id, t.reshape([n])));
            }
        }
        let mut shards = Shards(Vec::new());
        block.visit(&mut shards);
        let ids: Vec<ParamId> = shards.0.iter().map(|(id, _)| *id).collect();
        let gathered = self.exchange.all_gather_ahead(shards.0);
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
pub struct GatherBlocksPlain<B: Backend> {
    pub shards: Arc<RowShards>,
    pub exchange: Arc<dyn RowExchange<B>>,
}

/// [`GatherBlocksPlain`]'s gather of every parameter of a module.
struct PlainMapper<'a, B: Backend>(&'a GatherBlocksPlain<B>);

impl<B: Backend> ModuleMapper<B> for PlainMapper<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let rows = self.0.shards.rows(&id);
        let whole = gather(tensor, rows, id, self.0.exchange.as_ref());
        Param::from_mapped_value(id, whole, mapper)
    }
}

impl<B: Backend> BlockHook<B> for GatherBlocksPlain<B> {
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
