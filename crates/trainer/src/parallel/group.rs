//! The ranks a run trains on, as the step sees them, for any world size: rank 0 on the calling
//! thread and, in a data-parallel run, ranks 1.. in threads of their own ([`Ranks`]). One device
//! is a group of one: it starts no thread and no watchdog, calls no collective, and every method
//! below that involves the other ranks does nothing for it.

use std::time::Duration;

use model::Gpt;

use super::ranks::Ranks;
use super::watchdog::Watch;
use super::zero::Shard;
use crate::optim::AdamW;
use crate::step::{Plan, Rank, StepCtx};

pub(crate) struct Group<B: crate::TrainBackend> {
    /// Rank 0's device.
    pub device: B::Device,
    /// Ranks 1.. of a data-parallel run; `None` for a group of one.
    others: Option<Ranks<B>>,
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
        };
        (group, model)
    }

    /// Ranks 1.. of a data-parallel run (`None` for a group of one), for what only such a run
    /// reports.
    pub fn data_parallel(&self) -> Option<&Ranks<B>> {
        self.others.as_ref()
    }

    /// How many devices train.
    pub fn size(&self) -> usize {
        self.others.as_ref().map_or(1, |r| r.gpus.len())
    }

    /// Rank 0, on the calling thread.
    pub fn rank0(&self) -> Rank<'_, B> {
        match &self.others {
            None => Rank {
                device: &self.device,
                of: None,
            },
            Some(r) => Rank {
                device: &r.devices[0],
                of: Some((0, &r.ids[..])),
            },
        }
    }

    /// ZeRO-1: rank 0's share.
    pub fn zero(&self) -> Option<&Shard> {
        self.others.as_ref()?.zero.as_ref().map(|z| &z.0)
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

    /// The CRC-32 of every rank's weights, rank 0 first (none for a group of one).
    pub fn checksums(&self, model: &Gpt<B>, opt: &AdamW<B::InnerBackend>) -> Vec<u32> {
        self.others
            .as_ref()
            .map(|r| r.checksums(model, opt))
            .unwrap_or_default()
    }

    /// ZeRO-1: the whole model and optimizer state on rank 0, for a checkpoint (`None` without
    /// ZeRO: rank 0 holds them).
    pub fn gather(
        &self,
        model: &Gpt<B>,
        opt: &AdamW<B::InnerBackend>,
    ) -> Option<(Gpt<B>, AdamW<B::InnerBackend>)> {
        self.others.as_ref().and_then(|r| r.gather(model, opt))
    }
}
