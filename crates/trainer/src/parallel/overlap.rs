//! Gradients averaged in buckets while the backward still runs, for runs of one process per GPU
//! (`training.bucket_mb`).
//!
//! Each block's parameters pass through a hook op ([`GradHook`]) placed one level below the deepest
//! tensor entering the block (`model::block_hook`): its backward runs as soon as the block's backward
//! has produced the whole gradient of the parameter, and hands that gradient (in f32, plus the
//! step's earlier micro-batches') to the [`Reducer`] instead of to Burn's gradients. The reducer
//! packs the gradients into buckets of about `training.bucket_mb` MB, laid out once from the
//! parameter order (last block first, as the backward produces them; the parameters outside the
//! blocks last), and all-reduces each bucket on the process group's own stream
//! ([`kernels::collective::ProcessGroup::all_reduce_overlapped`]) as soon as it and every bucket
//! before it are full. Buckets are launched strictly in that order on every rank, whatever order
//! a backward produces gradients in, as NCCL needs. [`Reducer::finish`] launches what is left
//! (the embedding, the final norm and the LM head, whose gradients are complete only at the end),
//! waits for every bucket and hands back the averaged gradients by parameter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::zero::parameters;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorPrimitive};
use kernels::collective::{CollectiveBackend, ProcessGroup, ReduceOp};
use model::gpt::Block;
use model::{BlockHook, Gpt};

/// Why a run of processes with ZeRO stage `zero` averages its gradients one tensor at a time
/// after the backward instead of in buckets during it; `None` when it takes the buckets (but on
/// numerics steps, whose statistics read each micro-batch's weight gradients).
pub fn after_backward_because(cfg: &crate::config::Config, zero: u8) -> Option<&'static str> {
    if cfg.training.bucket_mb == 0.0 {
        Some("training.bucket_mb = 0")
    } else if zero == 2 {
        Some("ZeRO-2 reduces each gradient onto its owner")
    } else if zero == 3 {
        Some("ZeRO-3 reduce-scatters each block's gradients onto the shards as the backward leaves the block")
    } else if cfg.model.recompute == model::RecomputeKind::Full {
        Some("model.recompute = \"full\" runs each block's backward on its own")
    } else {
        None
    }
}

/// The log line of a run of processes on how its gradients are averaged.
pub fn describe(cfg: &crate::config::Config, zero: u8) -> String {
    if zero == 3 {
        return "gradients: reduce-scattered onto each rank's row shards as the backward leaves each block (ZeRO-3)"
            .into();
    }
    match after_backward_because(cfg, zero) {
        Some(why) => format!("gradients: averaged one tensor at a time after the backward ({why})"),
        None => format!(
            "gradients: averaged in buckets of up to {} MB while the backward runs (training.bucket_mb)",
            cfg.training.bucket_mb
        ),
    }
}

/// Where a hooked parameter's whole gradient goes.
pub type GradSink<B> = Arc<dyn Fn(FloatTensor<B>) + Send + Sync>;

/// An autodiff backend whose tensors can pass through a gradient hook.
pub trait GradHook: AutodiffBackend {
    /// `w` unchanged, as a new node one level below `anchor` (which only places it): in the
    /// backward, once every use of the result has run, `sink` receives its whole gradient, and
    /// `w` receives none. An untracked `w` is returned as it is.
    fn grad_hook(
        w: FloatTensor<Self>,
        anchor: &FloatTensor<Self>,
        sink: GradSink<Self::InnerBackend>,
    ) -> FloatTensor<Self>;
}

/// The backward of the hook op: the gradient to the sink.
#[derive(Debug)]
struct HookBackward;

/// The sink, as the backward's state.
#[derive(Clone)]
struct SinkState<B: Backend>(GradSink<B>);

impl<B: Backend> std::fmt::Debug for SinkState<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradSink")
    }
}

impl<B: Backend> Backward<B, 2> for HookBackward {
    type State = SinkState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        (ops.state.0)(grad);
    }
}

impl<B: Backend, C: CheckpointStrategy> GradHook for Autodiff<B, C> {
    fn grad_hook(
        w: FloatTensor<Self>,
        anchor: &FloatTensor<Self>,
        sink: GradSink<B>,
    ) -> FloatTensor<Self> {
        if !w.is_tracked() {
            return w;
        }
        let out = w.primitive.clone();
        match HookBackward
            .prepare::<C>([w.node.clone(), anchor.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(SinkState(sink), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// The buckets of a model's parameters: which parameters each holds, in launch order.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketPlan {
    /// Per bucket, its parameters and their element counts, in the order packed.
    pub buckets: Vec<Vec<(ParamId, usize)>>,
}

impl BucketPlan {
    /// Buckets of at most `bucket_bytes` of f32 gradients each (a larger parameter gets one of its
    /// own), filled in the order the backward completes gradients: block `n_layer - 1` first,
    /// each block's parameters in reverse module order, then the parameters outside the blocks.
    pub fn new<B: Backend>(model: &Gpt<B>, bucket_bytes: usize) -> Self {
        let mut order: Vec<(ParamId, usize)> = Vec::new();
        for block in model.blocks.iter().rev() {
            let mut ids = parameters(block);
            ids.reverse();
            order.extend(ids);
        }
        let in_blocks: std::collections::HashSet<ParamId> = order.iter().map(|p| p.0).collect();
        order.extend(
            parameters(model)
                .into_iter()
                .filter(|(id, _)| !in_blocks.contains(id)),
        );
        let mut buckets: Vec<Vec<(ParamId, usize)>> = Vec::new();
        let mut bytes = 0;
        for (id, n) in order {
            let size = n * 4;
            match buckets.last_mut() {
                Some(b) if bytes + size <= bucket_bytes => b.push((id, n)),
                _ => {
                    buckets.push(vec![(id, n)]);
                    bytes = 0;
                }
            }
            bytes += size;
        }
        Self { buckets }
    }
}

/// How a reducer averages a bucket over the ranks: a process group's all-reduce beside CubeCL's
/// work, and the wait for it.
pub trait BucketExchange<B: Backend>: Send + Sync {
    /// Starts averaging `bucket` over the ranks; the result is read after [`BucketExchange::wait`].
    fn launch(&self, bucket: Tensor<B, 1>) -> Tensor<B, 1>;
    /// Orders `device`'s later work behind every bucket launched so far.
    fn wait(&self, device: &B::Device);
}

impl<B: CollectiveBackend> BucketExchange<B> for ProcessGroup {
    fn launch(&self, bucket: Tensor<B, 1>) -> Tensor<B, 1> {
        self.all_reduce_overlapped(bucket, ReduceOp::Mean)
    }
    fn wait(&self, device: &B::Device) {
        self.wait_overlapped::<B>(device);
    }
}

/// One step's bucketed reduction of gradients over the ranks; clones share it.
pub struct Reducer<B: Backend> {
    state: Arc<Mutex<State<B>>>,
}

impl<B: Backend> Clone for Reducer<B> {
    fn clone(&self) -> Self {
        Self {
            state: self.state.clone(),
        }
    }
}

struct State<B: Backend> {
    exchange: Arc<dyn BucketExchange<B>>,
    plan: BucketPlan,
    /// Each parameter's bucket and place in it.
    slot: HashMap<ParamId, (usize, usize)>,
    /// The gradients received for the buckets not yet launched (flat, f32).
    received: Vec<Vec<Option<Tensor<B, 1>>>>,
    /// The earlier micro-batches' summed gradients (flat, f32), added as each one arrives.
    carry: HashMap<ParamId, Tensor<B, 1>>,
    /// The launched buckets, in order.
    launched: Vec<Launched<B>>,
}

/// A launched bucket: its averaged gradients (readable after the group's wait; `None` when it
/// received nothing), and where each of its parameters starts in them (`None` for a parameter
/// that received no gradient, left out).
struct Launched<B: Backend> {
    reduced: Option<Tensor<B, 1>>,
    starts: Vec<Option<usize>>,
}

impl<B: kernels::Backend> Reducer<B> {
    /// A reducer for one step, with `plan`'s buckets averaged through `exchange`.
    pub fn new(exchange: Arc<dyn BucketExchange<B>>, plan: BucketPlan) -> Self {
        let mut slot = HashMap::new();
        for (b, params) in plan.buckets.iter().enumerate() {
            for (i, (id, _)) in params.iter().enumerate() {
                slot.insert(*id, (b, i));
            }
        }
        let received = plan.buckets.iter().map(|p| vec![None; p.len()]).collect();
        Self {
            state: Arc::new(Mutex::new(State {
                exchange,
                plan,
                slot,
                received,
                carry: HashMap::new(),
                launched: Vec::new(),
            })),
        }
    }

    /// Adds the step's earlier micro-batches' summed gradients (under `module`'s parameters) to
    /// the gradients that arrive next.
    pub fn carry<AB, M>(&self, module: &M, grads: GradientsParams)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let flat = flatten_all::<AB, M>(module, grads);
        self.lock().carry.extend(flat);
    }

    /// Parameter `id`'s whole gradient for this micro-batch: the rest of the step's added, cast
    /// to f32, put in its bucket, and every bucket that is then full launched in order.
    pub fn receive(&self, id: ParamId, grad: FloatTensor<B>) {
        let n = burn::tensor::TensorMetadata::shape(&grad).num_elements();
        let flat = B::float_reshape(grad, Shape::new([n]));
        let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat));
        let mut s = self.lock();
        let flat = match s.carry.remove(&id) {
            Some(earlier) => kernels::add_as_f32(earlier, flat),
            None => flat.cast(FloatDType::F32),
        };
        let Some(&(b, i)) = s.slot.get(&id) else {
            unreachable!("a hooked parameter is in the bucket plan");
        };
        s.received[b][i] = Some(flat);
        s.launch_full();
    }

    /// The averaged gradients of every parameter of `module`: the hooked ones received so far and
    /// `rest` (this micro-batch's other gradients), after the last buckets are launched and
    /// CubeCL's stream waits for all of them.
    pub fn finish<AB, M>(self, module: &M, rest: GradientsParams) -> GradientsParams
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let rest = flatten_all::<AB, M>(module, rest);
        let mut s = self.lock();
        for (id, flat) in rest {
            let flat = match s.carry.remove(&id) {
                Some(earlier) => kernels::add_as_f32(earlier, flat),
                None => flat,
            };
            if let Some(&(b, i)) = s.slot.get(&id) {
                s.received[b][i] = Some(flat);
            }
        }
        // A parameter without any gradient (unused by the forward, on every rank alike).
        let leftover: Vec<(ParamId, Tensor<B, 1>)> = s.carry.drain().collect();
        for (id, flat) in leftover {
            if let Some(&(b, i)) = s.slot.get(&id) {
                s.received[b][i] = Some(flat);
            }
        }
        while s.launched.len() < s.plan.buckets.len() {
            s.launch_next();
        }
        if let Some(first) = s.launched.iter().find_map(|l| l.reduced.as_ref()) {
            s.exchange.wait(&first.device());
        }
        let mut out = Averaged {
            state: &s,
            grads: GradientsParams::new(),
        };
        module.visit(&mut out);
        out.grads
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<B: kernels::Backend> State<B> {
    /// Launches, in order, every bucket whose gradients have all arrived.
    fn launch_full(&mut self) {
        while let Some(bucket) = self.received.get(self.launched.len()) {
            if bucket.iter().any(Option::is_none) {
                return;
            }
            self.launch_next();
        }
    }

    /// Launches the next bucket with what it received (a parameter that received nothing is left
    /// out, on every rank alike: no rank computed a gradient for it).
    fn launch_next(&mut self) {
        let index = self.launched.len();
        let sizes = self.plan.buckets[index].iter().map(|p| p.1);
        let mut starts = Vec::new();
        let mut parts: Vec<Tensor<B, 1>> = Vec::new();
        let mut at = 0;
        for (got, n) in self.received[index].iter_mut().zip(sizes) {
            match got.take() {
                Some(g) => {
                    starts.push(Some(at));
                    parts.push(g);
                    at += n;
                }
                None => starts.push(None),
            }
        }
        let bucket = match parts.len() {
            0 => None,
            1 => parts.pop(),
            _ => Some(Tensor::cat(parts, 0)),
        };
        let reduced = bucket.map(|b| self.exchange.launch(b));
        self.launched.push(Launched { reduced, starts });
    }
}

/// Registers each parameter's averaged gradient, a slice of its bucket in the parameter's shape.
struct Averaged<'a, B: Backend> {
    state: &'a State<B>,
    grads: GradientsParams,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for Averaged<'_, AB::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let Some(&(b, i)) = self.state.slot.get(&param.id) else {
            return;
        };
        let launched = &self.state.launched[b];
        let (Some(bucket), Some(offset)) = (&launched.reduced, launched.starts[i]) else {
            // It received no gradient (see `State::launch_next`).
            return;
        };
        let n = self.state.plan.buckets[b][i].1;
        let g = bucket.clone().narrow(0, offset, n).reshape(param.shape());
        self.grads.register::<AB::InnerBackend, D>(param.id, g);
    }
}

/// Every gradient of `module` in `grads`, flat and in f32, by parameter.
fn flatten_all<AB, M>(
    module: &M,
    mut grads: GradientsParams,
) -> Vec<(ParamId, Tensor<AB::InnerBackend, 1>)>
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    struct Flat<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        out: Vec<(ParamId, Tensor<B, 1>)>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Flat<'_, AB::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id) {
                let n = g.shape().num_elements();
                self.out
                    .push((param.id, g.cast(FloatDType::F32).reshape([n])));
            }
        }
    }
    let mut f = Flat {
        grads: &mut grads,
        out: Vec::new(),
    };
    module.visit(&mut f);
    f.out
}

/// Where each hooked parameter's whole gradient goes, by parameter.
pub type ParamSink<B> = Arc<dyn Fn(ParamId, FloatTensor<B>) + Send + Sync>;

/// `block` with each of its parameters passed through [`GradHook::grad_hook`], anchored at the
/// deepest tensor `input` entering the block: in the backward, `sink` receives each parameter's whole
/// gradient as soon as the block's backward is done with it.
pub fn hook_block<AB: GradHook>(
    block: &Block<AB>,
    input: &Tensor<AB, 3>,
    sink: ParamSink<AB::InnerBackend>,
) -> Block<AB> {
    struct Through<AB: GradHook> {
        sink: ParamSink<AB::InnerBackend>,
        anchor: FloatTensor<AB>,
    }
    impl<AB: GradHook> ModuleMapper<AB> for Through<AB> {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<AB, D>>,
        ) -> Param<Tensor<AB, D>> {
            let (id, tensor, mapper) = param.consume();
            let sink = self.sink.clone();
            let to_sink: GradSink<AB::InnerBackend> = Arc::new(move |g| sink(id, g));
            let hooked = AB::grad_hook(tensor.into_primitive().tensor(), &self.anchor, to_sink);
            let hooked = Tensor::from_primitive(TensorPrimitive::Float(hooked));
            Param::from_mapped_value(id, hooked, mapper)
        }
    }
    let anchor = input.clone().into_primitive().tensor();
    block.clone().map(&mut Through { sink, anchor })
}

/// The block hook of a step: each block parameter's gradient to the reducer.
pub struct Hooks<AB: GradHook> {
    pub reducer: Reducer<AB::InnerBackend>,
}

impl<AB> BlockHook<AB> for Hooks<AB>
where
    AB: GradHook,
    AB::InnerBackend: kernels::Backend,
{
    fn block(&self, _layer: usize, block: &Block<AB>, input: &Tensor<AB, 3>) -> Block<AB> {
        let reducer = self.reducer.clone();
        hook_block(block, input, Arc::new(move |id, g| reducer.receive(id, g)))
    }
}
