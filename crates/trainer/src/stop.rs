//! A run asked to stop: SIGINT or SIGTERM (Ctrl-C, or a cluster preempting the job) asks the
//! training loop to end at the next step boundary with a checkpoint of that step. Every rank of a
//! data-parallel run stops at the same step: the request travels with the step's averaged
//! statistics, so one rank's signal stops them all. A second signal ends the process at once.
//!
//! The `train` binary installs the handlers ([`install_handlers`]); a program that trains through
//! the library can ask for the stop itself ([`request`]).

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(signal: libc::c_int) {
    if REQUESTED.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe; the second signal means "now".
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Makes SIGINT and SIGTERM ask for the stop ([`requested`]); a second one exits at once.
pub fn install_handlers() {
    // SAFETY: the handler only touches an atomic and calls `_exit`.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// Asks the training loop to stop at the next step boundary, with a checkpoint.
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
