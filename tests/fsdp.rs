//! ZeRO-3's row shards and gathers (`trainer::parallel::fsdp`) on the CPU: a model cut into one
//! rank's row shards, whose forward gathers each block (and the parameters outside the blocks)
//! just before it runs, gives the whole model's loss, and each shard receives its rows of the
//! whole model's gradients (zero in the padding rows; bit for bit on the reference ops, within
//! f32 rounding of the order of the stream's additions on the fused ops), with the reference ops and the fused
//! ops' CPU versions, with and without recomputation, with a tied and an untied embedding, at
//! world sizes that leave padding rows. The other ranks are played by an exchange that holds the
//! whole parameters: its gather hands back the whole (padded) parameter after checking that the
//! rank's own shard is its rows, and its reduce-scatter, the mean of identical gradients, is this
//! rank's rows of the gradient. It also checks the prefetch: every block but the first is
//! gathered ahead, once per forward, and no call in order is made while gathers started ahead
//! have not been waited for. NCCL's gathers between processes run in
//! `tests/multi_process.rs`.

mod common;
mod model_cases;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Int, Tensor};
use kernels::{fp8_quantize, QuantSpec};
use model::config::{MlpKind, RecomputeKind};
use model::Gpt;
use model_cases::recompute::summed_recomputed;
use model_cases::{ids, model_config, with_combo, Combo, AWKWARD, FUSED_CPU, REFERENCE};
use trainer::parallel::fsdp::{fp8_wire, GatherBlocks, RowExchange, RowShards, Wire};

type B = Autodiff<NdArray>;

/// Every other rank, as a rank that holds the whole parameters sees them.
struct Loopback {
    world: usize,
    rank: usize,
    /// Each whole parameter, flat and padded with zero rows to `world` equal shares.
    whole: HashMap<ParamId, Tensor<NdArray, 1>>,
    /// The shape `[padded rows, columns]` of each parameter gathered as FP8 codes, its elements
    /// (unpadded), and the quantization of its shards.
    fp8: HashMap<ParamId, ([usize; 2], usize, QuantSpec)>,
    /// Bytes of the FP8 wires gathered so far, and of the parameters they stood for in bf16.
    fp8_bytes: AtomicUsize,
    bf16_bytes: AtomicUsize,
    /// Gathers started ahead and not yet waited for.
    pending: AtomicBool,
    /// Parameters gathered ahead so far.
    ahead: AtomicUsize,
    /// Gathers in order so far, by parameter.
    in_order_gathers: Mutex<HashMap<ParamId, usize>>,
}

impl Loopback {
    /// The other ranks of `shards`' split of `model`.
    fn new(model: &Gpt<B>, shards: &RowShards) -> Self {
        struct Whole<'a>(&'a RowShards, HashMap<ParamId, Tensor<NdArray, 1>>);
        impl ModuleVisitor<B> for Whole<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                let t = p.val().inner();
                let dims = t.dims();
                let per_row: usize = dims[1..].iter().product();
                let padded = self.0.shard_elements(&p.id) * self.0.world;
                let flat = t.reshape([dims[0] * per_row]);
                let zeros = Tensor::zeros([padded - dims[0] * per_row], &NdArrayDevice::Cpu);
                self.1.insert(p.id, Tensor::cat(vec![flat, zeros], 0));
            }
        }
        let mut w = Whole(shards, HashMap::new());
        model.visit(&mut w);
        let (world, rank) = (shards.world, shards.rank);
        let fp8 =
            w.1.iter()
                .filter_map(|(id, t)| {
                    let spec = shards.fp8_wire_spec(id)?;
                    let rows = shards.share(id) * world;
                    Some((*id, ([rows, t.dims()[0] / rows], shards.elements(id), spec)))
                })
                .collect();
        Self {
            world,
            rank,
            whole: w.1,
            fp8,
            fp8_bytes: AtomicUsize::new(0),
            bf16_bytes: AtomicUsize::new(0),
            pending: AtomicBool::new(false),
            ahead: AtomicUsize::new(0),
            in_order_gathers: Mutex::new(HashMap::new()),
        }
    }

    /// Panics if gathers started ahead were not waited for before a call in order.
    fn in_order(&self, what: &str) {
        assert!(
            !self.pending.load(Ordering::SeqCst),
            "{what} while gathers started ahead were in flight"
        );
    }

    /// This rank's part of a flat tensor of `world` equal parts.
    fn mine<K: burn::tensor::BasicOps<NdArray>>(
        &self,
        t: Tensor<NdArray, 1, K>,
    ) -> Tensor<NdArray, 1, K> {
        let n = t.dims()[0] / self.world;
        t.narrow(0, self.rank * n, n)
    }

    /// What the gather of `shard` brings: the whole padded parameter `id` as values, or its FP8
    /// codes and scales, after checking that the shard is this rank's part of them.
    fn gathered(&self, id: ParamId, shard: Wire<NdArray>) -> Wire<NdArray> {
        match shard {
            Wire::Values(t) => {
                assert!(
                    !self.fp8.contains_key(&id),
                    "{id} travels as values, not as the FP8 codes its split says"
                );
                Wire::Values(self.whole_checked(id, t))
            }
            Wire::Fp8 { codes, scales } => {
                let ([rows, cols], elements, spec) = *self.fp8.get(&id).expect("an FP8 wire");
                let whole = fp8_quantize(self.whole[&id].clone().reshape([rows, cols]), spec);
                let n = whole.payload.shape().num_elements();
                let whole_codes = whole.payload.reshape([n]);
                let n = whole.scales.shape().num_elements();
                let whole_scales = whole.scales.reshape([n]);
                assert_eq!(
                    ints(codes.clone()),
                    ints(self.mine(whole_codes.clone())),
                    "the FP8 codes of {id}'s shard are rank {}'s rows of the whole's",
                    self.rank
                );
                assert_eq!(
                    values(scales.clone()),
                    values(self.mine(whole_scales.clone())),
                    "and its block scales"
                );
                let sent = Wire::Fp8 { codes, scales }.bytes();
                self.fp8_bytes
                    .fetch_add(sent * self.world, Ordering::SeqCst);
                self.bf16_bytes.fetch_add(elements * 2, Ordering::SeqCst);
                Wire::Fp8 {
                    codes: whole_codes,
                    scales: whole_scales,
                }
            }
        }
    }
}

impl Loopback {
    /// The whole padded parameter `id`, after checking that `shard` is this rank's rows of it.
    fn whole_checked(&self, id: ParamId, shard: Tensor<NdArray, 1>) -> Tensor<NdArray, 1> {
        let whole = self.whole[&id].clone();
        assert_eq!(
            values(shard),
            values(self.mine(whole.clone())),
            "the shard of {id} is rank {}'s rows",
            self.rank
        );
        whole
    }
}

impl RowExchange<NdArray> for Loopback {
    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, id: ParamId, shard: Wire<NdArray>) -> Wire<NdArray> {
        self.in_order("an all-gather");
        *self.in_order_gathers.lock().unwrap().entry(id).or_default() += 1;
        self.gathered(id, shard)
    }

    fn reduce_scatter_mean(&self, _id: ParamId, whole: Tensor<NdArray, 1>) -> Tensor<NdArray, 1> {
        self.in_order("a reduce-scatter");
        self.mine(whole)
    }

    fn all_gather_ahead(&self, shards: Vec<(ParamId, Wire<NdArray>)>) -> Vec<Wire<NdArray>> {
        self.in_order("gathers started ahead");
        let n = shards.len();
        let gathered = shards
            .into_iter()
            .map(|(id, shard)| self.gathered(id, shard))
            .collect();
        self.pending.store(true, Ordering::SeqCst);
        self.ahead.fetch_add(n, Ordering::SeqCst);
        gathered
    }

    fn wait_ahead(&self, _device: &NdArrayDevice) {
        self.pending.store(false, Ordering::SeqCst);
    }
}

fn values<const D: usize>(t: Tensor<NdArray, D>) -> Vec<f32> {
    let t = t.cast(FloatDType::F32);
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn ints(t: Tensor<NdArray, 1, Int>) -> Vec<i64> {
    t.into_data().convert::<i64>().into_vec().unwrap()
}

/// The ids of a module's parameters, in module order.
fn ids_of<M: Module<B>>(module: &M) -> Vec<ParamId> {
    common::param_ids::<B, M>(module)
}

/// Every gradient in `grads` of `module`'s parameters, flat, by parameter.
fn by_id<M: Module<B>>(module: &M, grads: &GradientsParams) -> HashMap<ParamId, Vec<f32>> {
    struct Get<'a>(&'a GradientsParams, HashMap<ParamId, Vec<f32>>);
    impl ModuleVisitor<B> for Get<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.get::<NdArray, D>(p.id) {
                self.1.insert(p.id, values(g));
            }
        }
    }
    let mut get = Get(grads, HashMap::new());
    module.visit(&mut get);
    get.1
}

/// The loss and gradients of `copy` (through the recomputing forward and backward when its
/// config recomputes), its blocks gathered through `hook` when there is one.
fn loss_and_grads(
    copy: &Gpt<B>,
    x: &Tensor<B, 2, Int>,
    y: &Tensor<B, 2, Int>,
    hook: Option<&GatherBlocks<B>>,
) -> (f32, HashMap<ParamId, Vec<f32>>) {
    loss_and_grads_in(copy, &copy.precision(), x, y, hook)
}

/// [`loss_and_grads`] under `precision` (without recomputation).
fn loss_and_grads_in(
    copy: &Gpt<B>,
    precision: &model::Precision,
    x: &Tensor<B, 2, Int>,
    y: &Tensor<B, 2, Int>,
    hook: Option<&GatherBlocks<B>>,
) -> (f32, HashMap<ParamId, Vec<f32>>) {
    let precision = precision.clone();
    let (loss, grads) = if copy.config.recompute == RecomputeKind::Full {
        let hook = hook.map(|h| h as &dyn model::BlockHook<B>);
        let (loss, grads) = summed_recomputed(copy, x, y, hook);
        (values(loss)[0], grads)
    } else {
        let loss = match hook {
            Some(h) => copy.forward_loss_hooked(x.clone(), y.clone(), &precision, h),
            None => copy.forward_loss_in(x.clone(), y.clone(), &precision),
        };
        let value = values(loss.clone().inner())[0];
        (value, GradientsParams::from_grads(loss.backward(), copy))
    };
    (loss, by_id(copy, &grads))
}

/// Rows `range` of a flat gradient of `rows` rows, zero past its end.
fn rows_of(g: &[f32], rows: usize, (start, n): (usize, usize)) -> Vec<f32> {
    let per_row = g.len() / rows;
    (start * per_row..(start + n) * per_row)
        .map(|i| g.get(i).copied().unwrap_or(0.0))
        .collect()
}

/// Asserts that `grads` holds, for every parameter of `whole` (the whole model's gradients), this
/// rank's rows of it (zero in padding rows), each within `rtol` of the parameter's largest
/// gradient (0: bit for bit).
fn assert_shards_of(
    whole: &HashMap<ParamId, Vec<f32>>,
    grads: &HashMap<ParamId, Vec<f32>>,
    shards: &RowShards,
    rtol: f32,
    what: &str,
) {
    assert_eq!(
        grads.len(),
        whole.len(),
        "{what}: every parameter has a gradient"
    );
    for (id, g) in whole {
        let want = rows_of(g, shards.rows(id), shards.range(id));
        let got = grads.get(id).expect("a gradient");
        assert_eq!(got.len(), want.len(), "{what}: the shard of {id}");
        let big = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        // A NaN difference is kept (`f32::max` would drop it) and fails the check.
        let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| {
            let d = (a - b).abs();
            if d.is_nan() || d > m {
                d
            } else {
                m
            }
        });
        assert!(
            worst <= rtol * big,
            "{what}: {id}'s gradient is off by {worst:e} (largest {big:e}; FP8 wire: {})",
            shards.fp8_wire_spec(id).is_some()
        );
    }
}

#[test]
fn a_sharded_model_gives_the_whole_models_loss_and_each_shard_its_rows_of_the_gradients() {
    let _guard = common::serial();
    let dev = NdArrayDevice::Cpu;
    let cases: [(MlpKind, Combo, RecomputeKind, usize); 6] = [
        (MlpKind::Gelu, REFERENCE, RecomputeKind::None, 1),
        (MlpKind::Swiglu, FUSED_CPU, RecomputeKind::None, 1),
        (MlpKind::Swiglu, FUSED_CPU, RecomputeKind::Selective, 1),
        (MlpKind::Gelu, REFERENCE, RecomputeKind::Full, 1),
        (MlpKind::Gelu, FUSED_CPU, RecomputeKind::Full, 2),
        (MlpKind::Swiglu, REFERENCE, RecomputeKind::Full, 2),
    ];
    for (mlp, combo, recompute, every) in cases {
        let mut cfg = model_config(mlp, AWKWARD);
        cfg.n_layer = 3;
        cfg.recompute = recompute;
        cfg.recompute_every = every;
        let whole = with_combo(&Gpt::<B>::new(&cfg, AWKWARD.vocab, &dev), combo);
        let copy = whole.compute_copy(FloatDType::F32);
        let (x, y) = (
            ids::<B>(AWKWARD.batch, AWKWARD.seq, AWKWARD.vocab, 5, &dev),
            ids::<B>(AWKWARD.batch, AWKWARD.seq, AWKWARD.vocab, 6, &dev),
        );
        let (plain_loss, plain) = loss_and_grads(&copy, &x, &y, None);
        // 67 vocabulary rows leave padding at 2 and 5 ranks; the blocks' 192 rows at 5.
        for (world, rank) in [(2, 1), (5, 0), (5, 4)] {
            let what = format!(
                "{mlp:?}, {combo:?}, recompute {recompute:?} every {every}, rank {rank} of {world}"
            );
            let shards = Arc::new(RowShards::new(&copy, rank, world));
            let sharded = shards.shard(copy.clone());
            let exchange = Arc::new(Loopback::new(&copy, &shards));
            let hook = GatherBlocks::<B>::new(shards.clone(), exchange.clone());
            let (loss, grads) = loss_and_grads(&sharded, &x, &y, Some(&hook));
            assert_eq!(loss, plain_loss, "{what}: the loss");
            let later_blocks: usize = copy.blocks[1..].iter().map(|b| ids_of(b).len()).sum();
            assert_eq!(
                exchange.ahead.load(Ordering::SeqCst),
                later_blocks,
                "{what}: every block but the first gathered ahead, once"
            );
            exchange.in_order("the step's end");
            // A later block's weights come from the gathers started ahead, and are gathered in
            // order only for a recomputed block's second run.
            let in_order = exchange.in_order_gathers.lock().unwrap().clone();
            for (layer, block) in copy.blocks.iter().enumerate().skip(1) {
                let again = usize::from(cfg.recomputes(layer));
                for id in ids_of(block) {
                    assert_eq!(
                        in_order.get(&id).copied().unwrap_or(0),
                        again,
                        "{what}: block {layer}'s {id} gathered in order"
                    );
                }
            }
            // Bit for bit on the reference ops; with the fused ops, where the gathers' places in
            // the graph change the order in which Burn's backward adds the residual stream's
            // gradients, within f32 rounding of that order.
            let rtol = if combo == REFERENCE { 0.0 } else { 1e-5 };
            assert_shards_of(&plain, &grads, &shards, rtol, &what);
        }
    }
}

/// ZeRO-3 with FP8 weights on the wire: under an FP8 recipe with block scales, the projection
/// weights travel as their shards' FP8 codes and 128 x 128 block scales (each shard a multiple of
/// 128 rows, padding rows included), and the sharded model still gives the whole FP8 model's loss
/// and each shard its rows of its gradients, bit for bit on the reference ops: the gathered codes
/// dequantize to values that the FP8 linear layer quantizes to the same FP8 values as the weight.
/// The shards' codes and scales are checked to be the rank's rows of the whole weight's (by the
/// stand-in exchange), and fewer bytes than the weights' bf16 values travel. Over three ranks,
/// where rounding the shards up to 128 rows would add more than an eighth, every weight travels
/// as values, and the loss and gradients are the same.
#[test]
fn fp8_weights_travel_as_codes_and_train_as_the_whole_fp8_model() {
    let _guard = common::serial();
    let dev = NdArrayDevice::Cpu;
    // Width 256 (four heads of 64) and an MLP of 480: over two ranks the projections of 256 rows
    // split into shards of 128, and those of 480 rows into two of 256, the second with 32 rows of
    // padding.
    let shape = model_cases::Shape {
        heads: 4,
        ..AWKWARD
    };
    for mlp in [MlpKind::Gelu, MlpKind::Swiglu] {
        let mut cfg = model_config(mlp, shape);
        cfg.n_layer = 3;
        cfg.d_ff = 480;
        let whole = with_combo(&Gpt::<B>::new(&cfg, shape.vocab, &dev), REFERENCE);
        let copy = whole.compute_copy(FloatDType::F32);
        let mut precision = copy.precision();
        precision.fp8 = Some(kernels::Fp8LinearConfig::default());
        // The attention's output projection computes in the compute dtype: its weight travels
        // as values, beside the others' codes.
        precision.fp8_compute_paths = vec!["attn.proj".into()];
        let (x, y) = (
            ids::<B>(shape.batch, shape.seq, shape.vocab, 5, &dev),
            ids::<B>(shape.batch, shape.seq, shape.vocab, 6, &dev),
        );
        let (plain_loss, plain) = loss_and_grads_in(&copy, &precision, &x, &y, None);
        let wire = fp8_wire(&copy, &precision);
        assert_eq!(
            wire.len(),
            3 * cfg.n_layer,
            "{mlp:?}: three FP8 projections a block"
        );
        for (world, rank, as_codes) in [(2, 0, wire.len()), (2, 1, wire.len()), (3, 2, 0)] {
            let what = format!("{mlp:?}, FP8 wire, rank {rank} of {world}");
            let shards = RowShards::new(&copy, rank, world).with_fp8_wire(wire.clone());
            let shards = Arc::new(shards);
            assert_eq!(
                shards.fp8_wire_len(),
                as_codes,
                "{what}: the weights gathered as FP8 codes"
            );
            let sharded = shards.shard(copy.clone());
            let exchange = Arc::new(Loopback::new(&copy, &shards));
            let hook = GatherBlocks::<B>::new(shards.clone(), exchange.clone());
            let (loss, grads) = loss_and_grads_in(&sharded, &precision, &x, &y, Some(&hook));
            assert_eq!(loss, plain_loss, "{what}: the loss");
            let (fp8, bf16) = (
                exchange.fp8_bytes.load(Ordering::SeqCst),
                exchange.bf16_bytes.load(Ordering::SeqCst),
            );
            assert!(
                (as_codes == 0 && fp8 == 0) || (fp8 > 0 && fp8 * 10 < bf16 * 6),
                "{what}: {fp8} bytes of FP8 codes and scales against {bf16} of bf16"
            );
            assert_shards_of(&plain, &grads, &shards, 0.0, &what);
        }
    }
}
