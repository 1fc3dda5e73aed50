//! The algorithms that timing chose (`BURNMIX_GEMM_ALGO=timed`), as text that another process
//! reads back: a training run keeps them in its directory, and the run resumed from it takes them
//! instead of timing again, so that it computes with the same algorithms, and so rounds the same
//! way, as the run it continues.
//!
//! An algorithm (`cublasLtMatmulAlgo_t`, 64 bytes) is only meaningful to the cuBLASLt release
//! that produced it: a record of another release is refused whole, and each algorithm read is
//! checked with `cublasLtMatmulAlgoCheck` against its problem's descriptors before it is used
//! (one that fails the check is timed again). Each entry names the GPU it was timed on, and is
//! only used on a GPU of that name.
//!
//! The text: a comment line, `cublaslt VERSION`, then one line per problem, its key (GPU,
//! problem, SM target), a tab, and the algorithm's 64 bytes in hex.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use cudarc::cublaslt::sys;

use super::problem::Problem;

const FIRST_LINE: &str = "# burnmix GEMM algorithms, chosen by timing (BURNMIX_GEMM_ALGO=timed)";

/// Where an entry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Timed in this process.
    Timed,
    /// Read from a record ([`read`]); timed by the process that wrote it.
    Read,
}

/// Every problem's algorithm timed in this process or read from a record, by key.
static RECORDED: Mutex<BTreeMap<String, ([u64; 8], Source)>> = Mutex::new(BTreeMap::new());

/// How many problems took an algorithm read from a record ([`used`]).
static USED: AtomicUsize = AtomicUsize::new(0);

/// The key of `problem` on the GPU named `gpu`, with cuBLASLt told to plan for `sm_target` SMs.
pub(super) fn key(gpu: &str, problem: &Problem, sm_target: Option<i32>) -> String {
    let sms = sm_target.map_or("all".to_string(), |n| n.to_string());
    // The problem's `Debug` names every field that selects an algorithm.
    format!("{gpu} | {problem:?} | SM target {sms}")
}

/// The algorithm recorded for `key` by an earlier process (read from its record), if any.
pub(super) fn read_for(key: &str) -> Option<sys::cublasLtMatmulAlgo_t> {
    let recorded = RECORDED.lock().unwrap_or_else(|p| p.into_inner());
    match recorded.get(key) {
        Some((data, Source::Read)) => Some(sys::cublasLtMatmulAlgo_t { data: *data }),
        _ => None,
    }
}

/// Counts a problem that took the algorithm [`read_for`] gave.
pub(super) fn count_used() {
    USED.fetch_add(1, Ordering::Relaxed);
}

/// How many problems in this process took an algorithm read from a record instead of timing.
pub(super) fn used() -> usize {
    USED.load(Ordering::Relaxed)
}

/// Forgets every algorithm timed or read, as in a new process.
pub(super) fn forget() {
    RECORDED.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// Records the algorithm timing chose for `key` in this process.
pub(super) fn note(key: String, algo: &sys::cublasLtMatmulAlgo_t) {
    RECORDED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, (algo.data, Source::Timed));
}

/// The record of every algorithm timed in this process or read from a record (which the process
/// uses), for cuBLASLt `version`; `None` when there is none.
pub(super) fn text(version: usize) -> Option<String> {
    let recorded = RECORDED.lock().unwrap_or_else(|p| p.into_inner());
    if recorded.is_empty() {
        return None;
    }
    let mut s = format!("{FIRST_LINE}\ncublaslt {version}\n");
    for (key, (data, _)) in recorded.iter() {
        s.push_str(key);
        s.push('\t');
        for word in data {
            s.push_str(&format!("{word:016x}"));
        }
        s.push('\n');
    }
    Some(s)
}

/// Reads a record written by [`text`] for cuBLASLt `version`: its algorithms are then used by
/// the problems they were timed for instead of timing them. Returns how many it holds; refuses
/// (and takes nothing from) a record of another cuBLASLt release or one that is not a record.
pub(super) fn read(record: &str, version: usize) -> Result<usize, String> {
    let mut lines = record.lines();
    if lines.next() != Some(FIRST_LINE) {
        return Err(format!(
            "not a record of GEMM algorithms (its first line is not `{FIRST_LINE}`)"
        ));
    }
    let written = lines
        .next()
        .and_then(|l| l.strip_prefix("cublaslt "))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .ok_or("its second line is not `cublaslt VERSION`")?;
    if written != version {
        return Err(format!(
            "written with cuBLASLt {written}, and this process loads {version}: its algorithms are not valid here"
        ));
    }
    let mut entries = Vec::new();
    for (i, line) in lines.enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = || format!("line {}: not `KEY<tab>128 hex digits`", i + 3);
        let (key, hex) = line.rsplit_once('\t').ok_or_else(bad)?;
        let hex = hex.trim();
        if key.is_empty() || hex.len() != 128 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut data = [0u64; 8];
        for (w, word) in data.iter_mut().enumerate() {
            *word = u64::from_str_radix(&hex[16 * w..16 * (w + 1)], 16).map_err(|_| bad())?;
        }
        entries.push((key.to_string(), data));
    }
    let count = entries.len();
    let mut recorded = RECORDED.lock().unwrap_or_else(|p| p.into_inner());
    for (key, data) in entries {
        // What this process timed itself stays.
        recorded.entry(key).or_insert((data, Source::Read));
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_other_releases_are_refused() {
        let algo = sys::cublasLtMatmulAlgo_t {
            data: [1, 2, 3, u64::MAX, 0, 5, 6, 0x0123_4567_89ab_cdef],
        };
        let key = "Test GPU | record test | SM target all".to_string();
        note(key.clone(), &algo);
        let written = text(130100).expect("one entry");
        assert!(written.starts_with(FIRST_LINE));
        // A timed entry is not an earlier process's.
        assert!(read_for(&key).is_none());

        let other_key = "Test GPU | read back | SM target 131";
        let other = written.replace(&key, other_key);
        let err = read(&other, 130200).unwrap_err();
        assert!(err.contains("130100") && err.contains("130200"), "{err}");
        assert!(read_for(other_key).is_none());
        assert!(read(&other, 130100).unwrap() >= 1);
        assert_eq!(read_for(other_key).map(|a| a.data), Some(algo.data));

        assert!(read("cublaslt 130100\n", 130100)
            .unwrap_err()
            .contains("first line"));
        let truncated = format!("{FIRST_LINE}\ncublaslt 130100\nkey\t0123\n");
        assert!(read(&truncated, 130100).unwrap_err().contains("line 3"));
    }
}
