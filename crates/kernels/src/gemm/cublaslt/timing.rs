//! Choosing a problem's algorithm by timing the heuristic's results (`BURNMIX_GEMM_ALGO=timed`).
//!
//! cuBLASLt's heuristic ranks its algorithms by a model of the GPU, and its first choice is not
//! always the fastest it offers: on an H100 (cuBLASLt 13.1) at GPT-2 small's MLP shapes the
//! fastest of its results was 7-16% faster than the first. Here a problem's first call runs each
//! of the heuristic's first [`CANDIDATES`] results a few times on the call's own operands, stream
//! and workspace, and the fastest is kept for the rest of the process.

use std::sync::Mutex;

use cudarc::cublaslt::sys;
use cudarc::driver::{result as drv, sys as dsys};

use super::problem::{describe, Problem};

/// How many of the heuristic's results are timed.
pub(super) const CANDIDATES: usize = 8;

/// Each candidate runs once per round, after one untimed run; rounds take the candidates in
/// turn, so that a change of clocks reaches all of them alike. A candidate's time is its
/// fastest round.
const ROUNDS: usize = 3;

/// One problem's timed choice.
#[derive(Debug, Clone)]
pub struct TimedGemm {
    /// The problem in one line.
    pub problem: String,
    /// Results timed (those that ran).
    pub candidates: usize,
    /// The heuristic's first choice's time, microseconds.
    pub first_us: f32,
    /// The kept algorithm's time, microseconds.
    pub chosen_us: f32,
    /// The kept algorithm's rank among the heuristic's results (0: its first choice).
    pub chosen_rank: usize,
}

/// Every problem timed so far in this process, in order.
static TIMED: Mutex<Vec<TimedGemm>> = Mutex::new(Vec::new());

/// The problems whose algorithm was chosen by timing so far in this process (all devices).
pub fn timed_gemms() -> Vec<TimedGemm> {
    TIMED.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The index in `candidates` of the fastest algorithm for `problem`, each run with `issue` (which
/// queues the call with that algorithm and the output it is given) on `stream`; records the
/// choice for [`timed_gemms`].
///
/// With `beta` 0 the candidates write the call's own output: the call that follows writes it
/// again. Otherwise (the call adds into its output) they write a scratch buffer of `out_bytes`,
/// so that the output is not changed. A `GeluAux` call's auxiliary matrix is written by every
/// candidate and again by the call.
///
/// # Safety
/// The device's context is current; everything `issue` reads and writes is live and ordered
/// before the work queued on `stream` now.
pub(super) unsafe fn fastest(
    candidates: &[sys::cublasLtMatmulAlgo_t],
    problem: &Problem,
    beta: f32,
    out: u64,
    out_bytes: usize,
    stream: dsys::CUstream,
    issue: impl Fn(&sys::cublasLtMatmulAlgo_t, u64) -> Result<(), String>,
) -> Result<usize, String> {
    let scratch = if beta == 0.0 {
        None
    } else {
        Some(drv::malloc_sync(out_bytes).map_err(|e| format!("cuMemAlloc({out_bytes}): {e:?}"))?)
    };
    let target = scratch.unwrap_or(out);
    let times = time_each(candidates, stream, |algo| issue(algo, target));
    if let Some(s) = scratch {
        // After `time_each` synchronised the stream, nothing uses it.
        let _ = drv::free_sync(s);
    }
    let times = times?;
    let (chosen, &chosen_s) = times
        .iter()
        .enumerate()
        .filter(|(_, t)| t.is_finite())
        .min_by(|a, b| a.1.total_cmp(b.1))
        .ok_or_else(|| "no algorithm ran".to_string())?;
    TIMED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(TimedGemm {
            problem: describe(problem),
            candidates: times.iter().filter(|t| t.is_finite()).count(),
            first_us: times[0] * 1e3,
            chosen_us: chosen_s * 1e3,
            chosen_rank: chosen,
        });
    Ok(chosen)
}

/// Each candidate's fastest round in milliseconds (infinite for one whose call failed), with
/// `run` queuing one call; returns once the stream has run them.
unsafe fn time_each(
    candidates: &[sys::cublasLtMatmulAlgo_t],
    stream: dsys::CUstream,
    run: impl Fn(&sys::cublasLtMatmulAlgo_t) -> Result<(), String>,
) -> Result<Vec<f32>, String> {
    let mut ok: Vec<bool> = candidates.iter().map(|a| run(a).is_ok()).collect();
    let mut events = Vec::with_capacity(2 * ROUNDS * candidates.len());
    let result = (|| {
        for _ in 0..2 * ROUNDS * candidates.len() {
            events.push(
                drv::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT)
                    .map_err(|e| format!("cuEventCreate: {e:?}"))?,
            );
        }
        let record = |e| drv::event::record(e, stream).map_err(|e| format!("cuEventRecord: {e:?}"));
        for round in 0..ROUNDS {
            for (i, algo) in candidates.iter().enumerate() {
                let at = 2 * (round * candidates.len() + i);
                record(events[at])?;
                if ok[i] {
                    ok[i] = run(algo).is_ok();
                }
                record(events[at + 1])?;
            }
        }
        drv::event::synchronize(events[events.len() - 1])
            .map_err(|e| format!("timing the GEMM's algorithms: {e:?}"))?;
        let mut best = vec![f32::INFINITY; candidates.len()];
        for round in 0..ROUNDS {
            for (i, b) in best.iter_mut().enumerate() {
                let at = 2 * (round * candidates.len() + i);
                let ms = drv::event::elapsed(events[at], events[at + 1])
                    .map_err(|e| format!("cuEventElapsedTime: {e:?}"))?;
                *b = b.min(ms);
            }
        }
        Ok(best
            .into_iter()
            .zip(&ok)
            .map(|(t, &ran)| if ran { t } else { f32::INFINITY })
            .collect())
    })();
    for e in events {
        let _ = drv::event::destroy(e);
    }
    result
}
