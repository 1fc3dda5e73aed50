//! The backward node of `format_probe`: statistics of the gradient as it flows past.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use super::{FormatProbe, FormatStatsOps};
use crate::probe::{record, Sample};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

#[derive(Debug)]
struct FormatProbeBackward;

impl<B: FormatStatsOps> Backward<B, 1> for FormatProbeBackward {
    type State = FormatProbe;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let probe = ops.state;
        let elements = dy.shape().num_elements();
        let rows = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::format_stats(
            dy.clone(),
            probe.min_normal,
        )));
        let sample = Sample {
            name: probe.name,
            value: Box::new(rows),
            elements,
        };
        record(&probe.sink, sample);
        if let Some(node) = parent {
            grads.register::<B>(node.id, dy);
        }
    }
}

impl<R, F, I, BT, C> FormatStatsOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
    fn format_probe(x: FloatTensor<Self>, probe: &FormatProbe) -> FloatTensor<Self> {
        match FormatProbeBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(probe.clone(), x.primitive),
            OpsKind::UnTracked(prep) => prep.finish(x.primitive),
        }
    }

    fn format_probe_records() -> bool {
        true
    }
}
