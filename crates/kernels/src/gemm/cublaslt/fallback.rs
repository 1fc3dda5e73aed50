//! GEMMs sent to cuBLASLt that ran on another path: counted per asking thread, and warned about
//! once per distinct message.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// Fallbacks of queued GEMMs, by the thread that asked for them.
pub(super) static QUEUED_FALLBACKS: Mutex<Option<HashMap<std::thread::ThreadId, usize>>> =
    Mutex::new(None);

thread_local! {
    /// GEMMs this thread sent to cuBLASLt that ran on another path instead.
    pub(super) static FALLBACKS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A GEMM sent to cuBLASLt runs on another path: counted, and `msg` printed once per distinct
/// message.
pub(crate) fn fell_back(msg: String) {
    FALLBACKS.with(|c| c.set(c.get() + 1));
    warn_once(msg);
}

/// Prints `msg` once per distinct message.
pub(super) fn warn_once(msg: String) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(msg.clone()) {
        eprintln!("warning: {msg}");
    }
}
