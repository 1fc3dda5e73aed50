//! Activation recomputation (`model.recompute = "full"`, and `"selective"` with the fused
//! kernels) against keeping every activation: for one batch and one set of weights, the loss and
//! every parameter gradient of a three-block model with every block recomputed, and with every
//! second one (blocks 0 and 2 recomputed, block 1 kept), against `recompute = "none"`.
//!
//! On the CPU the recomputed run does the same arithmetic, and the results must be equal bit for
//! bit with full recomputation on the reference ops and with selective recomputation on the fused
//! ops' CPU versions (full recomputation on those adds a stream's gradients in another order). On
//! a GPU they need not be: on CUDA the fused dQ of
//! FlashAttention's backward adds f32 partial sums with atomics, and Burn's autotuned matmuls may
//! pick another kernel (another order of additions) between two runs. There the difference may be
//! no larger than twice the difference between two runs without recomputation, plus a few
//! roundings of the dtype: `2^-p` of the largest value, p = 18 in f32 (a few units in the last
//! place, from a different order of f32 additions through three blocks), 9 in f16 and 6 in bf16
//! (two units in the last place of the largest value, where an f32 gradient rounds the other way).

use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Int, Tensor};
use model::config::{KernelsKind, MlpKind, RecomputeKind};
use model::Gpt;

use super::{ids, loss_and_grads, max_abs, max_diff, model_config, named_grads, with_combo};
use super::{Combo, Shape};

/// One case: the model, its kernels and attention, the dtype, the dropout probability and the
/// key/value heads (grouped-query attention when fewer than `shape.heads`).
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub mlp: MlpKind,
    pub combo: Combo,
    pub dtype: FloatDType,
    pub dropout: f64,
    pub kv_heads: usize,
    pub shape: Shape,
}

/// Loss and gradients of a compute copy of `model` in `dtype`, through
/// [`Gpt::loss_and_grads_recomputed`] (as the trainer's step takes them).
fn recomputed<B>(
    model: &Gpt<B>,
    dtype: FloatDType,
    x: &Tensor<B, 2, Int>,
    y: &Tensor<B, 2, Int>,
) -> (f64, Vec<(String, Vec<f32>)>)
where
    B: AutodiffBackend + kernels::Backend,
    B::InnerBackend: kernels::Backend,
{
    let copy = model.compute_copy(dtype);
    let (loss, grads) = summed_recomputed(&copy, x, y, None);
    let value = loss.into_data().convert::<f64>().to_vec::<f64>().unwrap()[0];
    (value, named_grads(&copy, &grads))
}

/// [`Gpt::loss_and_grads_recomputed`] of `copy` at its own precision, with `hook`: the loss and
/// the gradients of every piece summed.
pub fn summed_recomputed<B>(
    copy: &Gpt<B>,
    x: &Tensor<B, 2, Int>,
    y: &Tensor<B, 2, Int>,
    hook: Option<&dyn model::BlockHook<B>>,
) -> (Tensor<B::InnerBackend, 1>, GradientsParams)
where
    B: AutodiffBackend + kernels::Backend,
    B::InnerBackend: kernels::Backend,
{
    let precision = copy.precision();
    let (loss, pieces) = copy.loss_and_grads_recomputed(
        x.clone(),
        y.clone(),
        &precision,
        copy.config.z_loss,
        1.0,
        hook,
    );
    let grads = pieces
        .into_iter()
        .map(|g| GradientsParams::from_grads(g, copy))
        .reduce(|a, b| trainer::optim::accumulate_grads::<B, _>(copy, a, b))
        .expect("one backward at least");
    (loss, grads)
}

/// Checks `case` on `dev` (see the module docs): the modes in `bit_for_bit` exactly, the others
/// within the tolerance.
pub fn recompute_matches<B>(case: Case, bit_for_bit: &[RecomputeKind], dev: &B::Device)
where
    B: AutodiffBackend + kernels::Backend,
    B::InnerBackend: kernels::Backend,
{
    let mut cfg = model_config(case.mlp, case.shape);
    cfg.n_layer = 3;
    cfg.n_kv_head = case.kv_heads;
    cfg.dropout = case.dropout;
    let base = with_combo(&Gpt::<B>::new(&cfg, case.shape.vocab, dev), case.combo);
    let (x, y) = (
        ids::<B>(case.shape.batch, case.shape.seq, case.shape.vocab, 5, dev),
        ids::<B>(case.shape.batch, case.shape.seq, case.shape.vocab, 6, dev),
    );
    // Every run draws the same dropout masks: the seed is set afresh on a copy of the model.
    let with = |recompute: RecomputeKind, every: usize| {
        let mut m = base.clone();
        m.config.recompute = recompute;
        m.config.recompute_every = every;
        m.set_dropout_seed(11);
        m
    };
    let (none_loss, none) = loss_and_grads(&with(RecomputeKind::None, 1), case.dtype, &x, &y);
    // The run-to-run difference without recomputation.
    let noise = {
        let (loss, again) = loss_and_grads(&with(RecomputeKind::None, 1), case.dtype, &x, &y);
        let mut n = vec![(loss - none_loss).abs()];
        n.extend(
            none.iter()
                .zip(&again)
                .map(|((_, a), (_, b))| max_diff(a, b)),
        );
        n
    };
    let bits = match case.dtype {
        FloatDType::F32 => 18,
        FloatDType::F16 => 9,
        _ => 6,
    };
    let mut failures = Vec::new();
    // Selective recomputation recomputes the fused kernels' outputs: with the reference ops it
    // would not differ from "none".
    let mut modes = vec![RecomputeKind::Full];
    if case.combo.kernels != KernelsKind::Reference {
        modes.push(RecomputeKind::Selective);
    }
    for (mode, every) in modes.into_iter().flat_map(|m| [(m, 1), (m, 2)]) {
        let model = with(mode, every);
        let (loss, grads) = match mode {
            RecomputeKind::Full => recomputed(&model, case.dtype, &x, &y),
            _ => loss_and_grads(&model, case.dtype, &x, &y),
        };
        assert_eq!(grads.len(), none.len(), "the same parameters get gradients");
        let mut rows = vec![(
            "loss".to_string(),
            (loss - none_loss).abs(),
            none_loss.abs(),
        )];
        for ((name, a), (_, b)) in none.iter().zip(&grads) {
            rows.push((name.clone(), max_diff(a, b), max_abs(a)));
        }
        let mut worst = (String::new(), 0.0f64);
        for (i, (name, diff, scale)) in rows.iter().enumerate() {
            let bound = if bit_for_bit.contains(&mode) {
                0.0
            } else {
                2.0 * noise[i] + scale * f64::powi(2.0, -bits)
            };
            if *diff > worst.1 {
                worst = (name.clone(), *diff);
            }
            if !(*diff <= bound) {
                failures.push(format!(
                    "{mode:?} every {every}: {name} differs by {diff:.3e} from recompute = \"none\" (allowed {bound:.3e}, max |value| {scale:.3e})"
                ));
            }
        }
        println!(
            "{case:?} recompute {mode:?} every {every}: loss {loss:.6} (none {none_loss:.6}); largest difference {:.3e} ({})",
            worst.1, worst.0
        );
    }
    assert!(failures.is_empty(), "{case:?}:\n{}", failures.join("\n"));
}
