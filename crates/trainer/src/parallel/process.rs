//! A process's membership of a run of one process per GPU: the rendezvous ([`super::rendezvous`])
//! hands every rank rank 0's NCCL unique id, which joins them in one communicator
//! (`kernels::collective`); the rendezvous connections then stay open as the run's fault line. A
//! rank that finishes says so on them; a connection that closes without that means the rank at
//! the other end died, and this rank stops within a second with an error that names it, instead
//! of waiting in NCCL for a peer that will never come.
//!
//! Finishing is a barrier on those connections: every rank says it finished once its GPU work is
//! done, and no rank exits before its peers said so (rank 0 answers only after every other rank
//! did). NCCL's socket transport sends a collective's last bytes from a helper thread after the
//! sending rank's kernel has ended, so a rank that exited at once could take them with it and
//! leave a peer waiting for them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use kernels::collective::{CollectiveBackend, ProcessGroup};

use super::place::Place;
use super::rendezvous::rendezvous;

/// How long the rendezvous waits for every rank to arrive (a node can be slow to start).
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a rank whose peer died waits for NCCL's abort before it exits anyway.
const ABORT_WAIT: Duration = Duration::from_secs(10);

/// How long a finished rank waits for its peers to finish before it exits anyway.
const FINISH_WAIT: Duration = Duration::from_secs(60);

/// The byte a rank sends on its rendezvous connections when it finished its part normally.
const FINISHED: u8 = b'F';

/// How many peers have finished (or gone after this rank finished), and a wake-up for the rank
/// that waits for them.
#[derive(Default)]
struct Finishes {
    count: Mutex<usize>,
    wake: Condvar,
}

impl Finishes {
    fn arrive(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.wake.notify_all();
    }

    /// Waits until `n` peers have arrived or `limit` has passed; whether they all arrived.
    fn wait_for(&self, n: usize, limit: Duration) -> bool {
        let count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        let (count, _) = self
            .wake
            .wait_timeout_while(count, limit, |c| *c < n)
            .unwrap_or_else(|e| e.into_inner());
        *count >= n
    }
}

/// This process's membership of a run of processes.
pub struct Membership {
    pub group: ProcessGroup,
    /// The rendezvous connections (rank 0: one per other rank; others: the one to rank 0), each
    /// with the rank at its other end.
    links: Vec<(usize, TcpStream)>,
    /// Set once this rank has finished: connections closing after that are expected.
    finished: Arc<AtomicBool>,
    /// The peers at the other ends of `links` that have finished.
    peers_finished: Arc<Finishes>,
    rank: usize,
}

/// Joins the run `place` describes, on `device` (GPU `place.local_rank`): the rendezvous (every
/// rank must bring the same `fingerprint`, the resolved config's), NCCL's communicator from rank
/// 0's unique id, and the watch of the connections.
pub fn join<B: CollectiveBackend>(
    place: &Place,
    fingerprint: u64,
    device: &B::Device,
) -> Result<Membership> {
    let joined = rendezvous(
        place,
        fingerprint,
        || {
            kernels::collective::unique_id()
                .map(|id| id.to_vec())
                .map_err(|e| anyhow!("NCCL's unique id could not be drawn: {e}"))
        },
        RENDEZVOUS_TIMEOUT,
    )?;
    let id: [u8; kernels::collective::UNIQUE_ID_BYTES] =
        joined.payload.as_slice().try_into().map_err(|_| {
            anyhow!(
                "the rendezvous handed out {} bytes where NCCL's unique id has {}",
                joined.payload.len(),
                kernels::collective::UNIQUE_ID_BYTES
            )
        })?;
    let group = ProcessGroup::join::<B>(device, &id, place.rank, place.world_size)
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| {
            format!(
                "rank {} of {} could not join the NCCL communicator on GPU {}",
                place.rank, place.world_size, place.local_rank
            )
        })?;
    let peers: Vec<usize> = if place.rank == 0 {
        (1..place.world_size).collect()
    } else {
        vec![0]
    };
    let links: Vec<(usize, TcpStream)> = peers.into_iter().zip(joined.links).collect();
    let finished = Arc::new(AtomicBool::new(false));
    let peers_finished = Arc::new(Finishes::default());
    for (peer, link) in &links {
        let link = link
            .try_clone()
            .context("a rendezvous connection could not be watched")?;
        let watched = Watched {
            me: place.rank,
            peer: *peer,
            group: group.clone(),
            finished: finished.clone(),
            peers_finished: peers_finished.clone(),
        };
        watch(link, watched);
    }
    Ok(Membership {
        group,
        links,
        finished,
        peers_finished,
        rank: place.rank,
    })
}

impl Membership {
    /// This rank finished its part of the run normally; call it once the device has finished
    /// this rank's work (`Backend::sync`). Tells the ranks at the other ends, whose watch then
    /// lets them exit, and returns once they have finished too (rank 0 answers the others only
    /// after all of them), or after a minute with a warning.
    pub fn finish(mut self) {
        self.finished.store(true, Ordering::SeqCst);
        let peers = self.links.len();
        let waited = if self.rank == 0 {
            let all = self.peers_finished.wait_for(peers, FINISH_WAIT);
            self.tell_finished();
            all
        } else {
            self.tell_finished();
            self.peers_finished.wait_for(peers, FINISH_WAIT)
        };
        if !waited {
            eprintln!(
                "warning: rank {}: finished, but not every other rank said it finished within {} s; exiting anyway",
                self.rank,
                FINISH_WAIT.as_secs()
            );
        }
    }

    fn tell_finished(&mut self) {
        for (_, link) in &mut self.links {
            let _ = link.write_all(&[FINISHED]);
            let _ = link.flush();
        }
    }
}

/// What the watch of one connection needs.
struct Watched {
    me: usize,
    peer: usize,
    group: ProcessGroup,
    finished: Arc<AtomicBool>,
    peers_finished: Arc<Finishes>,
}

/// Watches the connection to rank `peer` in a thread of its own: if it closes before `peer` said
/// it finished, and before this rank finished, this rank aborts its communicator and exits with
/// an error naming `peer` (without running exit handlers: a thread may be waiting in NCCL or on
/// the GPU for the dead rank's share).
fn watch(mut link: TcpStream, watched: Watched) {
    let Watched {
        me,
        peer,
        group,
        finished,
        peers_finished,
    } = watched;
    let _ = link.set_read_timeout(None);
    std::thread::Builder::new()
        .name(format!("rank {peer} watch"))
        .spawn(move || {
            let mut byte = [0u8; 1];
            let why = match link.read(&mut byte) {
                // The group is left to the process's exit: dropping the last clone here would
                // tear NCCL down while the main thread may be exiting.
                Ok(1) if byte[0] == FINISHED => {
                    peers_finished.arrive();
                    return std::mem::forget(group);
                }
                Ok(0) => "closed its connection".to_string(),
                Ok(_) => format!("sent an unexpected byte {:#04x}", byte[0]),
                Err(e) => format!("its connection failed ({e})"),
            };
            if finished.load(Ordering::SeqCst) {
                // Gone after this rank finished: nothing left to wait for from it.
                peers_finished.arrive();
                return std::mem::forget(group);
            }
            let message = format!(
                "rank {me}: rank {peer} {why} before finishing: its process exited, was killed or lost the network. \
                 Stopping this rank too; its error (if any) is in rank {peer}'s output. Resume from the last checkpoint with --resume"
            );
            eprintln!("error: {message}");
            let _ = std::io::stderr().flush();
            // NCCL's abort ends this rank's calls that wait for the dead one; the process ends
            // after it, or after ABORT_WAIT if the abort itself does not return.
            let (done, aborted) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                group.abort(&message);
                let _ = done.send(());
            });
            let _ = aborted.recv_timeout(ABORT_WAIT);
            // SAFETY: ends the process at once, as a fatal error; nothing is expected to run after.
            unsafe { libc::_exit(1) };
        })
        .expect("a thread can be started");
}
