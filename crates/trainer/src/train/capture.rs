//! `BURNMIX_PROFILE_STEPS=FROM-TO`: steps FROM to TO (counted from 1, as the log counts them) run
//! inside the CUDA profiler's capture range ([`kernels::cuda_profiler`]), so that a profiler told
//! to wait for it (`ncu --profile-from-start off`, `nsys profile --capture-range=cudaProfilerApi`)
//! records those steps' kernels: not the first step's compilation, not what runs after TO (the
//! last evaluation and checkpoint), but an evaluation or checkpoint due at a step before TO is
//! inside. The device is drained at both ends of the range, and step TO is read at once rather
//! than one step late, so that no kernel of another step falls inside it. A range reaching past
//! the session's steps (a resumed run, `--stop-at`) is cut to them. On a data-parallel run of
//! threads, rank 0's device is captured; each process of a run of processes captures its own.
//! Elsewhere than on CUDA the variable is ignored, with a line that says so.

use anyhow::{anyhow, Result};
use burn::tensor::backend::Backend;
use kernels::collective::CollectiveBackend;

use super::log::Logger;

/// The variable's name.
pub(super) const ENV: &str = "BURNMIX_PROFILE_STEPS";

/// A capture range over steps, and whether it is open.
pub(super) struct Capture {
    /// First and last step captured, counted from 1.
    from: u64,
    to: u64,
    /// The CUDA device (index).
    device: usize,
    open: bool,
}

impl Capture {
    /// The range the environment asks for on `device`, within this session's steps `first..end`
    /// (counted from 0), or `None` (unset or empty, not a CUDA device, or no step of the range in
    /// the session; each said in a line). A value that is not `FROM-TO` (or a single step `N`)
    /// with 1 <= FROM <= TO is an error that names the variable.
    pub fn from_env<B: Backend + CollectiveBackend>(
        device: &B::Device,
        (first, end): (u64, u64),
        log: &Logger,
    ) -> Result<Option<Capture>> {
        let Some(value) = std::env::var(ENV).ok().filter(|v| !v.trim().is_empty()) else {
            return Ok(None);
        };
        let (from, to) = parse(&value).map_err(|e| anyhow!("{ENV}={value}: {e}"))?;
        let Some(device) = B::cuda_index(device) else {
            log.line(&format!(
                "{ENV}: the device is not a CUDA GPU, so there is no CUDA profiler to capture for; ignored"
            ));
            return Ok(None);
        };
        // This session runs steps first + 1 ..= end, counted from 1.
        let (kept_from, kept_to) = (from.max(first + 1), to.min(end));
        if kept_from > kept_to {
            log.line(&format!(
                "{ENV}: steps {from}-{to} are outside this session's steps {}-{end}: nothing will be captured",
                first + 1
            ));
            return Ok(None);
        }
        if (kept_from, kept_to) != (from, to) {
            log.line(&format!(
                "{ENV}: this session runs steps {}-{end}: capturing steps {kept_from}-{kept_to} of {from}-{to}",
                first + 1
            ));
        }
        Ok(Some(Capture {
            from: kept_from,
            to: kept_to,
            device,
            open: false,
        }))
    }

    /// Before step `step` (counted from 0) is queued: opens the range at its first step.
    pub fn before<B: Backend>(
        &mut self,
        step: u64,
        device: &B::Device,
        log: &Logger,
    ) -> Result<()> {
        if step + 1 != self.from || self.open {
            return Ok(());
        }
        drain::<B>(device)?;
        kernels::cuda_profiler::start(self.device).map_err(|e| anyhow!("{ENV}: {e}"))?;
        self.open = true;
        log.line(&format!(
            "{ENV}: capturing steps {}-{} for the CUDA profiler (cuProfilerStart)",
            self.from, self.to
        ));
        Ok(())
    }

    /// Whether step `step` (counted from 0) must be read at once: the range's last step.
    pub fn reads_at_once(&self, step: u64) -> bool {
        step + 1 == self.to
    }

    /// After step `step` (counted from 0) was read: closes the range at its last step.
    pub fn after<B: Backend>(&mut self, step: u64, device: &B::Device, log: &Logger) -> Result<()> {
        if step + 1 == self.to {
            self.close::<B>(device, log)?;
        }
        Ok(())
    }

    /// Closes the range if it is still open (a run that stopped inside it).
    pub fn close<B: Backend>(&mut self, device: &B::Device, log: &Logger) -> Result<()> {
        if !self.open {
            return Ok(());
        }
        drain::<B>(device)?;
        kernels::cuda_profiler::stop(self.device).map_err(|e| anyhow!("{ENV}: {e}"))?;
        self.open = false;
        log.line(&format!("{ENV}: capture ended (cuProfilerStop)"));
        Ok(())
    }
}

/// Waits until the device has run everything queued on it.
fn drain<B: Backend>(device: &B::Device) -> Result<()> {
    B::sync(device).map_err(|e| anyhow!("{ENV}: waiting for the device: {e:?}"))
}

/// `FROM-TO` or `N` (FROM = TO = N), steps counted from 1.
fn parse(value: &str) -> Result<(u64, u64), String> {
    let step = |s: &str| {
        s.trim()
            .parse::<u64>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("`{}` is not a step number (1 or more)", s.trim()))
    };
    let (from, to) = match value.split_once('-') {
        Some((a, b)) => (step(a)?, step(b)?),
        None => {
            let n = step(value)?;
            (n, n)
        }
    };
    if from > to {
        return Err(format!(
            "the first step ({from}) comes after the last ({to}); write FROM-TO"
        ));
    }
    Ok((from, to))
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn steps_parse_as_a_range_or_one_step() {
        assert_eq!(parse("10-12"), Ok((10, 12)));
        assert_eq!(parse(" 3 - 3 "), Ok((3, 3)));
        assert_eq!(parse("7"), Ok((7, 7)));
    }

    #[test]
    fn bad_ranges_say_what_is_wrong() {
        assert!(parse("12-10").unwrap_err().contains("comes after"));
        assert!(parse("0-3")
            .unwrap_err()
            .contains("`0` is not a step number"));
        assert!(parse("a-b").unwrap_err().contains("`a`"));
        assert!(parse("5-").unwrap_err().contains("not a step number"));
    }
}
