//! Activations under `Autodiff`: the inputs are saved, the gradients recomputed from them.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;

use super::{ActivationKernels, GeluForm};

#[derive(Debug)]
struct SwigluSplitBackward;

impl<B: ActivationKernels> Backward<B, 2> for SwigluSplitBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_g, node_u] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let shape = gate.shape();
        let d = shape.num_dims() - 1;
        let cols = shape[d];
        // One kernel writes both gradients side by side; each parent gets its half as a view.
        let packed = B::swiglu_backward(gate, Some(up), dy);
        let half = |start: usize| {
            let mut ranges: Vec<burn::tensor::Slice> = shape
                .iter()
                .map(|&s| burn::tensor::Slice::from(0..s))
                .collect();
            ranges[d] = burn::tensor::Slice::from(start..start + cols);
            B::float_slice(packed.clone(), &ranges)
        };
        if let Some(node) = node_g {
            grads.register::<B>(node.id, half(0));
        }
        if let Some(node) = node_u {
            grads.register::<B>(node.id, half(cols));
        }
    }
}

#[derive(Debug)]
struct SwigluPackedBackward;

impl<B: ActivationKernels> Backward<B, 1> for SwigluPackedBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            grads.register::<B>(node.id, B::swiglu_backward(ops.state, None, dy));
        }
    }
}

#[derive(Debug)]
struct GeluBackward {
    form: GeluForm,
}

impl<B: ActivationKernels> Backward<B, 1> for GeluBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            grads.register::<B>(node.id, B::gelu_form_backward(ops.state, dy, self.form));
        }
    }
}

pub(crate) fn swiglu<B: ActivationKernels, C: CheckpointStrategy>(
    gate: FloatTensor<Autodiff<B, C>>,
    up: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::swiglu_forward(gate.primitive.clone(), Some(up.primitive.clone()));
    match SwigluSplitBackward
        .prepare::<C>([gate.node.clone(), up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((gate.primitive, up.primitive), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

pub(crate) fn swiglu_packed<B: ActivationKernels, C: CheckpointStrategy>(
    gate_up: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::swiglu_forward(gate_up.primitive.clone(), None);
    match SwigluPackedBackward
        .prepare::<C>([gate_up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(gate_up.primitive, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

pub(crate) fn gelu<B: ActivationKernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    form: GeluForm,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::gelu_form_forward(x.primitive.clone(), form);
    match (GeluBackward { form })
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(x.primitive, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<B: ActivationKernels, C: CheckpointStrategy> super::ActivationOps for Autodiff<B, C> {
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::<B, C>(gate, up)
    }
    fn fused_swiglu_packed(gate_up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu_packed::<B, C>(gate_up)
    }
    fn fused_gelu(x: FloatTensor<Self>, form: GeluForm) -> FloatTensor<Self> {
        gelu::<B, C>(x, form)
    }
}
