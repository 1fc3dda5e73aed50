//! burnmix: a mixed-precision training engine built on Burn.
//!
//! This root crate re-exports the workspace's crates and holds the workspace-level integration tests
//! (`tests/`). See the README for the `train` binary.

pub use kernels;
pub use model;
pub use trainer;

/// Timing and argument parsing shared by the benchmark binaries.
pub mod bench {
    /// Comma-separated `AxBxC` triples (`what` names the three, for the message), e.g. `4096x4096x4096,16384x768x2304`.
    pub fn parse_triples(s: &str, what: &str) -> Vec<[usize; 3]> {
        s.split(',')
            .map(|t| {
                let v: Vec<usize> = t
                    .split('x')
                    .map(|x| {
                        x.trim()
                            .parse()
                            .unwrap_or_else(|_| panic!("bad shape {t}: use {what}"))
                    })
                    .collect();
                <[usize; 3]>::try_from(v).unwrap_or_else(|_| panic!("bad shape {t}: use {what}"))
            })
            .collect()
    }

    use std::time::Instant;

    use burn::tensor::backend::Backend;

    /// Median seconds per call of `f`: `warmup` calls, then `reps` batches of `iters` calls, each
    /// batch bounded by device synchronisations.
    pub fn median_seconds<B: Backend>(
        dev: &B::Device,
        warmup: usize,
        iters: usize,
        reps: usize,
        f: &mut dyn FnMut(),
    ) -> f64 {
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
