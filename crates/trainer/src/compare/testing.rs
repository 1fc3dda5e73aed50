//! Step records for the tests of the verdicts and the heatmaps.

use crate::metrics::StepRecord;

fn rec(step: u64, loss: f64, grad_norm: f64, val: Option<f64>) -> StepRecord {
    StepRecord {
        step,
        loss,
        lr: 1e-3,
        grad_norm,
        precision: "fp16".into(),
        loss_scale: 1.0,
        skipped: false,
        overflows: 0,
        tokens_per_s: 1000.0,
        step_ms: 1.0,
        host_ms: 0.5,
        mfu: None,
        val_loss: val,
        fp8: None,
        numerics: None,
        memory_reserved: None,
    }
}

pub fn smooth(n: u64) -> Vec<StepRecord> {
    (1..=n)
        .map(|s| {
            rec(
                s,
                4.0 - s as f64 * 0.01,
                1.0,
                (s % 10 == 0).then_some(4.0 - s as f64 * 0.01),
            )
        })
        .collect()
}
