//! The ranks a run trains on, as the step sees them, for any world size: rank 0 on the calling
//! thread and, in a data-parallel run of threads, ranks 1.. in threads of their own ([`Ranks`]);
//! or, in a run of one process per GPU, this process's rank and the NCCL communicator that joins
//! it to the others (each process's step is the same, so the methods that drive ranks 1.. do
//! nothing there). One device is a group of one: it starts no thread and no watchdog, calls no
//! collective, and every method below that involves the other ranks does nothing for it.

use std::sync::Arc;
use std::time::Duration;

use model::Gpt;

use burn::tensor::Tensor;
use kernels::collective::ProcessGroup;

use super::collective::{reduce, weights_checksum, Peers, ReduceOperation};
use super::fsdp::RowShards;
use super::ranks::Ranks;
use super::watchdog::Watch;
use super::zero::{self, Members, Shard, Split};
use crate::optim::AdamW;
use crate::step::{Plan, Rank, StepCtx};

pub(crate) struct Group<B: crate::TrainBackend> {
    /// Rank 0's device.
    pub device: B::Device,
    /// Ranks 1.. of a data-parallel run of threads; `None` otherwise.
    others: Option<Ranks<B>>,
    /// A run of processes: this process's membership (its rank is the group's).
    process: Option<ProcessGroup>,
    /// A run of processes under ZeRO: this rank's share, and how the parameters are split.
    process_zero: Option<(Shard, Split)>,
}

impl<B: crate::TrainBackend> Group<B> {
    /// The group of `devices` (each with its CUDA index, for messages), rank 0 first. With
    /// several, ranks 1.. start as copies of rank 0's `model` and optimizer state (`opt`), and
    /// under ZeRO-1 rank 0 then keeps its share of the state only: the model comes back.
    pub fn start(
        devices: Vec<(B::Device, usize)>,
        ctx: &StepCtx<'_>,
        opt: &mut AdamW<B::InnerBackend>,
        model: Gpt<B>,
    ) -> (Self, Gpt<B>) {
        let device = devices[0].0.clone();
        if devices.len() == 1 {
            return (
                Group {
                    device,
                    others: None,
                    process: None,
                    process_zero: None,
                },
                model,
            );
        }
        let (devices, gpus): (Vec<_>, Vec<_>) = devices.into_iter().unzip();
        let ranks = Ranks::start(ctx, opt, devices, gpus, &model);
        // ZeRO-1: rank 0 takes its share once every other rank has copied the whole state.
        let model = match &ranks.zero {
            Some((shard, _)) => shard.take_share::<B, _>(model, opt),
            None => model,
        };
        let group = Group {
            device,
            others: Some(ranks),
            process: None,
            process_zero: None,
        };
        (group, model)
    }

    /// This process's rank of a run of processes, on `device`, joined by `process`. Every rank
    /// starts from the same seed (or checkpoint), so the replicas start equal with nothing sent;
    /// under ZeRO each then keeps its share of the state only: the model comes back. Under ZeRO-3
    /// the model and the optimizer's moments come already cut to the rows of `row_split`.
    pub fn start_process(
        device: B::Device,
        process: ProcessGroup,
        ctx: &StepCtx<'_>,
        opt: &mut AdamW<B::InnerBackend>,
        (model, row_split): (Gpt<B>, Option<Arc<RowShards>>),
    ) -> (Self, Gpt<B>) {
        let stage = ctx.cfg.training.zero;
        assert_eq!(
            stage == 3,
            row_split.is_some(),
            "ZeRO-3 runs on a row split"
        );
        let process_zero = (stage > 0).then(|| {
            let params = zero::parameters(&model);
            let shard = if let Some(rows) = row_split {
                Shard::rows(rows, process.clone())
            } else {
                let copy = crate::step::copied_weights(&model, ctx.compute_dtype);
                let members = Members::Processes(process.clone());
                Shard::new(&params, process.rank(), members, copy, stage)
            };
            let split = shard.split(&params);
            (shard, split)
        });
        let model = match &process_zero {
            Some((shard, _)) => shard.take_share::<B, _>(model, opt),
            None => model,
        };
        let group = Group {
            device,
            others: None,
            process: Some(process),
            process_zero,
        };
        (group, model)
    }

    /// This process's rank: 0 unless it is one of a run of processes.
    pub fn rank(&self) -> usize {
        self.process.as_ref().map_or(0, |p| p.rank())
    }

    /// Whether this rank writes the run's files (config, metrics, checkpoints, summary) and
    /// prints its progress: rank 0.
    pub fn writes(&self) -> bool {
        self.rank() == 0
    }

    /// A run of processes: the first error of the collectives (NCCL's, or an abort).
    pub fn check(&self) -> anyhow::Result<()> {
        match &self.process {
            Some(p) => p.check().map_err(|e| anyhow::anyhow!("{e}")),
            None => Ok(()),
        }
    }

    /// A run of processes: the communicator.
    pub fn process(&self) -> Option<&ProcessGroup> {
        self.process.as_ref()
    }

    /// Ranks 1.. of a data-parallel run (`None` for a group of one), for what only such a run
    /// reports.
    pub fn data_parallel(&self) -> Option<&Ranks<B>> {
        self.others.as_ref()
    }

    /// How many devices train.
    pub fn size(&self) -> usize {
        match (&self.others, &self.process) {
            (Some(r), _) => r.gpus.len(),
            (None, Some(p)) => p.world(),
            (None, None) => 1,
        }
    }

    /// The rank on the calling thread: rank 0 of a run of threads, this process's of a run of
    /// processes.
    pub fn rank0(&self) -> Rank<'_, B> {
        match &self.others {
            None => Rank {
                device: &self.device,
                of: self
                    .process
                    .as_ref()
                    .map(|p| (p.rank(), Peers::Processes(p))),
            },
            Some(r) => Rank {
                device: &r.devices[0],
                of: Some((0, Peers::Threads(&r.ids[..]))),
            },
        }
    }

    /// ZeRO: this rank's share (rank 0's in a run of threads), and how the parameters are split.
    pub fn zero_split(&self) -> Option<&(Shard, Split)> {
        match &self.others {
            Some(r) => r.zero.as_ref(),
            None => self.process_zero.as_ref(),
        }
    }

    /// ZeRO: this rank's share (rank 0's in a run of threads).
    pub fn zero(&self) -> Option<&Shard> {
        self.zero_split().map(|z| &z.0)
    }

    /// Step `plan.step` begins: ranks 1.. start their part, watched until the returned guard
    /// drops.
    pub fn begin(&self, plan: Plan) -> Option<Watch> {
        self.others.as_ref().map(|r| r.begin(plan))
    }

    /// Runs rank 0's part of the step (with other ranks, a panic in it ends the process).
    pub fn on_rank0<T>(&self, f: impl FnOnce() -> T) -> T {
        match &self.others {
            None => f(),
            Some(r) => r.on_rank0(f),
        }
    }

    /// Waits for ranks 1.. to finish their part; each one's reserved memory after it.
    pub fn wait(&self) -> Vec<u64> {
        self.others.as_ref().map_or_else(Vec::new, |r| r.wait())
    }

    /// Rank 0 finished its part (for the watchdog).
    pub fn rank0_finished(&self) {
        if let Some(r) = &self.others {
            r.rank0_finished();
        }
    }

    /// Applies the held update: rank 0's (`rank0`) and ranks 1..'s. Returns rank 0's result and
    /// each other rank's reserved memory after it.
    pub fn apply<T>(&self, plan: Plan, rank0: impl FnOnce() -> T) -> (T, Vec<u64>) {
        match &self.others {
            None => (rank0(), Vec::new()),
            Some(r) => r.apply(plan, rank0),
        }
    }

    /// Ranks 1.. drop the update they hold; each one's reserved memory after it.
    pub fn skip(&self) -> Vec<u64> {
        self.others.as_ref().map_or_else(Vec::new, |r| r.skip())
    }

    /// A step took `took` (the watchdog's limit follows the steps).
    pub fn timed(&self, took: Duration) {
        if let Some(r) = &self.others {
            r.timed(took);
        }
    }

    /// Every rank's reserved memory, rank 0 first, from ranks 1..'s answers (0: not reported).
    pub fn memory(&self, others: Vec<u64>) -> Vec<Option<u64>> {
        std::iter::once(B::memory_reserved(&self.device))
            .chain(others.into_iter().map(|m| (m > 0).then_some(m)))
            .collect()
    }

    /// The CRC-32 of every rank's weights, rank 0 first (none for a group of one, nor under
    /// ZeRO-3, whose ranks hold no replicas). Every rank of a run of processes calls it at the
    /// same step.
    pub fn checksums(&self, model: &Gpt<B>, opt: &AdamW<B::InnerBackend>) -> Vec<u32> {
        if self.zero().is_some_and(|z| z.stage == 3) {
            return Vec::new();
        }
        if let Some(p) = &self.process {
            let mine = match self.zero() {
                Some(shard) => shard.checksum::<B, _>(model, opt),
                None => weights_checksum::<B, _>(model),
            };
            return process_checksums::<B>(p, &self.device, mine);
        }
        self.others
            .as_ref()
            .map(|r| r.checksums(model, opt))
            .unwrap_or_default()
    }

    /// ZeRO between threads: the whole model and optimizer state on rank 0, for a checkpoint
    /// (`None` without ZeRO: rank 0 holds them). A run of processes under ZeRO writes a sharded
    /// checkpoint instead.
    pub fn gather(
        &self,
        model: &Gpt<B>,
        opt: &AdamW<B::InnerBackend>,
    ) -> Option<(Gpt<B>, AdamW<B::InnerBackend>)> {
        self.others.as_ref().and_then(|r| r.gather(model, opt))
    }

    /// The ranks that report `failed` (this one's), in order; every rank of a run of processes
    /// calls it at the same point (one all-reduce). Without other processes, this rank's alone.
    pub fn failed_ranks(&self, failed: bool) -> Vec<usize> {
        let Some(p) = &self.process else {
            return if failed { vec![0] } else { Vec::new() };
        };
        let flags = each_rank::<B>(p, &self.device, &[if failed { 1.0 } else { 0.0 }]);
        (0..p.world()).filter(|&r| flags[r][0] > 0.0).collect()
    }
}

/// Every process's `mine` (the same length on every rank), rank 0 first: each rank puts its
/// values in its own slots of a zero vector, and one all-reduce sum over the ranks holds them all.
fn each_rank<B: crate::TrainBackend>(
    process: &ProcessGroup,
    device: &B::Device,
    mine: &[f32],
) -> Vec<Vec<f32>> {
    let (rank, world, n) = (process.rank(), process.world(), mine.len());
    let mut slots = vec![0f32; n * world];
    slots[rank * n..(rank + 1) * n].copy_from_slice(mine);
    let all = Tensor::<B, 1>::from_floats(slots.as_slice(), device).inner();
    let all = reduce(all, ReduceOperation::Sum, Peers::Processes(process));
    let mut values = all.into_data().to_vec::<f32>().unwrap_or_default();
    values.resize(n * world, 0.0);
    values.chunks(n).map(<[f32]>::to_vec).collect()
}

/// Every process's weights checksum (this one's: `mine`), rank 0 first, as its two 16-bit halves
/// (exact in f32) through [`each_rank`].
fn process_checksums<B: crate::TrainBackend>(
    process: &ProcessGroup,
    device: &B::Device,
    mine: u32,
) -> Vec<u32> {
    let halves = [(mine >> 16) as f32, (mine & 0xffff) as f32];
    each_rank::<B>(process, device, &halves)
        .iter()
        .map(|h| ((h[0] as u32) << 16) | h[1] as u32)
        .collect()
}
