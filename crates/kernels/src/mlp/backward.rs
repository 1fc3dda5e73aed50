//! [`super::MlpOps`] under `Autodiff` over `CubeBackend`: one node for the whole MLP, keeping
//! `x`, `h = x w_fc` and `g = gelu_tanh(h)`.
//!
//! For `y = g w_proj` and the output gradient `dy`:
//! - `dh = (dy w_proj^T) * gelu_tanh'(h)`, one cuBLASLt call with the derivative in its epilogue
//!   (else the GEMM and the activation's backward kernel);
//! - `dw_proj = g^T dy`, `dx = dh w_fc^T`, `dw_fc = x^T dh`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{composition, epilogue, fc_forward, fprop, MlpOps};
use crate::activation::{ActivationKernels, GeluForm};
use crate::gemm::{Gemm, GemmOps};
use crate::primitive::{prim, tensor};

/// What the backward keeps.
#[derive(Debug, Clone)]
struct Saved<B: burn::tensor::backend::Backend> {
    x: FloatTensor<B>,
    w_fc: FloatTensor<B>,
    /// `x w_fc`, the activation's input.
    h: FloatTensor<B>,
    /// `gelu_tanh(h)`, `proj`'s input.
    g: FloatTensor<B>,
    w_proj: FloatTensor<B>,
}

#[derive(Debug)]
struct GeluMlpBackward {
    engine: Gemm,
}

impl<R, F, I, BT> Backward<CubeBackend<R, F, I, BT>, 3> for GeluMlpBackward
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    type State = Saved<CubeBackend<R, F, I, BT>>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        let e = self.engine;
        let s = ops.state;
        let dy = grads.consume::<B<R, F, I, BT>>(&ops.node);
        // The output gradient in the op's dtype (a loss may hand back another).
        let dy = match dy.dtype() == s.x.dtype() {
            true => dy,
            false => prim(
                tensor::<B<R, F, I, BT>, 2>(dy).cast(crate::primitive::float_dtype(s.x.dtype())),
            ),
        };
        let [node_x, node_fc, node_proj] = ops.parents;
        if let Some(node) = node_proj {
            let dw_proj = B::<R, F, I, BT>::gemm(s.g, dy.clone(), true, false, e);
            grads.register::<B<R, F, I, BT>>(node.id, dw_proj);
        }
        if node_x.is_none() && node_fc.is_none() {
            return;
        }
        let dh = epilogue::gemm_dgelu(&dy, &s.w_proj, &s.h, e).unwrap_or_else(|| {
            let dg = B::<R, F, I, BT>::gemm(dy, s.w_proj, false, true, e);
            B::<R, F, I, BT>::gelu_form_backward(s.h, dg, GeluForm::Tanh)
        });
        if let Some(node) = node_x {
            let dx = B::<R, F, I, BT>::gemm(dh.clone(), s.w_fc, false, true, e);
            grads.register::<B<R, F, I, BT>>(node.id, dx);
        }
        if let Some(node) = node_fc {
            let dw_fc = B::<R, F, I, BT>::gemm(s.x, dh, true, false, e);
            grads.register::<B<R, F, I, BT>>(node.id, dw_fc);
        }
    }
}

impl<R, F, I, BT, C> MlpOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
    fn fused_gelu_tanh_mlp(
        x: FloatTensor<Self>,
        w_fc: FloatTensor<Self>,
        w_proj: FloatTensor<Self>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        if !epilogue::on_cublaslt(&x.primitive, engine) {
            return composition::<Self>(x, w_fc, w_proj, engine);
        }
        let nodes = [x.node.clone(), w_fc.node.clone(), w_proj.node.clone()];
        let (x, w_fc, w_proj) = (x.primitive, w_fc.primitive, w_proj.primitive);
        match (GeluMlpBackward { engine })
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (g, h) = fc_forward::<R, F, I, BT>(x.clone(), w_fc.clone(), engine, true);
                let h = h.expect("the pre-activation is kept when asked for");
                let y = B::<R, F, I, BT>::gemm(g.clone(), w_proj.clone(), false, false, engine);
                let saved = Saved {
                    x,
                    w_fc,
                    h,
                    g,
                    w_proj,
                };
                prep.finish(saved, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(fprop::<R, F, I, BT>(x, w_fc, w_proj, engine)),
        }
    }
}
