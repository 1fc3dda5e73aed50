//! RMSNorm under `Autodiff`: the forward kernel saves `1 / rms` per row, the backward kernel
//! recomputes the normalised row from it and the saved input. The input's gradient from its
//! other consumers (the residual stream's next add), when already there, is added by the same
//! kernel.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use std::sync::Arc;

use super::RmsNormKernels;

/// `input` names the normalised input's node (a handle of its own, holding `1 / rms` as its
/// primitive and a reference count nothing else sees), to take the input's gradient from its
/// other consumers out of the container.
#[derive(Debug)]
struct RmsNormBackward<B: RmsNormKernels> {
    input: FloatTensor<Autodiff<B>>,
}

impl<B: RmsNormKernels> Backward<B, 2> for RmsNormBackward<B> {
    /// (normalised input, gain, 1 / rms per row)
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, w, rstd) = ops.state;
        // The input's gradient from its other consumers, when they ran first (the next residual
        // add always does: it lies deeper in the graph), goes into the kernel's dx, instead of an
        // add of its own when this dx is registered.
        let dres = node_x.as_ref().and_then(|_| grads.remove::<B>(&self.input));
        let (dx, dw) = B::rms_norm_backward(x, w, rstd, dy, dres);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_w {
            grads.register::<B>(node.id, dw);
        }
    }
}

/// The sum `x + residual` of the fused op: its gradient goes unchanged to both addends.
#[derive(Debug)]
struct AddBackward;

impl<B: RmsNormKernels> Backward<B, 2> for AddBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_r] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        match (node_x, node_r) {
            (Some(a), Some(b)) => {
                grads.register::<B>(a.id, g.clone());
                grads.register::<B>(b.id, g);
            }
            (Some(a), None) | (None, Some(a)) => grads.register::<B>(a.id, g),
            (None, None) => {}
        }
    }
}

/// The normalisation node over an input that is already an autodiff tensor.
fn norm_node<B: RmsNormKernels, C: CheckpointStrategy>(
    input: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    y: FloatTensor<B>,
    rstd: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let mut handle = input.clone();
    handle.primitive = rstd.clone();
    handle.rc = Arc::new(handle.node.id);
    match (RmsNormBackward::<B> { input: handle })
        .prepare::<C>([input.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((input.primitive, w.primitive, rstd), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

pub(crate) fn rms_norm<B: RmsNormKernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    eps: f64,
) -> FloatTensor<Autodiff<B, C>> {
    let (_, y, rstd) = B::rms_norm_forward(x.primitive.clone(), None, w.primitive.clone(), eps);
    norm_node::<B, C>(x, w, y, rstd)
}

pub(crate) fn add_rms_norm<B: RmsNormKernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    r: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    eps: f64,
) -> (FloatTensor<Autodiff<B, C>>, FloatTensor<Autodiff<B, C>>) {
    let (sum, y, rstd) = B::rms_norm_forward(
        x.primitive.clone(),
        Some(r.primitive.clone()),
        w.primitive.clone(),
        eps,
    );
    let sum = sum.expect("the fused forward returns the sum");
    let sum = AddBackward
        .prepare::<C>([x.node.clone(), r.node.clone()])
        .compute_bound()
        .stateless(sum);
    let y = norm_node::<B, C>(sum.clone(), w, y, rstd);
    (sum, y)
}

impl<B: RmsNormKernels, C: CheckpointStrategy> super::RmsNormOps for Autodiff<B, C> {
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        rms_norm::<B, C>(x, weight, eps)
    }
    fn fused_add_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        add_rms_norm::<B, C>(x, residual, weight, eps)
    }
}
