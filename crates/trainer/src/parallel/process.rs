//! A process's membership of a run of one process per GPU: the rendezvous ([`super::rendezvous`])
//! hands every rank rank 0's NCCL unique id, which joins them in one communicator
//! (`kernels::collective`); the rendezvous connections then stay open as the run's fault line. A
//! rank that finishes says so on them; a connection that closes without that means the rank at
//! the other end died, and this rank stops within a second with an error that names it, instead
//! of waiting in NCCL for a peer that will never come.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use kernels::collective::{CollectiveBackend, ProcessGroup};

use super::place::Place;
use super::rendezvous::rendezvous;

/// How long the rendezvous waits for every rank to arrive (a node can be slow to start).
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a rank whose peer died waits for NCCL's abort before it exits anyway.
const ABORT_WAIT: Duration = Duration::from_secs(10);

/// The byte a rank sends on its rendezvous connections when it finished its part normally.
const FINISHED: u8 = b'F';

/// This process's membership of a run of processes.
pub struct Membership {
    pub group: ProcessGroup,
    /// The rendezvous connections (rank 0: one per other rank; others: the one to rank 0), each
    /// with the rank at its other end.
    links: Vec<(usize, TcpStream)>,
    /// Set once this rank has finished: connections closing after that are expected.
    finished: Arc<AtomicBool>,
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
    for (peer, link) in &links {
        let link = link
            .try_clone()
            .context("a rendezvous connection could not be watched")?;
        watch(place.rank, *peer, link, group.clone(), finished.clone());
    }
    Ok(Membership {
        group,
        links,
        finished,
    })
}

impl Membership {
    /// This rank finished its part of the run normally: tells the ranks at the other ends, whose
    /// watch then lets this process exit.
    pub fn finish(mut self) {
        self.finished.store(true, Ordering::SeqCst);
        for (_, link) in &mut self.links {
            let _ = link.write_all(&[FINISHED]);
            let _ = link.flush();
        }
    }
}

/// Watches the connection to rank `peer` in a thread of its own: if it closes before `peer` said
/// it finished, and before this rank finished, this rank aborts its communicator and exits with
/// an error naming `peer` (without running exit handlers: a thread may be waiting in NCCL or on
/// the GPU for the dead rank's share).
fn watch(
    me: usize,
    peer: usize,
    mut link: TcpStream,
    group: ProcessGroup,
    finished: Arc<AtomicBool>,
) {
    let _ = link.set_read_timeout(None);
    std::thread::Builder::new()
        .name(format!("rank {peer} watch"))
        .spawn(move || {
            let mut byte = [0u8; 1];
            let why = match link.read(&mut byte) {
                // The group is left to the process's exit: dropping the last clone here would
                // tear NCCL down while the main thread may be exiting.
                Ok(1) if byte[0] == FINISHED => return std::mem::forget(group),
                Ok(0) => "closed its connection".to_string(),
                Ok(_) => format!("sent an unexpected byte {:#04x}", byte[0]),
                Err(e) => format!("its connection failed ({e})"),
            };
            if finished.load(Ordering::SeqCst) {
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
