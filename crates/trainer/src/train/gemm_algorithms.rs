//! The GEMM algorithms chosen by timing (`BURNMIX_GEMM_ALGO=timed`) in the training log and in
//! the run's directory: `gemm_algorithms.txt`, written by the rank that writes the run's files
//! after the first step and at each checkpoint, and read back when the run resumes, so that the
//! resumed run computes with the algorithms (and rounds as) the run it continues did.

use std::path::Path;

use anyhow::Result;
use kernels::settings::GemmAlgo;

use crate::fsutil::write_atomic;

/// The record's name in the run's directory.
pub(super) const FILE: &str = "gemm_algorithms.txt";

/// On resume: reads the run's record of timed algorithms, which the GEMMs then take instead of
/// timing again. A line for the log when there is a record: how many it holds, or why it is not
/// used (the algorithms are then timed again).
pub(super) fn read(run_dir: &Path) -> Option<String> {
    let path = run_dir.join(FILE);
    if !path.exists() {
        return None;
    }
    if kernels::settings::get().gemm_algo != GemmAlgo::Timed {
        return Some(format!(
            "{} not used: its algorithms were timed, and BURNMIX_GEMM_ALGO is not `timed` now (cuBLASLt's first choices are used)",
            path.display()
        ));
    }
    let read = std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|text| kernels::gemm::read_gemm_algorithms(&text));
    Some(match read {
        Ok(n) => format!(
            "GEMM algorithms: {n} read from {} (timed by the run resumed)",
            path.display()
        ),
        Err(why) => format!(
            "{} not used ({why}): GEMM algorithms are timed again",
            path.display()
        ),
    })
}

/// Writes the record of the algorithms timed (or read) so far, if there are any.
pub(super) fn write(run_dir: &Path) -> Result<()> {
    match kernels::gemm::gemm_algorithms_record() {
        Some(record) => {
            let path = run_dir.join(FILE);
            write_atomic(&path, record.as_bytes())
        }
        None => Ok(()),
    }
}

/// After the first step, where GEMM algorithms were chosen by timing: how many problems, how
/// many kept another result than the heuristic's first choice, and one call of each with the
/// kept and with the first algorithms.
pub(super) fn timed_line() -> Option<String> {
    let timed = kernels::gemm::timed_gemms();
    if timed.is_empty() {
        return None;
    }
    let others = timed.iter().filter(|t| t.chosen_rank > 0).count();
    let sum =
        |f: fn(&kernels::gemm::TimedGemm) -> f32| timed.iter().map(|t| f(t) as f64).sum::<f64>();
    Some(format!(
        "GEMM algorithms timed (BURNMIX_GEMM_ALGO=timed): {} problems, {others} on another than cuBLASLt's first choice; one call of each takes {:.0} us, {:.0} us with the first choices",
        timed.len(),
        sum(|t| t.chosen_us),
        sum(|t| t.first_us),
    ))
}
