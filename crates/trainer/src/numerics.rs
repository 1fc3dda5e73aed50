//! Per-layer numerics, the statistics a step records besides its loss.
//!
//! fp16 and bf16: how gradients fit the format they are computed in, per projection: the share of
//! values held as subnormals (below the format's smallest normal number, so with fewer significant
//! bits, one step from being flushed to zero), the share that overflowed (inf or NaN) and the
//! largest magnitude. Measured on the device; one read-back for all tensors of a step.
//!
//! FP8: the health of every projection's weight, input and output gradient as its GEMMs quantize
//! them (`kernels::Fp8Health`).

use std::collections::HashSet;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use model::Gpt;

use crate::config::Config;
use crate::metrics::LayerHealth;
use crate::precision::Recipe;

/// Smallest positive normal number and largest finite value of `dtype`.
pub fn limits(dtype: FloatDType) -> (f64, f64) {
    match dtype {
        FloatDType::F16 => (2f64.powi(-14), 65504.0),
        FloatDType::BF16 => (2f64.powi(-126), 3.389_531_389_251_535_5e38),
        _ => (f32::MIN_POSITIVE as f64, f32::MAX as f64),
    }
}

/// One tensor's statistics against a format, still on the device (see [`stats`]).
pub struct Pending<B: Backend> {
    pub(crate) rows: Tensor<B, 2>,
    pub(crate) elements: usize,
}

/// How `x` fits `format` (see [`LayerHealth`]): [`kernels::format_stats`] against the format's
/// smallest normal number, one read of `x` on `CubeBackend`, nothing read back yet.
pub fn stats<B: kernels::Backend>(x: Tensor<B, 2>, format: FloatDType) -> Pending<B> {
    let (min_normal, _) = limits(format);
    let elements = x.shape().num_elements();
    Pending {
        rows: kernels::format_stats(x, min_normal),
        elements,
    }
}

/// Reads back the [`stats`] of named tensors in one transfer.
pub fn read<B: Backend>(named: Vec<(String, Pending<B>)>) -> Vec<LayerHealth> {
    if named.is_empty() {
        return Vec::new();
    }
    let mut names = Vec::with_capacity(named.len());
    let mut layout = Vec::with_capacity(named.len());
    let mut rows = Vec::with_capacity(named.len());
    for (name, p) in named {
        names.push(name);
        layout.push((p.rows.dims()[0], p.elements));
        rows.push(p.rows);
    }
    let values: Vec<f32> = Tensor::cat(rows, 0)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap_or_default();
    let mut at = 0;
    names
        .into_iter()
        .zip(layout)
        .map(|(layer, (n, elements))| {
            let end = (at + n * kernels::format_stats::COLUMNS).min(values.len());
            let s = kernels::FormatStats::from_rows(&values[at.min(end)..end], elements);
            at = end;
            LayerHealth {
                layer,
                amax: s.amax,
                underflow: s.underflow(),
                saturated: s.not_finite_share(),
            }
        })
        .collect()
}

/// What a step measures besides its loss: FP8 health under the FP8 recipe (every
/// `fp8.health_interval` steps), or the gradients' numerics under fp16 and bf16 (every
/// `training.numerics_interval` steps); both on the first step too, and neither when the interval
/// is 0.
pub struct Probes {
    /// Where the FP8 projections record their inputs' and output gradients' health.
    pub fp8: Option<kernels::ProbeSink>,
    /// Where the fp16/bf16 projections leave their output gradients' statistics.
    pub taps: Option<kernels::ProbeSink>,
}

impl Probes {
    /// The model's part of these probes, measured against `dtype`'s smallest normal number.
    pub fn for_model(&self, dtype: FloatDType) -> model::Probes {
        model::Probes {
            fp8_health: self.fp8.clone(),
            grad_format: self.taps.clone().map(|sink| model::GradFormat {
                sink,
                min_normal: limits(dtype).0,
            }),
        }
    }

    pub fn for_step(recipe: &Recipe, cfg: &Config, step: u64) -> Self {
        let due =
            |interval: u64| interval > 0 && ((step + 1).is_multiple_of(interval) || step == 0);
        let mut p = Probes {
            fp8: None,
            taps: None,
        };
        match recipe {
            Recipe::Fp8(r) if due(r.fp8.health_interval) => {
                p.fp8 = Some(kernels::probe_sink());
            }
            Recipe::Fp16(_) | Recipe::Bf16(_) if due(cfg.training.numerics_interval) => {
                p.taps = Some(kernels::probe_sink());
            }
            _ => {}
        }
        p
    }
}

/// FP8 health of a step: every projection weight that runs in FP8 under `precision` (the edge
/// blocks it keeps in the compute dtype do not) as the next fprop GEMM quantizes it (128x128
/// blocks, or per tensor, under delayed scaling by the amax its history gives), from the master
/// weights cast to `dtype` (`blocks.N.attn.qkv.weight`, ...), then the inputs and output gradients
/// the projections recorded in `probe` (the step's first micro-batch's entry per tensor).
pub fn fp8_health<B: crate::TrainBackend>(
    model: &Gpt<B>,
    dtype: FloatDType,
    precision: &model::Precision,
    probe: &kernels::ProbeSink,
) -> Vec<LayerHealth> {
    let health = |layer: String, h: kernels::Fp8Health| LayerHealth {
        layer,
        amax: h.amax,
        underflow: h.underflow,
        saturated: h.saturated,
    };
    // Every measurement is queued before the first is read back.
    let weights: Vec<_> = model
        .fp8_projections(precision)
        .into_iter()
        .map(|(name, lin, cfg)| {
            let w = lin.weight.val().inner().cast(dtype);
            let site = precision.fp8_history.as_ref().map(|h| h.site(&name));
            let h = kernels::fp8_health_pending_at(
                w,
                cfg.weight_spec(true),
                site.as_ref().map(|s| (s, kernels::fp8::role::WEIGHT)),
            );
            (format!("{name}.weight"), h)
        })
        .collect();
    let recorded = kernels::probe::take::<kernels::PendingHealth>(probe);
    let mut all: Vec<LayerHealth> = weights
        .into_iter()
        .map(|(layer, h)| health(layer, h.resolve()))
        .collect();
    let mut seen = HashSet::new();
    for (layer, h, _) in recorded {
        if seen.insert(layer.clone()) {
            all.push(health(layer, h.resolve()));
        }
    }
    all
}

/// One log line on an FP8 health or fp16/bf16 numerics step: the worst underflow and saturation
/// (or overflow) shares and where.
pub fn health_line(what: &str, done: u64, steps: u64, h: &[LayerHealth]) -> String {
    let worst = |f: fn(&LayerHealth) -> f64| match h.iter().max_by(|a, b| f(a).total_cmp(&f(b))) {
        Some(l) if f(l) > 0.0 => format!("{:.3}% ({})", 100.0 * f(l), l.layer),
        _ => "0".to_string(),
    };
    format!(
        "{what:<5} {done:>6}/{steps} | worst underflow {} | worst saturation {} | {} tensors (metrics.jsonl)",
        worst(|l| l.underflow),
        worst(|l| l.saturated),
        h.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    #[test]
    fn shares_of_subnormal_and_non_finite_values() {
        let device = Default::default();
        let x = Tensor::<NdArray, 2>::from_data(
            TensorData::new(
                vec![
                    0.0f32,
                    1e-6,
                    -3e-5,
                    1.0,
                    f32::INFINITY,
                    -2.0,
                    7e-5,
                    f32::NAN,
                ],
                [2, 4],
            ),
            &device,
        );
        // Nonzero finite: 1e-6, -3e-5, 1, -2, 7e-5; below f16's 2^-14 = 6.1e-5: 1e-6 and -3e-5.
        let h = read(vec![
            ("f16".to_string(), stats(x.clone(), FloatDType::F16)),
            ("bf16".to_string(), stats(x, FloatDType::BF16)),
        ]);
        assert_eq!(h[0].layer, "f16");
        assert_eq!(h[0].amax, 2.0);
        assert!((h[0].underflow - 2.0 / 5.0).abs() < 1e-6, "{:?}", h[0]);
        assert!((h[0].saturated - 2.0 / 8.0).abs() < 1e-6, "{:?}", h[0]);
        // bf16 has f32's exponent range: none of these is subnormal.
        assert_eq!(h[1].underflow, 0.0);
        assert_eq!(limits(FloatDType::F16), (2f64.powi(-14), 65504.0));
    }
}
