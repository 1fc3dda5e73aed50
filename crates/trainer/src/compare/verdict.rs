//! The stability verdict of one run from its step records: diverged, unstable or stable.

use serde::Serialize;

use crate::metrics::StepRecord;

/// Stability verdict of one run (defined in `docs/precision.md`, "Comparing recipes").
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Stability {
    /// "stable", "unstable" or "diverged".
    pub verdict: String,
    /// Why, in words ("" when stable).
    pub reason: String,
    /// The first step that made the verdict.
    pub first_bad_step: Option<u64>,
    /// After warm-up: steps whose training loss exceeded 1.5x its running minimum.
    pub loss_spikes: u64,
    /// Steps whose gradient norm exceeded 10x the median of the previous 100 steps' norms.
    pub grad_norm_spikes: u64,
}

/// Training-loss spike threshold, relative to the running minimum after warm-up.
pub const LOSS_SPIKE: f64 = 1.5;
/// Gradient-norm spike threshold, relative to the median of the previous [`GRAD_WINDOW`] norms.
pub const GRAD_SPIKE: f64 = 10.0;
pub const GRAD_WINDOW: usize = 100;

/// The verdict of a run from its step records; `failed` is the run's error, if it stopped with one.
pub fn stability(records: &[StepRecord], warmup_steps: u64, failed: Option<&str>) -> Stability {
    let mut first_bad: Option<u64> = None;
    let mut diverged: Option<String> = None;
    if let Some(r) = records.iter().find(|r| !r.loss.is_finite()) {
        diverged = Some(format!("non-finite training loss at step {}", r.step));
        first_bad = Some(r.step);
    }
    let vals: Vec<(u64, f64)> = records
        .iter()
        .filter_map(|r| r.val_loss.map(|v| (r.step, v)))
        .collect();
    if diverged.is_none() {
        if let Some(&(_, v0)) = vals.first() {
            if let Some(&(s, v)) = vals.iter().skip(1).find(|(_, v)| !v.is_finite() || *v > v0) {
                diverged = Some(format!(
                    "validation loss {v:.4} at step {s} above its first value {v0:.4}"
                ));
                first_bad = Some(s);
            }
        }
    }
    if diverged.is_none() {
        if let Some(why) = failed {
            diverged = Some(format!("the run stopped: {why}"));
            first_bad = records.last().map(|r| r.step);
        }
    }
    let (mut loss_spikes, mut grad_spikes) = (0u64, 0u64);
    let mut first_spike: Option<u64> = None;
    let mut running_min = f64::INFINITY;
    let mut window: std::collections::VecDeque<f64> = std::collections::VecDeque::new();
    for r in records {
        if r.step > warmup_steps && r.loss.is_finite() {
            if running_min.is_finite() && r.loss > LOSS_SPIKE * running_min {
                loss_spikes += 1;
                first_spike.get_or_insert(r.step);
            }
            running_min = running_min.min(r.loss);
        }
        if r.grad_norm.is_finite() && !r.skipped {
            if window.len() >= 10 {
                let mut w: Vec<f64> = window.iter().copied().collect();
                w.sort_by(|a, b| a.total_cmp(b));
                let median = w[w.len() / 2];
                if r.grad_norm > GRAD_SPIKE * median {
                    grad_spikes += 1;
                    first_spike.get_or_insert(r.step);
                }
            }
            window.push_back(r.grad_norm);
            if window.len() > GRAD_WINDOW {
                window.pop_front();
            }
        }
    }
    let (verdict, reason) = match diverged {
        Some(why) => ("diverged", why),
        None if loss_spikes + grad_spikes > 0 => {
            first_bad = first_spike;
            (
                "unstable",
                format!("{loss_spikes} training-loss spikes, {grad_spikes} gradient-norm spikes"),
            )
        }
        None => ("stable", String::new()),
    };
    Stability {
        verdict: verdict.into(),
        reason,
        first_bad_step: first_bad,
        loss_spikes,
        grad_norm_spikes: grad_spikes,
    }
}

pub const VERDICTS: &str = "diverged: a non-finite training loss, a run stopped by an error (such as a loss scaler at its floor), \
or a validation loss above the run's first one; unstable: after warm-up, a training loss above 1.5x its running minimum, or a \
gradient norm above 10x the median of the previous 100 steps' norms (spikes counted); stable: neither.";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::testing::smooth;

    #[test]
    fn verdicts() {
        let ok = stability(&smooth(200), 20, None);
        assert_eq!((ok.verdict.as_str(), ok.first_bad_step), ("stable", None));

        let mut spike = smooth(200);
        spike[149].loss = 10.0; // step 150
        spike[169].grad_norm = 50.0; // step 170
        let s = stability(&spike, 20, None);
        assert_eq!(
            (
                s.verdict.as_str(),
                s.first_bad_step,
                s.loss_spikes,
                s.grad_norm_spikes
            ),
            ("unstable", Some(150), 1, 1)
        );
        // Inside warm-up a loss above 1.5x the minimum so far is no spike.
        let mut early = smooth(200);
        early[4].loss = 10.0;
        assert_eq!(stability(&early, 20, None).verdict, "stable");

        let mut nan = smooth(200);
        nan[99].loss = f64::NAN;
        let d = stability(&nan, 20, None);
        assert_eq!(
            (d.verdict.as_str(), d.first_bad_step),
            ("diverged", Some(100))
        );

        let mut up = smooth(200);
        up[179].val_loss = Some(4.5); // above the first evaluation (3.9)
        assert_eq!(stability(&up, 20, None).first_bad_step, Some(180));

        let stopped = stability(&smooth(50), 20, Some("the loss scale collapsed"));
        assert_eq!(stopped.verdict, "diverged");
        assert!(stopped.reason.contains("collapsed"));
    }
}
