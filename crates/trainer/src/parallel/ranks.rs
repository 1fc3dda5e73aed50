//! Ranks 1.. of a data-parallel run, each with its GPU in a thread of its own for the whole run:
//! every step each runs its part ([`crate::step::RankStep`], the same as rank 0's on the
//! session's thread) on its own replica, then applies or drops the update it holds as the loss
//! scaler decides once, on rank 0, from the averaged gradients' norm, which every rank shares. A
//! failing or stuck rank ends the process with an error that names it.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

use burn_backend::DeviceId;
use model::Gpt;

use super::collective::{self as dp, Collective, Peers};
use super::watchdog::{self, Progress, Watch, Watchdog};
use super::zero::{self, Shard, Split};
use crate::numerics::Probes;
use crate::optim::AdamW;
use crate::step::{self, update, Held, Plan, Rank, RankStep, StepCtx};

/// The ranks of a data-parallel run beyond rank 0 (whose model and optimizer are the session's,
/// on the calling thread). Each runs in a thread of its own for the whole run, so that its work
/// always reaches the device from the same thread (CubeCL gives each thread its own stream).
pub(crate) struct Ranks<B: crate::TrainBackend> {
    /// Every rank's device, rank 0 first, and their ids as the collectives name them.
    pub devices: Vec<B::Device>,
    pub ids: Vec<DeviceId>,
    /// The CUDA index of every rank's GPU, for messages.
    pub gpus: Vec<usize>,
    /// Ranks 1..
    workers: Vec<Worker>,
    /// ZeRO-1: rank 0's share, and how the parameters are split over the ranks.
    pub zero: Option<(Shard, Split)>,
    /// Ends the run when a step (or the start, or a checkpoint's gathering) outlasts its limit:
    /// a failure inside CubeCL's device thread would otherwise leave the ranks waiting forever.
    watchdog: Arc<Watchdog>,
    /// `training.step_timeout_s` (0: automatic), the slowest step so far but the first (which
    /// compiles kernels), and the steps timed.
    timeout_s: u64,
    slowest: Cell<Option<Duration>>,
    steps: Cell<u64>,
}

/// What a rank's thread is asked to do.
enum Job {
    /// Its part of a step, up to the update (with `update_now`, including it).
    Step(Plan),
    /// The update held for the loss scaler's verdict.
    Apply { lr: f64, scale: f64 },
    /// ZeRO-1: its share of the masters and moments, to the host (for rank 0's checkpoint).
    Share,
    /// The held update was skipped.
    Skip,
    /// The CRC-32 of its weights.
    Checksum,
}

/// A rank's thread, and the channels to it.
struct Worker {
    /// Dropped first when the run ends, which ends the thread's loop.
    jobs: Option<Sender<Job>>,
    /// Each job's answer: the rank's reserved memory after it (bytes), or a checksum.
    done: Receiver<u64>,
    /// ZeRO-1: the rank's share of the state, for a checkpoint.
    shares: Receiver<Vec<zero::Owned>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<B: crate::TrainBackend> Drop for Ranks<B> {
    /// Ends every rank's thread and waits for it, so that its replica is freed before the run's
    /// devices are drained.
    fn drop(&mut self) {
        // An idle rank ends at once; one stuck in a collective would make the join wait forever.
        let _watch = self
            .watchdog
            .arm("the ranks' shutdown", Duration::from_secs(5 * 60));
        for w in &mut self.workers {
            w.jobs = None;
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl<B: crate::TrainBackend> Ranks<B> {
    /// Starts ranks 1.. of `devices` (rank 0's first; `gpus` their CUDA indices) as copies of
    /// rank 0's model (`model`) and optimizer state (`opt`), each running the steps `ctx` reads.
    pub fn start(
        ctx: &StepCtx<'_>,
        opt: &AdamW<B::InnerBackend>,
        devices: Vec<B::Device>,
        gpus: Vec<usize>,
        model: &Gpt<B>,
    ) -> Self {
        let ids = dp::device_ids::<B>(&devices);
        let timeout_s = ctx.cfg.training.step_timeout_s;
        let watched_gpus = gpus.clone();
        let watchdog = Arc::new(Watchdog::start(devices.len(), move |e| {
            eprintln!("{}", watchdog::message(&e, &watched_gpus));
            hard_exit()
        }));
        let dog = watchdog.clone();
        let watch = dog.arm("the replicas' start", watchdog::step_limit(timeout_s, None));
        // ZeRO-1: every rank's share of the parameters (the weights with a compute copy are
        // held in the compute dtype by their non-owners).
        let params = zero::parameters(model);
        let copy = step::copied_weights(model, ctx.compute_dtype);
        let shard = |rank: usize| {
            (ctx.cfg.training.zero > 0).then(|| {
                let members = zero::Members::Threads(ids.clone());
                Shard::new(&params, rank, members, copy.clone(), ctx.cfg.training.zero)
            })
        };
        let workers = (1..devices.len())
            .map(|rank| {
                // Rank 0's model and optimizer state, which the rank's thread copies to its GPU:
                // a rank allocates on its GPU from its own thread only, so the pool it reports
                // (CubeCL keeps one per thread's stream) holds all of its memory.
                let from = (model.clone(), opt.clone());
                let (jobs, rx) = channel();
                let (tx, done) = channel();
                let (share_tx, shares) = channel();
                let own = Own {
                    cfg: ctx.cfg.clone(),
                    data: ctx.data.clone(),
                    compute_dtype: ctx.compute_dtype,
                    gemm: ctx.gemm,
                    fp8_linear: ctx.fp8_linear,
                    // Its own: device buffers come with the first step, on the rank's device.
                    fp8_history: ctx.fp8_linear.and_then(|_| ctx.cfg.fp8.amax_history()),
                    ids: ids.clone(),
                    device: devices[rank].clone(),
                    zero: shard(rank),
                };
                let gpu = gpus[rank];
                let progress = watchdog.progress();
                let thread = std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn(move || {
                        as_rank(rank, gpu, || {
                            own.serve(rank, from, rx, (tx, share_tx), progress)
                        })
                    })
                    .expect("a thread for each rank");
                Worker {
                    jobs: Some(jobs),
                    done,
                    shares,
                    thread: Some(thread),
                }
            })
            .collect();
        let zero = shard(0).map(|s| {
            let split = s.split(&params);
            (s, split)
        });
        let ranks = Ranks {
            devices,
            ids,
            gpus,
            workers,
            zero,
            watchdog,
            timeout_s,
            slowest: Cell::new(None),
            steps: Cell::new(0),
        };
        ranks.wait();
        // The copies' sends read rank 0's buffers on its GPU's collective stream, which nothing
        // orders before rank 0's own later kernels: they wait for it from here on, so that a
        // buffer rank 0 frees (its ZeRO-1 share drops the rest of the state) is not reused while
        // a send still reads it.
        <B::InnerBackend as Collective>::sync(&model.wte.weight.val().inner().device());
        dog.progress().finished(0);
        drop(watch);
        ranks
    }

    /// How long a step may take (see [`watchdog::step_limit`]).
    fn limit(&self) -> Duration {
        watchdog::step_limit(self.timeout_s, self.slowest.get())
    }

    /// Sends `job` to every rank of 1.. (see [`Ranks::wait`]).
    fn send(&self, job: impl Fn() -> Job) {
        for (w, rank) in self.workers.iter().zip(1..) {
            let sent = w.jobs.as_ref().is_some_and(|j| j.send(job()).is_ok());
            if !sent {
                rank_gone(rank, self.gpus[rank]);
            }
        }
    }

    /// Each rank's answer to the last job.
    pub fn wait(&self) -> Vec<u64> {
        self.workers
            .iter()
            .zip(1..)
            .map(|(w, rank)| {
                w.done
                    .recv()
                    .unwrap_or_else(|_| rank_gone(rank, self.gpus[rank]))
            })
            .collect()
    }

    /// Step `plan.step` begins: ranks 1.. start their part, and the watchdog watches the step
    /// until the returned guard drops.
    pub fn begin(&self, plan: Plan) -> Watch {
        let watch = self
            .watchdog
            .arm(format!("step {}", plan.step + 1), self.limit());
        self.send(|| Job::Step(plan));
        watch
    }

    /// Runs rank 0's part of the step: a panic ends the process, as the other ranks may be
    /// waiting for it inside NCCL (see [`rank_failed`]).
    pub fn on_rank0<T>(&self, f: impl FnOnce() -> T) -> T {
        as_rank(0, self.gpus[0], f)
    }

    /// Rank 0 finished its part of the armed work.
    pub fn rank0_finished(&self) {
        self.watchdog.progress().finished(0);
    }

    /// The update is the step's second part (with ZeRO-1, its own collectives): ranks 1.. apply
    /// the update they hold while rank 0 applies its own (`rank0`). Returns rank 0's result and
    /// each other rank's reserved memory after it.
    pub fn apply<T>(&self, plan: Plan, rank0: impl FnOnce() -> T) -> (T, Vec<u64>) {
        self.watchdog.reset_progress();
        let (lr, scale) = (plan.lr, plan.scale);
        self.send(|| Job::Apply { lr, scale });
        let out = rank0();
        self.watchdog.progress().finished(0);
        (out, self.wait())
    }

    /// The loss scaler skipped the step: ranks 1.. drop the update they hold. Returns each other
    /// rank's reserved memory after it.
    pub fn skip(&self) -> Vec<u64> {
        self.watchdog.reset_progress();
        self.watchdog.progress().finished(0);
        self.send(|| Job::Skip);
        self.wait()
    }

    /// A step took `took`; the first compiles the kernels, so the limit follows the steps after
    /// it.
    pub fn timed(&self, took: Duration) {
        if self.steps.replace(self.steps.get() + 1) > 0 {
            self.slowest
                .set(Some(self.slowest.get().map_or(took, |s| s.max(took))));
        }
    }

    /// The CRC-32 of every rank's weights, rank 0 (`model`, `opt`) first; with ZeRO-1, of the
    /// compute weights every rank holds whole ([`Shard::checksum`]).
    pub fn checksums(&self, model: &Gpt<B>, opt: &AdamW<B::InnerBackend>) -> Vec<u32> {
        let _watch = self.watchdog.arm("a checkpoint's checksums", self.limit());
        self.send(|| Job::Checksum);
        let first = checksum(self.zero.as_ref().map(|z| &z.0), model, opt);
        self.watchdog.progress().finished(0);
        std::iter::once(first)
            .chain(self.wait().into_iter().map(|c| c as u32))
            .collect()
    }

    /// ZeRO-1: the whole model and optimizer state on rank 0 (for a checkpoint), assembled from
    /// every rank's share; `None` without ZeRO (rank 0 holds them).
    pub fn gather(
        &self,
        model: &Gpt<B>,
        opt: &AdamW<B::InnerBackend>,
    ) -> Option<(Gpt<B>, AdamW<B::InnerBackend>)> {
        let (shard, _) = self.zero.as_ref()?;
        let _watch = self.watchdog.arm("a checkpoint's gathering", self.limit());
        self.send(|| Job::Share);
        let shares = self
            .workers
            .iter()
            .zip(1..)
            .flat_map(|(w, rank)| {
                w.shares
                    .recv()
                    .unwrap_or_else(|_| rank_gone(rank, self.gpus[rank]))
            })
            .collect();
        self.wait();
        let whole = shard.whole::<B, _>(model, opt, shares);
        self.watchdog.progress().finished(0);
        Some(whole)
    }
}

/// A replica's weights checksum: of its masters, or with ZeRO-1 of its compute weights.
fn checksum<B: crate::TrainBackend>(
    zero: Option<&Shard>,
    model: &Gpt<B>,
    opt: &AdamW<B::InnerBackend>,
) -> u32 {
    match zero {
        Some(z) => z.checksum::<B, _>(model, opt),
        None => dp::weights_checksum::<B, _>(model),
    }
}

/// A rank's copy of the model and of the optimizer state, on its own device, and the update it
/// holds for the loss scaler's verdict.
struct Replica<B: crate::TrainBackend> {
    model: Option<Gpt<B>>,
    opt: AdamW<B::InnerBackend>,
    held: Option<Held<B>>,
}

/// What a rank's thread owns of the run.
struct Own<B: crate::TrainBackend> {
    cfg: crate::config::Config,
    data: Arc<crate::data::Dataset>,
    compute_dtype: burn::tensor::FloatDType,
    gemm: kernels::Gemm,
    fp8_linear: Option<kernels::Fp8LinearConfig>,
    /// The rank's own FP8 amax histories (`fp8.amax_history`).
    fp8_history: Option<kernels::Fp8AmaxHistory>,
    ids: Vec<DeviceId>,
    device: B::Device,
    /// ZeRO-1: this rank's share.
    zero: Option<Shard>,
}

impl<B: crate::TrainBackend> Own<B> {
    /// The rank's loop: copies rank 0's model and optimizer state (`from`) to its GPU, then runs
    /// one job at a time until the run drops its channel.
    fn serve(
        &self,
        rank: usize,
        from: (Gpt<B>, AdamW<B::InnerBackend>),
        jobs: Receiver<Job>,
        (done, shares): (Sender<u64>, Sender<Vec<zero::Owned>>),
        progress: Progress,
    ) {
        use burn::module::Module;
        let (model, opt) = from;
        let model = model.fork(&self.device);
        let inner = model.wte.weight.val().inner().device();
        let mut own_opt = opt.fork(&inner);
        let model = match &self.zero {
            Some(z) => z.take_share::<B, _>(model, &mut own_opt),
            None => model,
        };
        let mut r = Replica {
            opt: own_opt,
            model: Some(model),
            held: None,
        };
        // Rank 0's optimizer state is not held beyond the copy (its update may then write it in
        // place). The copies to another GPU go through NCCL on the pair's communicator, which the
        // gradient averages also use: the run waits for this answer, so that every copy is queued
        // before rank 0's first collective.
        drop(opt);
        // Marked before answering: the run may arm the next work as soon as the answer arrives.
        progress.finished(rank);
        if done.send(0).is_err() {
            return;
        }
        let no_probes = Probes {
            fp8: None,
            taps: None,
        };
        for job in jobs {
            let answer = match job {
                Job::Step(plan) => {
                    let work = RankStep {
                        ctx: StepCtx {
                            cfg: &self.cfg,
                            data: &self.data,
                            compute_dtype: self.compute_dtype,
                            gemm: self.gemm,
                            fp8_linear: self.fp8_linear,
                            fp8_history: self.fp8_history.as_ref(),
                        },
                        zero: self.zero.as_ref(),
                        plan,
                    };
                    let at = Rank {
                        device: &self.device,
                        of: Some((rank, Peers::Threads(&self.ids[..]))),
                    };
                    let model = r.model.take().expect("the replica's model");
                    let out = work.run::<B>(&at, model, &mut r.opt, &no_probes, false);
                    r.model = Some(out.model);
                    r.held = out.held;
                    B::memory_reserved(&self.device).unwrap_or(0)
                }
                Job::Apply { lr, scale } => {
                    let held = r.held.take().expect("a held update");
                    let model = r.model.take().expect("the replica's model");
                    let zero = self.zero.as_ref();
                    r.model = Some(update(&mut r.opt, zero, (lr, scale), model, held));
                    B::memory_reserved(&self.device).unwrap_or(0)
                }
                Job::Share => {
                    let model = r.model.as_ref().expect("the replica's model");
                    let share = match &self.zero {
                        Some(z) => z.share::<B, _>(model, &r.opt),
                        None => Vec::new(),
                    };
                    if shares.send(share).is_err() {
                        return;
                    }
                    0
                }
                Job::Skip => {
                    r.held = None;
                    B::memory_reserved(&self.device).unwrap_or(0)
                }
                Job::Checksum => u64::from(checksum(
                    self.zero.as_ref(),
                    r.model.as_ref().expect("the replica's model"),
                    &r.opt,
                )),
            };
            progress.finished(rank);
            if done.send(answer).is_err() {
                return;
            }
        }
    }
}

/// A rank that failed ends the process: the other ranks may be waiting inside NCCL for it, and
/// nothing can release them, so returning would leave the run hanging. Checkpoints already
/// written stay complete (they are written atomically).
fn rank_failed(rank: usize, gpu: usize, payload: Box<dyn std::any::Any + Send>) -> ! {
    let why = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "it panicked".to_string());
    eprintln!(
        "error: rank {rank} (CUDA GPU {gpu}) failed: {why}; the data-parallel run stops (its last checkpoint is complete; continue with --resume)"
    );
    hard_exit()
}

/// A rank's thread ended without answering (it failed and reported why).
fn rank_gone(rank: usize, gpu: usize) -> ! {
    eprintln!("error: rank {rank} (CUDA GPU {gpu}) stopped; the data-parallel run stops");
    hard_exit()
}

/// Ends the process at once with status 1, without the exit handlers: other threads may be stuck
/// inside the CUDA driver or NCCL, whose teardown at exit could wait for them forever.
fn hard_exit() -> ! {
    use std::io::Write;
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` only ends the process; nothing of this program runs after it.
    unsafe { libc::_exit(1) }
}

/// Runs `f` as rank `rank`; a panic ends the process with the rank's error (see [`rank_failed`]).
fn as_rank<T>(rank: usize, gpu: usize, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => rank_failed(rank, gpu, p),
    }
}
