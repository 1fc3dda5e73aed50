//! A watchdog for data-parallel runs: a failure inside CubeCL's device thread (an NCCL call or an
//! allocation failing there) is only logged by CubeCL, and the other ranks then wait in their
//! collectives forever. The watchdog turns such a hang into an error: a thread of its own watches
//! each armed stretch of work (the replicas' start, a step, a checkpoint's gathering) and, when one
//! outlasts its limit, reports which ranks had not finished their part and ends the run.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A stretch of work that outlasted its limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Expired {
    /// What was running, e.g. "step 12".
    pub what: String,
    pub limit: Duration,
    /// The ranks that had not reported their part finished.
    pub pending: Vec<usize>,
}

struct Armed {
    what: String,
    since: Instant,
    limit: Duration,
}

struct State {
    armed: Option<Armed>,
    /// Per rank: whether it finished its part of the armed work.
    finished: Vec<bool>,
    closed: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while reporting leaves the state as valid as before.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Lets a rank's thread report its part of the armed work finished.
#[derive(Clone)]
pub struct Progress(Arc<Shared>);

impl Progress {
    pub fn finished(&self, rank: usize) {
        if let Some(f) = self.0.lock().finished.get_mut(rank) {
            *f = true;
        }
    }
}

/// The watching thread and its state; dropping it ends the thread.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Disarms the watchdog when dropped (the watched work finished). It holds the watchdog's state
/// rather than borrowing the watchdog, so a step can hold it while the session it belongs to
/// changes.
pub struct Watch(Arc<Shared>);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0.lock().armed = None;
        self.0.wake.notify_all();
    }
}

impl Watchdog {
    /// Watches `ranks` ranks; `expire` runs (on the watchdog's thread) when armed work outlasts
    /// its limit, after which the watchdog stops watching.
    pub fn start(ranks: usize, expire: impl FnOnce(Expired) + Send + 'static) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                armed: None,
                finished: vec![false; ranks],
                closed: false,
            }),
            wake: Condvar::new(),
        });
        let watched = shared.clone();
        let thread = std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                let mut st = watched.lock();
                loop {
                    if st.closed {
                        return;
                    }
                    let Some(a) = &st.armed else {
                        st = watched.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                        continue;
                    };
                    let deadline = a.since + a.limit;
                    let now = Instant::now();
                    if now >= deadline {
                        let e = Expired {
                            what: a.what.clone(),
                            limit: a.limit,
                            pending: (0..st.finished.len())
                                .filter(|&r| !st.finished[r])
                                .collect(),
                        };
                        drop(st);
                        expire(e);
                        return;
                    }
                    st = watched
                        .wake
                        .wait_timeout(st, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            })
            .expect("a thread for the watchdog");
        Self {
            shared,
            thread: Some(thread),
        }
    }

    /// Watches `what` for `limit`, every rank's part unfinished, until the returned guard drops.
    pub fn arm(&self, what: impl Into<String>, limit: Duration) -> Watch {
        let mut st = self.shared.lock();
        st.finished.iter_mut().for_each(|f| *f = false);
        st.armed = Some(Armed {
            what: what.into(),
            since: Instant::now(),
            limit,
        });
        drop(st);
        self.shared.wake.notify_all();
        Watch(self.shared.clone())
    }

    /// Marks every rank's part of the armed work unfinished again (a second part of it begins).
    pub fn reset_progress(&self) {
        self.shared
            .lock()
            .finished
            .iter_mut()
            .for_each(|f| *f = false);
    }

    /// A handle for the ranks' threads.
    pub fn progress(&self) -> Progress {
        Progress(self.shared.clone())
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long a step may take. Until a step has been timed (`slowest` is `None`: the replicas'
/// start and the first steps, which compile every kernel, and autotuning takes minutes) at least
/// 30 minutes; then `training.step_timeout_s` when set, otherwise 20 times the slowest step, at
/// least 5 minutes.
pub fn step_limit(configured_s: u64, slowest: Option<Duration>) -> Duration {
    let first = Duration::from_secs(30 * 60);
    match (configured_s, slowest) {
        (0, None) => first,
        (c, None) => Duration::from_secs(c).max(first),
        (0, Some(s)) => (s * 20).max(Duration::from_secs(5 * 60)),
        (c, Some(_)) => Duration::from_secs(c),
    }
}

/// The line a data-parallel run ends with when the watchdog expires.
pub fn message(e: &Expired, gpus: &[usize]) -> String {
    let pending = if e.pending.is_empty() {
        "every rank had queued its part; the GPUs did not finish it".to_string()
    } else {
        let ranks: Vec<String> = e
            .pending
            .iter()
            .map(|&r| match gpus.get(r) {
                Some(g) => format!("rank {r} (CUDA GPU {g})"),
                None => format!("rank {r}"),
            })
            .collect();
        format!("not finished: {}", ranks.join(", "))
    };
    format!(
        "error: {} of the data-parallel run did not finish within {} s ({pending}); a GPU or an NCCL call stopped \
         responding (CubeCL logs a failing NCCL call without reporting it). The run stops; its last checkpoint is \
         complete (continue with --resume). training.step_timeout_s sets the limit.",
        e.what,
        e.limit.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn expires_naming_the_unfinished_ranks() {
        let (tx, rx) = channel();
        let dog = Watchdog::start(3, move |e| tx.send(e).unwrap());
        let progress = dog.progress();
        let _watch = dog.arm("step 4", Duration::from_millis(50));
        progress.finished(0);
        progress.finished(2);
        let e = rx.recv_timeout(Duration::from_secs(10)).expect("expired");
        assert_eq!(
            e,
            Expired {
                what: "step 4".into(),
                limit: Duration::from_millis(50),
                pending: vec![1],
            }
        );
        let line = message(&e, &[0, 3, 5]);
        assert!(line.contains("step 4"), "{line}");
        assert!(line.contains("not finished: rank 1 (CUDA GPU 3)"), "{line}");
        assert!(line.contains("training.step_timeout_s"), "{line}");
    }

    #[test]
    fn work_that_finishes_in_time_does_not_expire() {
        let (tx, rx) = channel();
        let dog = Watchdog::start(2, move |e| tx.send(e).unwrap());
        for step in 0..5 {
            let _watch = dog.arm(format!("step {step}"), Duration::from_millis(300));
            std::thread::sleep(Duration::from_millis(20));
        }
        // Disarmed: nothing expires however long the run then idles.
        std::thread::sleep(Duration::from_millis(500));
        assert!(rx.try_recv().is_err());
        // Re-armed work is watched afresh, with every rank unfinished again.
        let progress = dog.progress();
        progress.finished(0);
        progress.finished(1);
        let _watch = dog.arm("checkpoint", Duration::from_millis(30));
        let e = rx.recv_timeout(Duration::from_secs(10)).expect("expired");
        assert_eq!(e.pending, vec![0, 1]);
        assert_eq!(e.what, "checkpoint");
    }

    #[test]
    fn the_limit_follows_the_config_or_the_slowest_step() {
        assert_eq!(step_limit(90, None), Duration::from_secs(1800));
        assert_eq!(step_limit(4000, None), Duration::from_secs(4000));
        assert_eq!(
            step_limit(90, Some(Duration::from_secs(1000))),
            Duration::from_secs(90)
        );
        assert_eq!(step_limit(0, None), Duration::from_secs(1800));
        assert_eq!(
            step_limit(0, Some(Duration::from_millis(70))),
            Duration::from_secs(300)
        );
        assert_eq!(
            step_limit(0, Some(Duration::from_secs(40))),
            Duration::from_secs(800)
        );
    }
}
