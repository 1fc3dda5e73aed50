//! Where this process stands in a run of several processes: its rank among all of them, their
//! number, its GPU on its node and the address of rank 0's rendezvous. Read from the variables
//! that torchrun and most cluster launchers set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), with SLURM's own (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`) where torchrun's are absent, so that a job script starts `train` unchanged.

use anyhow::{bail, Context, Result};

/// torchrun's default rendezvous port.
pub const DEFAULT_PORT: u16 = 29500;

/// One process's place in a run of several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// How many processes train together (one per GPU).
    pub world_size: usize,
    /// The GPU of this process on its node.
    pub local_rank: usize,
    /// Rank 0's host, where the rendezvous listens.
    pub master_addr: String,
    pub master_port: u16,
}

impl Place {
    /// The place that the process environment gives, or `None` when it names no world (neither
    /// `WORLD_SIZE` nor `SLURM_NTASKS` is set): a run of one process.
    pub fn from_env() -> Result<Option<Place>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Place::from_env`] with the variables read through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Place>> {
        // torchrun's variable, else SLURM's: (name read, value).
        let either = |ours: &'static str, slurm: &'static str| {
            var(ours)
                .map(|v| (ours, v))
                .or_else(|| var(slurm).map(|v| (slurm, v)))
        };
        let Some(world) = either("WORLD_SIZE", "SLURM_NTASKS") else {
            return Ok(None);
        };
        let world_size = count(&world)?;
        if world_size == 0 {
            bail!("{} = 0: a run needs at least one process", world.0);
        }
        let Some(rank) = either("RANK", "SLURM_PROCID") else {
            bail!(
                "{} = {world_size} is set but RANK is not: every process of a run of several \
                 needs its rank (0..{world_size}), as torchrun sets it",
                world.0
            );
        };
        let rank_value = count(&rank)?;
        if rank_value >= world_size {
            bail!(
                "{} = {rank_value} is not below {} = {world_size}: ranks are 0..{world_size}",
                rank.0,
                world.0
            );
        }
        let local_rank = match either("LOCAL_RANK", "SLURM_LOCALID") {
            Some(v) => count(&v)?,
            // One node: the rank is the GPU.
            None if world_size == 1 => 0,
            None => bail!(
                "{} = {world_size} is set but LOCAL_RANK is not: each process needs the index \
                 of its GPU on its node (torchrun sets LOCAL_RANK; under SLURM, SLURM_LOCALID)",
                world.0
            ),
        };
        let master_addr = match var("MASTER_ADDR") {
            Some(a) if a.trim().is_empty() => bail!("MASTER_ADDR is set but empty"),
            Some(a) => a.trim().to_string(),
            None if world_size == 1 => "127.0.0.1".into(),
            None => bail!(
                "{} = {world_size} is set but MASTER_ADDR is not: every process needs the host \
                 of rank 0, where the rendezvous listens",
                world.0
            ),
        };
        let master_port = match var("MASTER_PORT") {
            None => DEFAULT_PORT,
            Some(p) => match p.trim().parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => bail!("MASTER_PORT = {p:?} is not a port number (1..65535)"),
            },
        };
        Ok(Some(Place {
            rank: rank_value,
            world_size,
            local_rank,
            master_addr,
            master_port,
        }))
    }
}

/// A variable's value as a count, or an error naming the variable.
fn count((name, value): &(&str, String)) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .with_context(|| format!("{name} = {value:?} is not a whole number"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn place(vars: &[(&str, &str)]) -> Result<Option<Place>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Place::from_vars(|name| map.get(name).cloned())
    }

    #[test]
    fn no_world_is_one_process() {
        assert_eq!(place(&[("RANK", "0")]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_give_the_place() {
        let p = place(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node-0"),
            ("MASTER_PORT", "12345"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            p,
            Place {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                master_addr: "node-0".into(),
                master_port: 12345,
            }
        );
    }

    #[test]
    fn slurm_variables_stand_in_for_torchruns() {
        let p = place(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((p.rank, p.world_size, p.local_rank), (3, 4, 3));
        assert_eq!(p.master_port, DEFAULT_PORT);
    }

    #[test]
    fn bad_places_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("WORLD_SIZE", "4")], "RANK is not"),
            (
                &[("WORLD_SIZE", "4"), ("RANK", "4")],
                "RANK = 4 is not below WORLD_SIZE = 4",
            ),
            (
                &[("WORLD_SIZE", "two"), ("RANK", "0")],
                "WORLD_SIZE = \"two\"",
            ),
            (&[("WORLD_SIZE", "0"), ("RANK", "0")], "WORLD_SIZE = 0"),
            (&[("WORLD_SIZE", "2"), ("RANK", "1")], "LOCAL_RANK is not"),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")],
                "MASTER_ADDR is not",
            ),
            (
                &[
                    ("WORLD_SIZE", "2"),
                    ("RANK", "1"),
                    ("LOCAL_RANK", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT = \"70000\"",
            ),
        ];
        for (vars, expected) in cases {
            let e = format!("{:#}", place(vars).unwrap_err());
            assert!(e.contains(expected), "{vars:?}: {e}");
        }
    }
}
