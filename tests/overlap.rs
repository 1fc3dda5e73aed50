//! The gradient hook that lets a run of processes average each block's gradients while the
//! backward still runs (`trainer::parallel::overlap`), on the CPU: a hooked forward's backward
//! hands every block parameter's gradient to the sink exactly once, bit for bit the gradient of
//! the plain backward, the last block's first and each block's before any of the blocks below it;
//! the parameters outside the blocks keep their gradients in Burn's. The buckets that the
//! gradients are averaged in cover every parameter once, in that order, and the reducer that
//! packs them, carries the earlier micro-batches' gradients into them and unpacks them gives back
//! exactly the summed gradients when the exchange is a group of one. The exchange between ranks
//! needs NCCL: `tests/multi_process.rs` trains with it against one GPU.

mod common;
mod model_cases;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use model::config::{MlpKind, RecomputeKind};
use model::gpt::Block;
use model::{BlockHook, Gpt};
use model_cases::{ids, model_config, with_combo, Combo, AWKWARD, FUSED_CPU, REFERENCE};
use trainer::parallel::overlap::{hook_block, BucketExchange, BucketPlan, Hooks, Reducer};

type B = Autodiff<NdArray>;

/// What the sink received: (layer, parameter, gradient values), in the order received.
type Received = Arc<Mutex<Vec<(usize, ParamId, Vec<f32>)>>>;

/// Hooks every block, recording what the sink receives.
struct Recorder {
    received: Received,
}

impl BlockHook<B> for Recorder {
    fn block(&self, layer: usize, block: &Block<B>, input: &Tensor<B, 3>) -> Block<B> {
        let received = self.received.clone();
        let sink = Arc::new(move |id: ParamId, g| {
            let t = Tensor::<NdArray, 1>::from_primitive(TensorPrimitive::Float(g));
            let values = t.into_data().convert::<f32>().into_vec().unwrap();
            received.lock().unwrap().push((layer, id, values));
        });
        hook_block(block, input, sink)
    }
}

/// Every gradient in `grads` of `module`'s parameters, by id, as f32 values.
fn by_id<M: Module<B>>(module: &M, grads: &GradientsParams) -> HashMap<ParamId, Vec<f32>> {
    struct Get<'a>(&'a GradientsParams, HashMap<ParamId, Vec<f32>>);
    impl ModuleVisitor<B> for Get<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            if let Some(g) = self.0.get::<NdArray, D>(p.id) {
                let v = g.cast(FloatDType::F32).into_data().convert::<f32>();
                self.1.insert(p.id, v.into_vec().unwrap());
            }
        }
    }
    let mut get = Get(grads, HashMap::new());
    module.visit(&mut get);
    get.1
}

/// The ids of a module's parameters, in module order.
fn ids_of<M: Module<B>>(module: &M) -> Vec<ParamId> {
    common::param_ids::<B, M>(module)
}

fn model(mlp: MlpKind, combo: Combo, recompute: RecomputeKind) -> Gpt<B> {
    let mut cfg = model_config(mlp, AWKWARD);
    cfg.n_layer = 3;
    cfg.recompute = recompute;
    with_combo(
        &Gpt::<B>::new(&cfg, AWKWARD.vocab, &NdArrayDevice::Cpu),
        combo,
    )
}

#[test]
fn hooked_blocks_hand_over_the_plain_gradients_last_block_first() {
    let _guard = common::serial();
    let dev = NdArrayDevice::Cpu;
    for (mlp, combo, recompute) in [
        (MlpKind::Gelu, REFERENCE, RecomputeKind::None),
        (MlpKind::Swiglu, FUSED_CPU, RecomputeKind::None),
        (MlpKind::Swiglu, FUSED_CPU, RecomputeKind::Selective),
    ] {
        let what = format!("{mlp:?}, {combo:?}, recompute {recompute:?}");
        let copy = model(mlp, combo, recompute).compute_copy(FloatDType::F32);
        let (x, y) = (
            ids::<B>(AWKWARD.batch, AWKWARD.seq, AWKWARD.vocab, 5, &dev),
            ids::<B>(AWKWARD.batch, AWKWARD.seq, AWKWARD.vocab, 6, &dev),
        );
        let precision = copy.precision();

        let plain_loss = copy.forward_loss_in(x.clone(), y.clone(), &precision);
        let plain = by_id(
            &copy,
            &GradientsParams::from_grads(plain_loss.backward(), &copy),
        );

        let recorder = Recorder {
            received: Arc::new(Mutex::new(Vec::new())),
        };
        let loss = copy.forward_loss_hooked(x, y, &precision, &recorder);
        let rest = by_id(&copy, &GradientsParams::from_grads(loss.backward(), &copy));
        let received = recorder.received.lock().unwrap().clone();

        let layer_of: HashMap<ParamId, usize> = copy
            .blocks
            .iter()
            .enumerate()
            .flat_map(|(l, b)| ids_of(b).into_iter().map(move |id| (id, l)))
            .collect();
        assert_eq!(
            received.len(),
            layer_of.len(),
            "{what}: one gradient per block parameter"
        );
        for (i, (layer, id, values)) in received.iter().enumerate() {
            assert_eq!(
                layer_of.get(id),
                Some(layer),
                "{what}: a parameter of block {layer}"
            );
            assert!(
                !rest.contains_key(id),
                "{what}: a hooked parameter kept a gradient"
            );
            assert_eq!(Some(values), plain.get(id), "{what}: gradient {i} differs");
            if let Some((before, ..)) = i.checked_sub(1).map(|j| &received[j]) {
                assert!(
                    before >= layer,
                    "{what}: block {layer} came after block {before}"
                );
            }
        }
        assert_eq!(
            received[0].0, 2,
            "{what}: the last block's gradients come first"
        );
        for id in ids_of(&copy) {
            if !layer_of.contains_key(&id) {
                assert_eq!(
                    rest.get(&id),
                    plain.get(&id),
                    "{what}: a parameter outside the blocks"
                );
            }
        }
    }
}

#[test]
fn buckets_hold_every_parameter_once_in_backward_order() {
    let m = model(MlpKind::Swiglu, REFERENCE, RecomputeKind::None);
    let sizes: HashMap<ParamId, usize> = {
        let all = ids_of(&m);
        let plan = BucketPlan::new(&m, usize::MAX);
        assert_eq!(
            plan.buckets.len(),
            1,
            "everything fits one unbounded bucket"
        );
        assert_eq!(plan.buckets[0].len(), all.len());
        plan.buckets[0].iter().copied().collect()
    };
    let last_block = ids_of(&m.blocks[2]);
    for bytes in [1, 4096, 100_000, 1 << 20] {
        let plan = BucketPlan::new(&m, bytes);
        let flat: Vec<(ParamId, usize)> = plan.buckets.iter().flatten().copied().collect();
        assert_eq!(flat.len(), sizes.len(), "{bytes} B: every parameter once");
        for (id, n) in &flat {
            assert_eq!(sizes.get(id), Some(n), "{bytes} B: the parameter's size");
        }
        for b in &plan.buckets {
            let size: usize = b.iter().map(|p| p.1 * 4).sum();
            assert!(
                b.len() == 1 || size <= bytes,
                "{bytes} B: a bucket of {size} B"
            );
        }
        assert_eq!(
            flat[0].0,
            *last_block.last().unwrap(),
            "{bytes} B: the last block's last parameter first"
        );
        let embedding = m.wte.weight.id;
        let at = flat.iter().position(|p| p.0 == embedding).unwrap();
        let blocks: usize = m.blocks.iter().map(|b| ids_of(b).len()).sum();
        assert!(
            at >= blocks,
            "{bytes} B: the embedding after every block parameter"
        );
    }
}

/// A group of one: averaging over the ranks leaves a bucket as it is. Counts the buckets.
struct Alone(Mutex<usize>);

impl BucketExchange<NdArray> for Alone {
    fn launch(&self, bucket: Tensor<NdArray, 1>) -> Tensor<NdArray, 1> {
        *self.0.lock().unwrap() += 1;
        bucket
    }
    fn wait(&self, _: &NdArrayDevice) {}
}

#[test]
fn the_reducer_hands_back_the_summed_gradients_of_its_micro_batches() {
    let _guard = common::serial();
    let dev = NdArrayDevice::Cpu;
    for (mlp, combo) in [(MlpKind::Gelu, REFERENCE), (MlpKind::Swiglu, FUSED_CPU)] {
        let copy = model(mlp, combo, RecomputeKind::None).compute_copy(FloatDType::F32);
        let precision = copy.precision();
        let batch = |seed| {
            let ids = |s| ids::<B>(AWKWARD.batch, AWKWARD.seq, AWKWARD.vocab, s, &dev);
            (ids(seed), ids(seed + 1))
        };
        let plain = |seed| {
            let (x, y) = batch(seed);
            let loss = copy.forward_loss_in(x, y, &precision);
            GradientsParams::from_grads(loss.backward(), &copy)
        };
        // Two micro-batches summed, as the trainer's step sums them.
        let summed = trainer::optim::accumulate_grads::<B, _>(&copy, plain(5), plain(7));
        let expected = by_id(&copy, &summed);
        for bytes in [4096, 100_000, usize::MAX] {
            let exchange = Arc::new(Alone(Mutex::new(0)));
            let plan = BucketPlan::new(&copy, bytes);
            let buckets = plan.buckets.len();
            let reducer = Reducer::new(exchange.clone(), plan);
            reducer.carry::<B, _>(&copy, plain(5));
            let (x, y) = batch(7);
            let hooks = Hooks::<B> {
                reducer: reducer.clone(),
            };
            let loss = copy.forward_loss_hooked(x, y, &precision, &hooks);
            let rest = GradientsParams::from_grads(loss.backward(), &copy);
            let got = by_id(&copy, &reducer.finish::<B, _>(&copy, rest));
            let what = format!("{mlp:?}, buckets of {bytes} B");
            assert_eq!(
                *exchange.0.lock().unwrap(),
                buckets,
                "{what}: every bucket once"
            );
            assert_eq!(got.len(), expected.len(), "{what}: every parameter");
            for (id, g) in &expected {
                let mine = got
                    .get(id)
                    .unwrap_or_else(|| panic!("{what}: a gradient is missing"));
                // The same additions: the carried sum plus this micro-batch's gradient.
                assert_eq!(mine, g, "{what}: a gradient differs");
            }
        }
    }
}
