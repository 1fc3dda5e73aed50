//! The FP8 MLP inside the model: with the fused kernels, a block (GELU or SwiGLU) whose two
//! projections run in FP8 takes `kernels::fp8_mlp_scaled` (the activation's output and gradient
//! quantized in the kernels that compute them); with the FP8 health probes on, the projections
//! and the activation run apart. Loss and every gradient of the two, compared.

use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, FloatDType};
use model::config::{AttentionKind, GemmKind, KernelsKind, MlpKind};
use model::Gpt;

use super::{ids, model_config, named_grads, with_combo, Combo, Shape};

/// Loss and gradients of the model of the cases (its MLP `mlp`) at `shape` with the fused kernels
/// and every block's projections in FP8, the MLP as one op against the MLP composed. With `exact`
/// (where the activation's kernel runs in both) the loss must be equal bit for bit, else within a
/// relative difference
/// of `tolerance`; each gradient within a relative RMS difference of `tolerance` (0 asks for equal
/// gradients; on CUDA the tied embedding's gradient is accumulated with atomic additions, whose
/// order, and so the last bit of some sums, varies from run to run). With `delayed`, per-tensor
/// scales from amax histories (each side its own): the second step's, scaled from the amaxes the
/// first recorded.
pub fn fused_mlp_matches_composed<B: AutodiffBackend + kernels::Backend>(
    mlp: MlpKind,
    dtype: FloatDType,
    shape: Shape,
    delayed: bool,
    exact: bool,
    tolerance: f64,
    dev: &B::Device,
) {
    let cfg = model_config(mlp, shape);
    let fused = Combo {
        kernels: KernelsKind::Fused,
        attention: AttentionKind::Flash,
        gemm: GemmKind::Auto,
    };
    let model = with_combo(&Gpt::<B>::new(&cfg, shape.vocab, dev), fused).compute_copy(dtype);
    let (x, y) = (
        ids::<B>(shape.batch, shape.seq, shape.vocab, 5, dev),
        ids::<B>(shape.batch, shape.seq, shape.vocab, 6, dev),
    );
    let run = |probed: bool| {
        let mut precision = model.precision();
        precision.fp8 = Some(kernels::Fp8LinearConfig {
            per_tensor: delayed,
            ..Default::default()
        });
        if delayed {
            precision.fp8_history = Some(kernels::Fp8AmaxHistory::new(4));
        }
        if probed {
            precision.probes.fp8_health = Some(kernels::probe_sink());
        }
        let step = || {
            let loss = model.forward_loss_in(x.clone(), y.clone(), &precision);
            let value = loss.clone().into_scalar().elem::<f64>();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            (value, named_grads(&model, &grads))
        };
        if let Some(history) = &precision.fp8_history {
            step();
            history.advance();
        }
        step()
    };
    let ((one_op, one_op_grads), (composed, composed_grads)) = (run(false), run(true));
    let ctx = format!("FP8 {mlp:?} model {dtype:?} at {shape:?}, delayed scaling {delayed}");
    let loss_diff = (one_op - composed).abs() / composed.abs().max(1e-30);
    eprintln!("{ctx}: loss {one_op} (MLP as one op) against {composed} (composed)");
    assert!(
        if exact {
            one_op == composed
        } else {
            loss_diff <= tolerance
        },
        "{ctx}: loss {one_op} (MLP as one op) against {composed} (composed)"
    );
    for ((name, a), (_, b)) in one_op_grads.iter().zip(&composed_grads) {
        let num: f64 = a.iter().zip(b).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|q| (*q as f64).powi(2)).sum();
        let diff = (num / den.max(1e-30)).sqrt();
        if a != b {
            eprintln!("{ctx}: gradient of {name}: relative RMS difference {diff:.2e}");
        }
        assert!(
            a == b || diff <= tolerance,
            "{ctx}: gradient of {name}: relative RMS difference {diff:.5} > {tolerance}"
        );
    }
}
