//! burnmix: a mixed-precision training engine built on Burn.
//!
//! This root crate re-exports the workspace's crates and holds the workspace-level integration tests
//! (`tests/`). See the README for the `train` binary.

pub use kernels;
pub use model;
pub use trainer;

/// Timing shared by the benchmark binaries.
pub mod bench {
    use std::time::Instant;

    use burn::tensor::backend::Backend;

    /// Median seconds per call of `f`: `warmup` calls, then `reps` batches of `iters` calls, each
    /// batch bounded by device synchronisations.
    pub fn median_seconds<B: Backend>(dev: &B::Device, warmup: usize, iters: usize, reps: usize, f: &mut dyn FnMut()) -> f64 {
        for _ in 0..warmup {
            f();
        }
        B::sync(dev).expect("sync");
        let mut samples: Vec<f64> = (0..reps.max(1))
            .map(|_| {
                let t = Instant::now();
                for _ in 0..iters {
                    f();
                }
                B::sync(dev).expect("sync");
                t.elapsed().as_secs_f64() / iters.max(1) as f64
            })
            .collect();
        samples.sort_by(f64::total_cmp);
        samples[samples.len() / 2]
    }
}
