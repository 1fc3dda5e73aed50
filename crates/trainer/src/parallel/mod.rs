//! Data parallelism: one replica of the model per GPU, each on its own part of every batch, their
//! gradients averaged through NCCL before every rank applies the same update. The ranks are
//! threads of one process (`training.devices`, Burn's collectives) or one process per GPU (on
//! one node or many: `train --nproc-per-node`, torchrun's or SLURM's variables; the collectives
//! of `kernels::collective`). One device is a group of one: the same step, with no thread, no
//! watchdog and no collective.
//!
//! - [`group`]: the ranks a run trains on, of any size, as the step sees them.
//! - [`ranks`]: ranks 1.. of a data-parallel run, each in a thread of its own.
//! - [`collective`]: batch rows, the collectives, the weights checksum, the pre-run checks.
//! - [`zero`]: ZeRO-1 and ZeRO-2, each rank keeping the optimizer state (and under ZeRO-2 the
//!   averaged gradients) of its share of the parameters.
//! - [`fsdp`]: ZeRO-3, each rank keeping a share of the rows of every parameter, a block's
//!   parameters gathered just before it runs.
//! - [`overlap`]: between processes, gradients averaged in buckets while the backward runs.
//! - [`watchdog`]: turns a rank stuck in NCCL into an error.
//! - [`place`]: a process's rank, world size, GPU and rendezvous address, from torchrun's (or
//!   SLURM's) variables, for runs of one process per GPU.
//! - [`rendezvous`]: the TCP rendezvous in which rank 0 hands every process the same bytes
//!   (NCCL's unique id), with errors that name a missing or mismatched rank.
//! - [`process`]: a process's membership of a run of processes: the communicator joined from
//!   that id, and the watch that stops every rank when one dies.
//! - [`launch`]: `train --nproc-per-node N`, which starts and supervises the processes of one
//!   node.
//!
//! The step itself, the same for every world size, is `crate::step`.

pub mod collective;
pub mod fsdp;
pub(crate) mod group;
pub mod launch;
pub mod overlap;
pub mod place;
pub mod process;
pub(crate) mod ranks;
pub mod rendezvous;
pub mod watchdog;
pub mod zero;

pub use collective::{
    check_nccl, cuda_device_count, device_ids, mean_grads, reduce, rows, weights_checksum,
    Collective, Peers, ReduceOperation,
};
