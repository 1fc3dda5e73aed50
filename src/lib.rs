//! burnmix: a mixed-precision training engine built on Burn.
//!
//! This root crate re-exports the workspace's crates and holds the workspace-level integration
//! tests (`tests/`). See the README for the `train` binary.

pub use kernels;
pub use model;
pub use trainer;

/// Timing and argument parsing shared by the benchmark binaries.
pub mod bench {
    use burn::tensor::FloatDType;

    /// A float dtype on the command line: `f32`, `f16` or `bf16`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
    pub enum DTypeArg {
        F32,
        F16,
        Bf16,
    }

    impl From<DTypeArg> for FloatDType {
        fn from(d: DTypeArg) -> Self {
            match d {
                DTypeArg::F32 => FloatDType::F32,
                DTypeArg::F16 => FloatDType::F16,
                DTypeArg::Bf16 => FloatDType::BF16,
            }
        }
    }

    /// The name on the command line (`bf16`, ...).
    impl std::fmt::Display for DTypeArg {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let value = clap::ValueEnum::to_possible_value(self).expect("no variant is skipped");
            f.write_str(value.get_name())
        }
    }

    /// The backend a benchmark runs on.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
    pub enum DeviceArg {
        Cuda,
        Wgpu,
    }

    /// Three sizes written `AxBxC` (e.g. `16384x768x2304`); what they are is the benchmark's to
    /// say.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Triple(pub [usize; 3]);

    impl std::str::FromStr for Triple {
        type Err = String;

        fn from_str(s: &str) -> Result<Self, String> {
            let bad =
                || format!("{s:?} is not three positive sizes joined by x, like 4096x768x2304");
            let v: Vec<usize> = s
                .split('x')
                .map(|x| x.trim().parse().map_err(|_| bad()))
                .collect::<Result<_, _>>()?;
            match <[usize; 3]>::try_from(v) {
                Ok(t) if t.iter().all(|&n| n > 0) => Ok(Triple(t)),
                _ => Err(bad()),
            }
        }
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

#[cfg(test)]
mod tests {
    use super::bench::Triple;

    #[test]
    fn triples_parse_and_bad_ones_are_refused() {
        assert_eq!(
            "4096x768x2304".parse::<Triple>(),
            Ok(Triple([4096, 768, 2304]))
        );
        for bad in ["4096x768", "4096x768x2304x1", "0x768x2304", "ax1x1", ""] {
            let err = bad.parse::<Triple>().unwrap_err();
            assert!(err.contains("three positive sizes"), "{bad}: {err}");
        }
    }
}
