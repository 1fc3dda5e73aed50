//! [`super::RecomputeOps`] under `Autodiff` over `CubeBackend`: the producer (the norm or the
//! activation) is its usual autodiff node; the GEMM's node keeps the producer's input in place
//! of its own and runs the producer's forward kernel again for the weight gradient.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{Activation, RecomputeOps};
use crate::activation::ActivationKernels;
use crate::gemm::{Gemm, GemmOps};
use crate::rms_norm::RmsNormKernels;

/// What a GEMM's input is computed from again: the producer's own input, which the producer's
/// backward keeps anyway.
#[derive(Debug, Clone)]
enum Source<B: BurnBackend> {
    RmsNorm {
        input: FloatTensor<B>,
        gain: FloatTensor<B>,
        eps: f64,
    },
    Activation {
        input: FloatTensor<B>,
        activation: Activation,
    },
}

impl<B: RmsNormKernels + ActivationKernels> Source<B> {
    /// The producer's output, by the kernel that wrote it in the forward (the same bits).
    fn recompute(self) -> FloatTensor<B> {
        match self {
            Source::RmsNorm { input, gain, eps } => B::rms_norm_forward(input, None, gain, eps).1,
            Source::Activation { input, activation } => match activation.gelu_form() {
                None => B::swiglu_forward(input, None),
                Some(form) => B::gelu_form_forward(input, form),
            },
        }
    }
}

/// `y = x w`, `x` recomputed for `dw = x^T dy`; `dx = dy w^T` as in the plain GEMM.
#[derive(Debug)]
struct RecomputedGemmBackward {
    engine: Gemm,
}

impl<B: RmsNormKernels + ActivationKernels + GemmOps> Backward<B, 2> for RecomputedGemmBackward {
    /// `(where x comes from, w)`, each kept only if the other parent needs it.
    type State = (Option<Source<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (source, w) = ops.state;
        let e = self.engine;
        if let Some(node) = node_x {
            let w = w.expect("w is kept when x needs a gradient");
            grads.register::<B>(node.id, B::gemm(dy.clone(), w, false, true, e));
        }
        if let Some(node) = node_w {
            let x = source
                .expect("x's source is kept when w needs a gradient")
                .recompute();
            grads.register::<B>(node.id, B::gemm(x, dy, true, false, e));
        }
    }
}

/// The GEMM node of `x w`, keeping `source` instead of `x`.
fn recomputed_gemm<B, C>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    source: Source<B>,
    engine: Gemm,
) -> FloatTensor<Autodiff<B, C>>
where
    B: RmsNormKernels + ActivationKernels + GemmOps,
    C: CheckpointStrategy,
{
    let out = B::gemm(x.primitive, w.primitive.clone(), false, false, engine);
    let keep_w = !x.node.requirement.is_none();
    let keep_source = !w.node.requirement.is_none();
    match (RecomputedGemmBackward { engine })
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (keep_source.then_some(source), keep_w.then_some(w.primitive)),
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<R, F, I, BT, C> RecomputeOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
    fn fused_rms_norm_linear(
        x: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        gain: FloatTensor<Self>,
        eps: f64,
        w: FloatTensor<Self>,
        engine: Gemm,
    ) -> (Option<FloatTensor<Self>>, FloatTensor<Self>) {
        type Inner<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        // `input`: what the norm normalises, the sum with a residual, else `x`.
        let (s, y, input) = match residual {
            Some(r) => {
                let (s, y) = crate::rms_norm::backward::add_rms_norm::<Inner<R, F, I, BT>, C>(
                    x,
                    r,
                    gain.clone(),
                    eps,
                );
                let input = s.primitive.clone();
                (Some(s), y, input)
            }
            None => {
                let input = x.primitive.clone();
                let y = crate::rms_norm::backward::rms_norm::<Inner<R, F, I, BT>, C>(
                    x,
                    gain.clone(),
                    eps,
                );
                (None, y, input)
            }
        };
        let source = Source::RmsNorm {
            input,
            gain: gain.primitive,
            eps,
        };
        (
            s,
            recomputed_gemm::<Inner<R, F, I, BT>, C>(y, w, source, engine),
        )
    }

    fn fused_activation_linear(
        h: FloatTensor<Self>,
        activation: Activation,
        w: FloatTensor<Self>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        type Inner<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        let source = Source::Activation {
            input: h.primitive.clone(),
            activation,
        };
        let x = match activation.gelu_form() {
            None => crate::activation::backward::swiglu_packed::<Inner<R, F, I, BT>, C>(h),
            Some(form) => crate::activation::backward::gelu::<Inner<R, F, I, BT>, C>(h, form),
        };
        recomputed_gemm::<Inner<R, F, I, BT>, C>(x, w, source, engine)
    }
}
