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
use model::config::{MlpKind, RecomputeKind};
use model::Gpt;
use model_cases::recompute::summed_recomputed;
use model_cases::{ids, model_config, with_combo, Combo, AWKWARD, FUSED_CPU, REFERENCE};
use trainer::parallel::fsdp::{share, GatherBlocks, RowExchange, RowShards};

type B = Autodiff<NdArray>;

/// Every other rank, as a rank that holds the whole parameters sees them.
struct Loopback {
    world: usize,
    rank: usize,
    /// Each whole parameter, flat and padded with zero rows to `world` equal shares.
    whole: HashMap<ParamId, Tensor<NdArray, 1>>,
    /// Gathers started ahead and not yet waited for.
    pending: AtomicBool,
    /// Parameters gathered ahead so far.
    ahead: AtomicUsize,
    /// Gathers in order so far, by parameter.
    in_order_gathers: Mutex<HashMap<ParamId, usize>>,
}

impl Loopback {
    fn new(model: &Gpt<B>, world: usize, rank: usize) -> Self {
        struct Whole(usize, HashMap<ParamId, Tensor<NdArray, 1>>);
        impl ModuleVisitor<B> for Whole {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                let t = p.val().inner();
                let dims = t.dims();
                let per_row: usize = dims[1..].iter().product();
                let padded = share(dims[0], self.0) * self.0 * per_row;
                let flat = t.reshape([dims[0] * per_row]);
                let zeros = Tensor::zeros([padded - dims[0] * per_row], &NdArrayDevice::Cpu);
                self.1.insert(p.id, Tensor::cat(vec![flat, zeros], 0));
            }
        }
        let mut w = Whole(world, HashMap::new());
        model.visit(&mut w);
        Self {
            world,
            rank,
            whole: w.1,
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
    fn mine(&self, t: Tensor<NdArray, 1>) -> Tensor<NdArray, 1> {
        let n = t.dims()[0] / self.world;
        t.narrow(0, self.rank * n, n)
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

    fn all_gather(&self, id: ParamId, shard: Tensor<NdArray, 1>) -> Tensor<NdArray, 1> {
        self.in_order("an all-gather");
        *self.in_order_gathers.lock().unwrap().entry(id).or_default() += 1;
        self.whole_checked(id, shard)
    }

    fn reduce_scatter_mean(&self, _id: ParamId, whole: Tensor<NdArray, 1>) -> Tensor<NdArray, 1> {
        self.in_order("a reduce-scatter");
        self.mine(whole)
    }

    fn all_gather_ahead(
        &self,
        shards: Vec<(ParamId, Tensor<NdArray, 1>)>,
    ) -> Vec<Tensor<NdArray, 1>> {
        self.in_order("gathers started ahead");
        let n = shards.len();
        let gathered = shards
            .into_iter()
            .map(|(id, shard)| self.whole_checked(id, shard))
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
    let precision = copy.precision();
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
            let exchange = Arc::new(Loopback::new(&copy, world, rank));
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
            assert_eq!(
                grads.len(),
                plain.len(),
                "{what}: every parameter has a gradient"
            );
            for (id, g) in &plain {
                let want = rows_of(g, shards.rows(id), shards.range(id));
                let got = grads.get(id).expect("a gradient");
                assert_eq!(got.len(), want.len(), "{what}: the shard of {id}");
                // Bit for bit on the reference ops; with the fused ops, where the gathers' places
                // in the graph change the order in which Burn's backward adds the residual
                // stream's gradients, within f32 rounding of that order.
                let big = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                let atol = if combo == REFERENCE { 0.0 } else { 1e-5 * big };
                let worst = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    worst <= atol,
                    "{what}: {id}'s gradient is off by {worst:e} (largest {big:e})"
                );
            }
        }
    }
}
