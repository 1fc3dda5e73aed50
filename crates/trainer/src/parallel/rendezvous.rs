//! The TCP rendezvous of a run of several processes: rank 0 listens at `MASTER_ADDR:MASTER_PORT`,
//! every other rank connects and says who it is (its rank, the world's size and a fingerprint of
//! its run: the resolved config's hash). Once every rank has arrived and all agree, rank 0 hands
//! each the same payload (NCCL's unique id: the communicator is NCCL's own, the rendezvous only
//! carries its 128 bytes). A rank that disagrees, arrives twice or never arrives ends the
//! rendezvous on every rank with an error that names it, instead of a hang in NCCL's init.
//!
//! The connections stay open after the rendezvous ([`Joined::links`]): a process that dies closes
//! its end, which the others can watch.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::place::Place;

/// The first bytes of every hello: the protocol and its version.
const MAGIC: [u8; 8] = *b"BMXRDV01";
/// magic, rank (u32), world size (u32), fingerprint (u64), little-endian.
const HELLO_BYTES: usize = 8 + 4 + 4 + 8;
/// The longest answer accepted (a payload or an error message).
const MAX_ANSWER: u32 = 1 << 20;

/// What a rank brings to the rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hello {
    rank: u32,
    world_size: u32,
    fingerprint: u64,
}

impl Hello {
    fn encode(self) -> [u8; HELLO_BYTES] {
        let mut b = [0u8; HELLO_BYTES];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[12..16].copy_from_slice(&self.world_size.to_le_bytes());
        b[16..].copy_from_slice(&self.fingerprint.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_BYTES]) -> Option<Hello> {
        (b[..8] == MAGIC).then(|| Hello {
            rank: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            world_size: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
            fingerprint: u64::from_le_bytes(b[16..].try_into().expect("8 bytes")),
        })
    }
}

/// A finished rendezvous.
#[derive(Debug)]
pub struct Joined {
    /// What rank 0 handed out, the same on every rank.
    pub payload: Vec<u8>,
    /// Rank 0: one connection per other rank, in rank order (1, 2, ...). Other ranks: the one
    /// connection to rank 0.
    pub links: Vec<TcpStream>,
}

/// Meets the other ranks of `place`'s run. `fingerprint` must be the same on every rank (the
/// run's config hash); `payload` is called once, on rank 0, after every rank has arrived. Gives
/// up after `timeout` with an error that names the ranks missing (rank 0) or the address that
/// could not be reached (the other ranks).
pub fn rendezvous(
    place: &Place,
    fingerprint: u64,
    payload: impl FnOnce() -> Result<Vec<u8>>,
    timeout: Duration,
) -> Result<Joined> {
    let deadline = Instant::now() + timeout;
    let me = Hello {
        rank: place.rank as u32,
        world_size: place.world_size as u32,
        fingerprint,
    };
    if place.rank == 0 {
        host(place, me, payload, deadline)
    } else {
        join(place, me, deadline)
    }
}

/// Rank 0: listens until every other rank has said hello, checks them, answers each.
fn host(
    place: &Place,
    me: Hello,
    payload: impl FnOnce() -> Result<Vec<u8>>,
    deadline: Instant,
) -> Result<Joined> {
    let at = format!("{}:{}", place.master_addr, place.master_port);
    // Rank 0 listens on every interface at the port: MASTER_ADDR is how the others reach it.
    let listener = TcpListener::bind(("0.0.0.0", place.master_port)).with_context(|| {
        format!(
            "rank 0 could not listen on port {} for the rendezvous (MASTER_PORT): is another \
             run using it?",
            place.master_port
        )
    })?;
    listener.set_nonblocking(true)?;
    let others = place.world_size - 1;
    let mut arrived: Vec<Option<TcpStream>> = (0..others).map(|_| None).collect();
    let mut waiting = others;
    while waiting > 0 {
        let (mut stream, from) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = arrived
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.is_none())
                        .map(|(i, _)| (i + 1).to_string())
                        .collect();
                    let e = anyhow!(
                        "rendezvous at {at}: rank(s) {} of {} did not arrive in time; check \
                         that every process started and has MASTER_ADDR={} and MASTER_PORT={}",
                        missing.join(", "),
                        place.world_size,
                        place.master_addr,
                        place.master_port
                    );
                    refuse_all(arrived.iter_mut().flatten(), &format!("{e}"));
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e).context(format!("rendezvous at {at}: accepting a rank")),
        };
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(remaining(deadline)))?;
        let mut b = [0u8; HELLO_BYTES];
        if stream.read_exact(&mut b).is_err() {
            // Not one of ours (a port scan, a stray connection): ignored.
            continue;
        }
        let Some(h) = Hello::decode(&b) else {
            continue;
        };
        let problem = if h.world_size != me.world_size {
            Some(format!(
                "rank {} says the world has {} processes, rank 0 says {}",
                h.rank, h.world_size, me.world_size
            ))
        } else if h.rank == 0 || h.rank >= me.world_size {
            Some(format!(
                "a process from {from} says it is rank {}, which is not among 1..{}",
                h.rank, me.world_size
            ))
        } else if arrived[h.rank as usize - 1].is_some() {
            Some(format!(
                "two processes say they are rank {} (the second from {from})",
                h.rank
            ))
        } else if h.fingerprint != me.fingerprint {
            Some(format!(
                "rank {} runs another config than rank 0 (fingerprint {:016x}, rank 0's \
                 {:016x}): every process must train the same config",
                h.rank, h.fingerprint, me.fingerprint
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            let e = anyhow!("rendezvous at {at}: {p}");
            let _ = answer(&mut stream, false, format!("{e}").as_bytes());
            refuse_all(arrived.iter_mut().flatten(), &format!("{e}"));
            return Err(e);
        }
        arrived[h.rank as usize - 1] = Some(stream);
        waiting -= 1;
    }
    let mut links: Vec<TcpStream> = arrived.into_iter().flatten().collect();
    let bytes = match payload() {
        Ok(b) => b,
        Err(e) => {
            let e = e.context(format!("rendezvous at {at}: rank 0 making the payload"));
            refuse_all(links.iter_mut(), &format!("{e:#}"));
            return Err(e);
        }
    };
    for (i, s) in links.iter_mut().enumerate() {
        answer(s, true, &bytes)
            .with_context(|| format!("rendezvous at {at}: answering rank {}", i + 1))?;
    }
    Ok(Joined {
        payload: bytes,
        links,
    })
}

/// Another rank: connects to rank 0 (retrying until it listens), says hello, reads the answer.
fn join(place: &Place, me: Hello, deadline: Instant) -> Result<Joined> {
    let at = format!("{}:{}", place.master_addr, place.master_port);
    let addrs: Vec<SocketAddr> = (place.master_addr.as_str(), place.master_port)
        .to_socket_addrs()
        .with_context(|| format!("rank {}: MASTER_ADDR {at} does not resolve", me.rank))?
        .collect();
    let mut stream = loop {
        let tried = addrs.iter().find_map(|a| {
            TcpStream::connect_timeout(a, remaining(deadline).min(Duration::from_secs(5))).ok()
        });
        if let Some(s) = tried {
            break s;
        }
        if Instant::now() >= deadline {
            bail!(
                "rank {}: rank 0's rendezvous at {at} did not answer in time; check that rank 0 \
                 started and that MASTER_ADDR and MASTER_PORT name its host and a port it can open",
                me.rank
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    stream.set_nodelay(true)?;
    stream.write_all(&me.encode())?;
    // Rank 0 answers once the last rank has arrived.
    stream.set_read_timeout(Some(remaining(deadline)))?;
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).map_err(|e| {
        anyhow!(
            "rank {}: no answer from rank 0's rendezvous at {at} ({e}): rank 0 stopped, or \
             some rank did not arrive in time",
            me.rank
        )
    })?;
    let len = u32::from_le_bytes(head[1..].try_into().expect("4 bytes"));
    if len > MAX_ANSWER {
        bail!("rank {}: a malformed answer from {at}", me.rank);
    }
    let mut body = vec![0u8; len as usize];
    stream
        .read_exact(&mut body)
        .with_context(|| format!("rank {}: reading rank 0's answer from {at}", me.rank))?;
    if head[0] != 1 {
        bail!(
            "rank {}: rank 0 ended the rendezvous: {}",
            me.rank,
            String::from_utf8_lossy(&body)
        );
    }
    stream.set_read_timeout(None)?;
    Ok(Joined {
        payload: body,
        links: vec![stream],
    })
}

/// Writes an answer: ok (1) or refused (0), the length, the bytes.
fn answer(stream: &mut TcpStream, ok: bool, bytes: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 5];
    head[0] = u8::from(ok);
    head[1..].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
    stream.write_all(&head)?;
    stream.write_all(bytes)
}

/// Tells every rank that arrived that the rendezvous failed, and why.
fn refuse_all<'a>(arrived: impl Iterator<Item = &'a mut TcpStream>, why: &str) {
    for s in arrived {
        let _ = answer(s, false, why.as_bytes());
    }
}

/// Time left before `deadline` (at least a millisecond: a zero timeout means none to std).
fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    /// A port free a moment ago.
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn place(rank: usize, world_size: usize, port: u16) -> Place {
        Place {
            rank,
            world_size,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    /// Runs a rendezvous of `world_size` ranks in threads; rank r brings `fingerprint(r)`; the
    /// ranks in `absent` never come.
    fn meet(
        world_size: usize,
        fingerprint: impl Fn(usize) -> u64,
        absent: &[usize],
        timeout: Duration,
    ) -> Vec<Result<Joined>> {
        let port = free_port();
        let handles: Vec<_> = (0..world_size)
            .filter(|r| !absent.contains(r))
            .map(|r| {
                let f = fingerprint(r);
                thread::spawn(move || {
                    rendezvous(
                        &place(r, world_size, port),
                        f,
                        || Ok((0u8..128).collect()),
                        timeout,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_rank_zeros_payload() {
        let joined = meet(4, |_| 7, &[], Duration::from_secs(20));
        let expected: Vec<u8> = (0u8..128).collect();
        for (r, j) in joined.iter().enumerate() {
            let j = j.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e:#}"));
            assert_eq!(j.payload, expected);
            assert_eq!(j.links.len(), if r == 0 { 3 } else { 1 });
        }
    }

    #[test]
    fn a_rank_with_another_config_ends_it_on_every_rank() {
        let joined = meet(
            3,
            |r| if r == 2 { 8 } else { 7 },
            &[],
            Duration::from_secs(5),
        );
        let rank0 = format!("{:#}", joined[0].as_ref().unwrap_err());
        assert!(rank0.contains("rank 2 runs another config"), "{rank0}");
        let rank2 = format!("{:#}", joined[2].as_ref().unwrap_err());
        assert!(rank2.contains("rank 0 ended the rendezvous"), "{rank2}");
        // Rank 1 hears the same when it arrived first, else finds no rendezvous: an error either way.
        assert!(joined[1].is_err());
    }

    #[test]
    fn a_rank_that_never_comes_is_named() {
        let joined = meet(3, |_| 7, &[1], Duration::from_secs(2));
        let rank0 = format!("{:#}", joined[0].as_ref().unwrap_err());
        assert!(rank0.contains("rank(s) 1 of 3 did not arrive"), "{rank0}");
        let rank2 = format!("{:#}", joined[1].as_ref().unwrap_err());
        assert!(rank2.contains("rank 2"), "{rank2}");
    }

    #[test]
    fn no_rank_zero_is_a_clear_error() {
        let joined = meet(2, |_| 7, &[0], Duration::from_millis(500));
        let e = format!("{:#}", joined[0].as_ref().unwrap_err());
        assert!(
            e.contains("rank 1: rank 0's rendezvous at 127.0.0.1"),
            "{e}"
        );
    }
}
