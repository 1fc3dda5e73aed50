//! `train --nproc-per-node N`: starts this node's processes of a run of one process per GPU, each
//! with torchrun's variables (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), and supervises them. The first process that fails ends the
//! others (SIGTERM, then SIGKILL after a grace period) and the launcher's error names it. The
//! processes run in a process group of their own, so a terminal's Ctrl-C reaches the launcher
//! only; SIGINT or SIGTERM to the launcher is passed on to every process once per signal (the
//! first asks them to stop at the next step with a checkpoint, a second ends them at once; see
//! `crate::stop`).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::place::DEFAULT_PORT;

/// How long the other processes get to exit after SIGTERM before they are killed.
pub const GRACE: Duration = Duration::from_secs(15);

/// One node's part of a run of processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Processes (GPUs) on this node.
    pub nproc_per_node: usize,
    /// Nodes in the run.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`; node 0 holds rank 0.
    pub node_rank: usize,
    /// Rank 0's host (node 0's address, reachable from every node).
    pub master_addr: String,
    pub master_port: u16,
}

impl Launch {
    /// A single node's run of `nproc_per_node` processes, its rendezvous on this host.
    pub fn single_node(nproc_per_node: usize) -> Self {
        Launch {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_PORT,
        }
    }

    /// Checks the numbers, naming the flag at fault.
    pub fn check(&self) -> Result<()> {
        if self.nproc_per_node == 0 {
            bail!("--nproc-per-node 0: a node needs at least one process (one per GPU)");
        }
        if self.nnodes == 0 {
            bail!("--nnodes 0: a run needs at least one node");
        }
        if self.node_rank >= self.nnodes {
            bail!(
                "--node-rank {} is not a node of --nnodes {} (valid: 0..{})",
                self.node_rank,
                self.nnodes,
                self.nnodes
            );
        }
        if self.master_addr.is_empty() {
            bail!("--master-addr is empty: give rank 0's host (node 0's address)");
        }
        Ok(())
    }

    /// The variables of this node's process `local` (`0..nproc_per_node`).
    pub fn variables(&self, local: usize) -> Vec<(&'static str, String)> {
        vec![
            (
                "RANK",
                (self.node_rank * self.nproc_per_node + local).to_string(),
            ),
            ("LOCAL_RANK", local.to_string()),
            (
                "WORLD_SIZE",
                (self.nnodes * self.nproc_per_node).to_string(),
            ),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

/// The signal the launcher received (0: none), passed on to the processes.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Starts `program` with `args` once per process of `launch`'s node and waits for them all. Ok
/// when every one exited with status 0; otherwise the error names the first that failed (its
/// rank and how it ended), after the others were ended.
pub fn run(program: &Path, args: &[OsString], launch: &Launch) -> Result<()> {
    launch.check()?;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..launch.nproc_per_node {
        let vars = launch.variables(local);
        let rank: usize = vars[0].1.parse().expect("a number");
        let spawned = Command::new(program)
            .args(args)
            .envs(vars)
            .process_group(0)
            .spawn();
        match spawned {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                end_all(&mut children, libc::SIGTERM);
                return Err(e).with_context(|| {
                    format!("could not start rank {rank} ({})", program.display())
                });
            }
        }
    }
    supervise(children)
}

/// Waits for every child; the first failure (or a signal to the launcher) ends the others.
fn supervise(mut children: Vec<(usize, Child)>) -> Result<()> {
    let mut failed: Option<(usize, ExitStatus)> = None;
    let mut running: Vec<bool> = vec![true; children.len()];
    loop {
        let signal = RECEIVED.swap(0, Ordering::SeqCst);
        if signal != 0 {
            for (_, c) in &children {
                // SAFETY: `c` is a child this process started and has not reaped.
                unsafe { libc::kill(c.id() as libc::pid_t, signal) };
            }
        }
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            if let Some(status) = child.try_wait().context("waiting for a rank's process")? {
                running[i] = false;
                if !status.success() && failed.is_none() {
                    failed = Some((*rank, status));
                }
            }
        }
        if !running.contains(&true) {
            break;
        }
        if failed.is_some() {
            let alive: Vec<(usize, Child)> = children
                .into_iter()
                .zip(&running)
                .filter(|(_, r)| **r)
                .map(|(c, _)| c)
                .collect();
            children = alive;
            end_all(&mut children, libc::SIGTERM);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    match failed {
        None => Ok(()),
        Some((rank, status)) => bail!(
            "rank {rank} {}; the other processes of this node were stopped",
            describe(status)
        ),
    }
}

/// Sends `signal` to every child, then kills those still running after [`GRACE`], and reaps them.
fn end_all(children: &mut [(usize, Child)], signal: libc::c_int) {
    for (_, c) in children.iter() {
        // SAFETY: `c` is a child this process started and has not reaped.
        unsafe { libc::kill(c.id() as libc::pid_t, signal) };
    }
    let deadline = Instant::now() + GRACE;
    for (_, c) in children.iter_mut() {
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// How a process ended, in words.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => format!("ended ({status})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> (std::path::PathBuf, Vec<OsString>) {
        ("sh".into(), vec!["-c".into(), script.into()])
    }

    #[test]
    fn variables_follow_torchrun() {
        let l = Launch {
            nproc_per_node: 4,
            nnodes: 2,
            node_rank: 1,
            master_addr: "node0".into(),
            master_port: 1234,
        };
        let v = l.variables(3);
        assert_eq!(
            v,
            vec![
                ("RANK", "7".to_string()),
                ("LOCAL_RANK", "3".to_string()),
                ("WORLD_SIZE", "8".to_string()),
                ("LOCAL_WORLD_SIZE", "4".to_string()),
                ("MASTER_ADDR", "node0".to_string()),
                ("MASTER_PORT", "1234".to_string()),
            ]
        );
        // Each process reads its place back from them.
        let place = crate::parallel::place::Place::from_vars(|name| {
            v.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
        })
        .unwrap()
        .unwrap();
        assert_eq!((place.rank, place.world_size, place.local_rank), (7, 8, 3));
    }

    #[test]
    fn bad_numbers_name_the_flag() {
        let mut l = Launch::single_node(0);
        assert!(l
            .check()
            .unwrap_err()
            .to_string()
            .contains("--nproc-per-node"));
        l.nproc_per_node = 2;
        l.node_rank = 1;
        assert!(l.check().unwrap_err().to_string().contains("--node-rank 1"));
    }

    #[test]
    fn every_process_runs_with_its_rank() {
        let dir = std::env::temp_dir().join(format!("burnmix-launch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (program, args) = sh(&format!(
            "echo $RANK $LOCAL_RANK $WORLD_SIZE > {}/rank$RANK",
            dir.display()
        ));
        run(&program, &args, &Launch::single_node(3)).unwrap();
        for r in 0..3 {
            let got = std::fs::read_to_string(dir.join(format!("rank{r}"))).unwrap();
            assert_eq!(got.trim(), format!("{r} {r} 3"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failing_process_ends_the_others_and_is_named() {
        // Rank 1 fails at once; rank 0 would run for a minute.
        let (program, args) = sh("if [ $RANK = 1 ]; then exit 3; fi; sleep 60");
        let t = Instant::now();
        let err = run(&program, &args, &Launch::single_node(2)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("rank 1 exited with status 3"), "{msg}");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "took {:?}",
            t.elapsed()
        );
    }
}
