//! Learning-rate schedule: linear warm-up, then cosine decay to a floor (nanoGPT's `get_lr`).

use crate::config::Config;

/// Learning rate for the optimizer step with 0-based index `step`.
pub fn lr_at(cfg: &Config, step: usize) -> f64 {
    let peak = cfg.optimizer.lr;
    let min = cfg.schedule.min_lr;
    let warmup = cfg.schedule.warmup_steps;
    if step < warmup {
        return peak * (step + 1) as f64 / (warmup + 1) as f64;
    }
    let decay = cfg.decay_steps();
    if step >= decay || decay <= warmup {
        return min;
    }
    let ratio = (step - warmup) as f64 / (decay - warmup) as f64;
    let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
    min + coeff * (peak - min)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_floor() {
        let mut cfg = Config::default();
        cfg.optimizer.lr = 1e-3;
        cfg.schedule.min_lr = 1e-4;
        cfg.schedule.warmup_steps = 10;
        cfg.training.steps = 110;
        assert!((lr_at(&cfg, 0) - 1e-3 / 11.0).abs() < 1e-12);
        assert!(lr_at(&cfg, 9) < lr_at(&cfg, 10));
        assert!((lr_at(&cfg, 10) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&cfg, 60) - 5.5e-4).abs() < 1e-9);
        assert!((lr_at(&cfg, 110) - 1e-4).abs() < 1e-12);
        for s in 10..109 {
            assert!(lr_at(&cfg, s + 1) <= lr_at(&cfg, s));
        }
    }
}
