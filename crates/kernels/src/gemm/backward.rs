//! [`super::gemm`] under `Autodiff`: each gradient is one more GEMM with flags.
//!
//! For `C = op(A) op(B)` and the output gradient `dC`:
//! - `dA = dC op(B)^T`, or `op(B) dC^T` when A is transposed (`dA = d(op(A))^T`);
//! - `dB = op(A)^T dC`, or `dC^T op(A)` when B is transposed.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::Gemm;
use super::GemmOps;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

#[derive(Debug)]
struct GemmBackward {
    trans_a: bool,
    trans_b: bool,
    engine: Gemm,
}

impl<B: GemmOps> Backward<B, 2> for GemmBackward {
    /// `(a, b)`, each kept only if the other parent needs it.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_a, node_b] = ops.parents;
        let dc = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        let Self {
            trans_a: ta,
            trans_b: tb,
            engine: e,
        } = self;
        if let Some(node) = node_a {
            let b = b.expect("b is kept when a needs a gradient");
            let da = if ta {
                B::gemm(b, dc.clone(), tb, true, e)
            } else {
                B::gemm(dc.clone(), b, false, !tb, e)
            };
            grads.register::<B>(node.id, da);
        }
        if let Some(node) = node_b {
            let a = a.expect("a is kept when b needs a gradient");
            let db = if tb {
                B::gemm(dc, a, true, ta, e)
            } else {
                B::gemm(a, dc, !ta, false, e)
            };
            grads.register::<B>(node.id, db);
        }
    }
}

pub(crate) fn gemm<B: GemmOps, C: CheckpointStrategy>(
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    trans_a: bool,
    trans_b: bool,
    engine: Gemm,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::gemm(
        a.primitive.clone(),
        b.primitive.clone(),
        trans_a,
        trans_b,
        engine,
    );
    // dA needs B and dB needs A: keep only what a tracked parent's gradient reads.
    let keep_b = !a.node.requirement.is_none();
    let keep_a = !b.node.requirement.is_none();
    match (GemmBackward {
        trans_a,
        trans_b,
        engine,
    })
    .prepare::<C>([a.node.clone(), b.node.clone()])
    .compute_bound()
    .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (keep_a.then_some(a.primitive), keep_b.then_some(b.primitive)),
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<R, F, I, BT, C> GemmOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        gemm::<CubeBackend<R, F, I, BT>, C>(a, b, trans_a, trans_b, engine)
    }
    fn gemm_f32(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        acc: Option<FloatTensor<Self>>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        // Not differentiable: the inner backend's product, untracked.
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(
            CubeBackend::<R, F, I, BT>::gemm_f32(
                a.primitive,
                b.primitive,
                trans_a,
                trans_b,
                acc.map(|c| c.primitive),
                engine,
            ),
        )
    }
    fn gemm_path(a: &FloatTensor<Self>, engine: Gemm) -> super::GemmPath {
        CubeBackend::<R, F, I, BT>::gemm_path(&a.primitive, engine)
    }
}
