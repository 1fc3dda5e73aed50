//! `fp8.projections = "auto"`: which of a block's projections pay in FP8 at the run's shapes.
//!
//! When the run starts, each of a block's four projections is timed alone on the run's device at
//! the run's shapes (one micro-batch of `training.batch_size x model.context` tokens, the
//! projection's own widths in and out), forward and backward: in the compute dtype, and in FP8
//! with the run's settings, the quantization of every operand included (per-tensor scales are
//! timed with current scaling, which reads each tensor once more than delayed scaling does). A
//! projection runs in FP8 where FP8 was faster. The timings and the decision are logged, and the
//! run's `config.toml` records the decision as the list of FP8 projections, so a resumed run keeps
//! it. In a run of several processes every process times on its own GPU and the decision is taken
//! from the processes' mean timings (an NCCL all-reduce), so that all of them decide alike.

use std::time::Instant;

use anyhow::{anyhow, Result};
use burn::tensor::{DType, Distribution, Tensor, TensorData};
use kernels::collective::{ProcessGroup, ReduceOp};
use model::{Gpt, Precision, PROJECTION_PATHS};

use crate::config::Resolved;
use crate::precision::{Fp8Projections, PrecisionKind};

/// Untimed runs of each variant first (they compile its kernels), then the timed ones.
const WARMUP: usize = 2;
const REPS: usize = 5;

/// One projection's forward and backward, timed in both dtypes (median milliseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    pub path: &'static str,
    pub d_in: usize,
    pub d_out: usize,
    pub compute_ms: f64,
    pub fp8_ms: f64,
}

/// The projections that run in FP8: those timed faster in FP8, in module order.
pub fn choose(timings: &[Timing]) -> Vec<String> {
    timings
        .iter()
        .filter(|t| t.fp8_ms < t.compute_ms)
        .map(|t| t.path.to_string())
        .collect()
}

/// `run` with `fp8.projections = "auto"` decided by timing on `device`, or `None` when the run
/// has nothing to decide. With `group` (the run is one of several processes) every process
/// times on its own GPU and all of them decide from the processes' mean timings.
pub fn resolve<B: crate::TrainBackend>(
    run: &Resolved,
    device: &B::Device,
    group: Option<&ProcessGroup>,
    log: &dyn Fn(&str),
) -> Result<Option<Resolved>> {
    let cfg = &run.config;
    if cfg.precision != PrecisionKind::Fp8 || !cfg.fp8.projections.is_auto() {
        return Ok(None);
    }
    let tokens = cfg.training.batch_size * cfg.model.context;
    let over = match group {
        Some(g) => format!(", the mean over {} processes", g.world()),
        None => String::new(),
    };
    log(&format!(
        "fp8.projections = \"auto\": timing each projection alone (forward and backward, {tokens} tokens, median of {REPS}{over})"
    ));
    let mut timings = measure::<B>(run, device, tokens)?;
    if let Some(group) = group {
        agree::<B>(&mut timings, group, device)?;
    }
    for t in &timings {
        log(&describe(t));
    }
    let chosen = choose(&timings);
    log(&match chosen.is_empty() {
        true => format!(
            "  no projection is faster in FP8 at these shapes: every projection keeps {}",
            model::dtype::name(run.precision.dtype)
        ),
        false => format!("  in FP8: {}", chosen.join(", ")),
    });
    let mut out = run.clone();
    out.config.fp8.projections = Fp8Projections::Paths(chosen);
    out.precision.fp8_compute_paths = out.config.fp8.projections.compute_paths();
    Ok(Some(out))
}

/// Replaces each timing by its mean over the processes of `group` (every process calls this with
/// its own timings of the same projections, in the same order), so that [`choose`] decides alike
/// on every process: NCCL's all-reduce gives every rank the same values.
fn agree<B: crate::TrainBackend>(
    timings: &mut [Timing],
    group: &ProcessGroup,
    device: &B::Device,
) -> Result<()> {
    let ms: Vec<f32> = timings
        .iter()
        .flat_map(|t| [t.compute_ms as f32, t.fp8_ms as f32])
        .collect();
    let n = ms.len();
    let local = Tensor::<B, 1>::from_data(TensorData::new(ms, [n]), (device, DType::F32)).inner();
    let mean = group.all_reduce::<B::InnerBackend, 1>(local, ReduceOp::Mean);
    let data = mean.into_data();
    group.check().map_err(|e| {
        anyhow!("fp8.projections = \"auto\": the processes could not share their timings: {e}")
    })?;
    let mean = data
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| anyhow!("fp8.projections = \"auto\": reading the mean timings: {e:?}"))?;
    apply_means(timings, &mean);
    Ok(())
}

/// `timings` with their `(compute, fp8)` milliseconds replaced by `means`, two per timing in
/// order.
fn apply_means(timings: &mut [Timing], means: &[f32]) {
    for (t, m) in timings.iter_mut().zip(means.chunks_exact(2)) {
        t.compute_ms = f64::from(m[0]);
        t.fp8_ms = f64::from(m[1]);
    }
}

/// One log line: `  mlp.fc   768 -> 3072   bf16 1.234 ms   fp8 0.987 ms (0.80x)   fp8`.
fn describe(t: &Timing) -> String {
    format!(
        "  {:<10} {:>6} -> {:<6}  compute {:>8.3} ms  fp8 {:>8.3} ms ({:.2}x)  {}",
        t.path,
        t.d_in,
        t.d_out,
        t.compute_ms,
        t.fp8_ms,
        t.fp8_ms / t.compute_ms,
        if t.fp8_ms < t.compute_ms {
            "fp8"
        } else {
            "compute dtype"
        }
    )
}

/// Times each projection of one block of the run's model.
fn measure<B: crate::TrainBackend>(
    run: &Resolved,
    device: &B::Device,
    tokens: usize,
) -> Result<Vec<Timing>> {
    // One block is enough: every block's projections have the same shapes. The vocabulary is
    // small because the projections do not depend on it.
    let mut one = run.config.model.clone();
    one.n_layer = 1;
    let model = Gpt::<B>::new(&one, 256, device);
    let dtype = run.precision.dtype;
    let fp8 = Precision {
        fp8_edge_blocks: 0,
        fp8_compute_paths: Vec::new(),
        fp8_history: None,
        ..run.precision.clone()
    };
    let compute = Precision {
        fp8: None,
        ..fp8.clone()
    };
    let sync = || B::sync(device).map_err(|e| anyhow!("the GPU failed while timing: {e:?}"));
    let mut out = Vec::new();
    for ((_, layer), path) in model.projections().into_iter().zip(PROJECTION_PATHS) {
        let [d_in, d_out] = layer.weight.val().dims();
        let layer = layer.compute_copy(dtype);
        let x = Tensor::<B, 2>::random([tokens, d_in], Distribution::Normal(0.0, 1.0), device)
            .cast(dtype)
            .require_grad();
        let once = |p: &Precision| {
            let y = layer.forward_as_projection(x.clone(), p, path);
            drop(y.sum().backward());
        };
        let time = |p: &Precision| -> Result<f64> {
            for _ in 0..WARMUP {
                once(p);
            }
            sync()?;
            let mut ms = Vec::with_capacity(REPS);
            for _ in 0..REPS {
                let t = Instant::now();
                once(p);
                sync()?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            ms.sort_by(f64::total_cmp);
            Ok(ms[REPS / 2])
        };
        out.push(Timing {
            path,
            d_in,
            d_out,
            compute_ms: time(&compute)?,
            fp8_ms: time(&fp8)?,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(path: &'static str, compute_ms: f64, fp8_ms: f64) -> Timing {
        Timing {
            path,
            d_in: 8,
            d_out: 8,
            compute_ms,
            fp8_ms,
        }
    }

    #[test]
    fn fp8_where_it_was_faster_only() {
        let timings = [
            t("attn.qkv", 1.0, 1.2),
            t("attn.proj", 1.0, 0.9),
            t("mlp.fc", 2.0, 2.0),
            t("mlp.proj", 2.0, 1.5),
        ];
        assert_eq!(choose(&timings), vec!["attn.proj", "mlp.proj"]);
        assert!(choose(&timings[..1]).is_empty());
        assert!(describe(&timings[1]).contains("0.90x"));
        assert!(describe(&timings[0]).ends_with("compute dtype"));
    }

    #[test]
    fn processes_decide_from_the_mean_timings() {
        // This process found qkv faster in FP8, another slower by more: the mean keeps qkv in
        // the compute dtype on both.
        let mut mine = vec![t("attn.qkv", 1.0, 0.9), t("mlp.fc", 2.0, 1.5)];
        let other = [t("attn.qkv", 1.0, 1.3), t("mlp.fc", 2.0, 1.7)];
        assert_eq!(choose(&mine), vec!["attn.qkv", "mlp.fc"]);
        let means: Vec<f32> = mine
            .iter()
            .zip(&other)
            .flat_map(|(a, b)| {
                [
                    ((a.compute_ms + b.compute_ms) / 2.0) as f32,
                    ((a.fp8_ms + b.fp8_ms) / 2.0) as f32,
                ]
            })
            .collect();
        apply_means(&mut mine, &means);
        assert_eq!(choose(&mine), vec!["mlp.fc"]);
        assert!((mine[0].fp8_ms - 1.1).abs() < 1e-6);
    }
}
