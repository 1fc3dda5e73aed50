//! The data-parallel step: every rank (one thread and one GPU each) runs the forward and backward
//! of its rows of the step's micro-batches on its own replica, the gradients and the loss are
//! averaged across the ranks (NCCL), and every rank applies the same update to its replica. The
//! loss scaler decides once, on rank 0, from the averaged gradients' norm, which every rank shares,
//! so its decision holds for all of them.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_backend::DeviceId;
use model::Gpt;

use super::{MicroBatches, Rank, Session, StepCtx, StepOutcome};
use crate::numerics::{self, Probes};
use crate::optim::{poison_grads, AdamW};
use crate::parallel::{self as dp, Collective};
use crate::precision::Verdict;
use crate::rng::SplitMix64;
use crate::schedule::lr_at;
use crate::watchdog::{self, Progress, Watchdog};
use crate::zero::{self, Shard, Split};

/// The ranks of a data-parallel run beyond rank 0 (whose model and optimizer are the session's,
/// on the calling thread). Each runs in a thread of its own for the whole run, so that its work
/// always reaches the device from the same thread (CubeCL gives each thread its own stream).
pub(super) struct Ranks<B: crate::TrainBackend> {
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
    /// Its part of step `step`, up to the update (with `update_now`, including it).
    Step {
        step: u64,
        lr: f64,
        scale: f64,
        update_now: bool,
    },
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
    /// Starts ranks 1.. as copies of rank 0's model (`model`) and optimizer state.
    pub fn start(
        session: &Session<'_, B>,
        devices: Vec<B::Device>,
        gpus: Vec<usize>,
        model: &Gpt<B>,
    ) -> Self {
        let ids = dp::device_ids::<B>(&devices);
        let timeout_s = session.cfg.training.step_timeout_s;
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
        let copy = super::copied_weights(model, session.compute_dtype);
        let shard = |rank: usize| {
            (session.cfg.training.zero == 1)
                .then(|| Shard::new(&params, rank, ids.clone(), copy.clone()))
        };
        let workers = (1..devices.len())
            .map(|rank| {
                // Rank 0's model and optimizer state, which the rank's thread copies to its GPU:
                // a rank allocates on its GPU from its own thread only, so the pool it reports
                // (CubeCL keeps one per thread's stream) holds all of its memory.
                let from = (model.clone(), session.opt.clone());
                let (jobs, rx) = channel();
                let (tx, done) = channel();
                let (share_tx, shares) = channel();
                let own = Own {
                    cfg: session.cfg.clone(),
                    data: session.data.clone(),
                    compute_dtype: session.compute_dtype,
                    gemm: session.gemm,
                    fp8_linear: session.fp8_linear,
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
    fn wait(&self) -> Vec<u64> {
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

/// The update of a step: AdamW on the averaged gradients, then with ZeRO-1 every rank's share
/// handed to the others.
fn update<B: crate::TrainBackend>(
    opt: &mut AdamW<B::InnerBackend>,
    zero: Option<&Shard>,
    (lr, scale): (f64, f64),
    model: Gpt<B>,
    (grads, norm): (GradientsParams, Tensor<B::InnerBackend, 1>),
) -> Gpt<B> {
    let model = opt.step::<B, _>(lr, model, grads, norm, scale);
    match zero {
        Some(z) => z.publish::<B, _>(model, opt),
        None => model,
    }
}

/// A rank's copy of the model and of the optimizer state, on its own device, and the update it
/// holds for the loss scaler's verdict.
struct Replica<B: crate::TrainBackend> {
    model: Option<Gpt<B>>,
    opt: AdamW<B::InnerBackend>,
    held: Option<(GradientsParams, Tensor<B::InnerBackend, 1>)>,
}

/// What a rank's thread owns of the run.
struct Own<B: crate::TrainBackend> {
    cfg: crate::config::Config,
    data: Arc<crate::data::Dataset>,
    compute_dtype: burn::tensor::FloatDType,
    gemm: kernels::Gemm,
    fp8_linear: Option<kernels::Fp8LinearConfig>,
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
                Job::Step {
                    step,
                    lr,
                    scale,
                    update_now,
                } => {
                    let work = RankStep {
                        ctx: StepCtx {
                            cfg: &self.cfg,
                            data: &self.data,
                            compute_dtype: self.compute_dtype,
                            gemm: self.gemm,
                            fp8_linear: self.fp8_linear,
                        },
                        ids: &self.ids,
                        zero: self.zero.as_ref(),
                        step,
                        lr,
                        scale,
                        update_now,
                    };
                    let model = r.model.take().expect("the replica's model");
                    let out =
                        work.run::<B>(rank, &self.device, model, &mut r.opt, &no_probes, false);
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

/// What one rank's forward and backward leave for the rest of the step.
struct RankOut<B: crate::TrainBackend> {
    model: Gpt<B>,
    /// The averaged gradients and their norm, while the update waits for the loss scaler's
    /// verdict (taken when the update was queued at once).
    held: Option<(GradientsParams, Tensor<B::InnerBackend, 1>)>,
    /// [mean loss over the ranks, scaled gradient norm] (read on rank 0).
    stats: Tensor<B::InnerBackend, 1>,
    numerics: Vec<(String, numerics::Pending<B::InnerBackend>)>,
}

/// A rank's part of a step, up to (and with `update_now`, including) the update.
struct RankStep<'a> {
    ctx: StepCtx<'a>,
    ids: &'a [DeviceId],
    /// ZeRO-1: this rank's share.
    zero: Option<&'a Shard>,
    step: u64,
    lr: f64,
    scale: f64,
    update_now: bool,
}

impl RankStep<'_> {
    fn run<B: crate::TrainBackend>(
        &self,
        rank: usize,
        device: &B::Device,
        model: Gpt<B>,
        opt: &mut AdamW<B::InnerBackend>,
        probes: &Probes,
        poison: bool,
    ) -> RankOut<B> {
        let cfg = self.ctx.cfg;
        let ranks = self.ids.len();
        // The backends' generator is shared by the devices, so a rank's masks from Burn's dropout
        // modules (the reference ops or plain attention) are seeded per (step, rank) and still
        // race with the other ranks' draws: such a run is not bit-reproducible. The kernels'
        // dropout (the fused ops with flash attention) draws from the rank's own seed.
        let index = self.step * ranks as u64 + rank as u64;
        B::seed(
            device,
            SplitMix64::for_stream(cfg.seed, 3, index).next_u64(),
        );
        let mut compute = self.ctx.compute_copy(&model, opt);
        compute.set_dropout_seed(
            SplitMix64::for_stream(cfg.seed, super::KERNEL_DROPOUT_STREAM, index).next_u64(),
        );
        let mut micro = MicroBatches {
            loss_sum: None,
            numerics: Vec::new(),
        };
        let at = Rank {
            device,
            of: Some((rank, ranks)),
        };
        let mut grads = self.ctx.backward(
            &model, &compute, &at, self.step, self.scale, probes, &mut micro,
        );
        drop(compute);
        if poison {
            // Before the mean: the non-finite values reach every rank, as a real overflow would.
            poison_grads::<B, _>(&model, &mut grads);
        }
        // The collectives, in the same order on every rank: each gradient, then [loss, norm].
        dp::mean_grads::<B, _>(&model, &mut grads, self.ids);
        let loss = micro
            .loss_sum
            .expect("at least one micro-batch")
            .div_scalar(cfg.training.grad_accum as f64);
        let inner = loss.device();
        <B::InnerBackend as Collective>::sync(&inner);
        // The norm (and so the clip factor) is averaged too, so that replicas never clip by
        // different factors and drift apart: the kernels' sum of squares adds in a fixed order,
        // but a backend's own full-tensor sum may not (Burn's adds with atomics on CUDA). NCCL
        // gives every rank the same mean.
        let norm = AdamW::<B::InnerBackend>::grad_norm::<B, _>(&model, &grads);
        let stats = dp::reduce(
            Tensor::cat(vec![loss, norm], 0),
            dp::ReduceOperation::Mean,
            self.ids,
        );
        <B::InnerBackend as Collective>::sync(&inner);
        let norm = stats.clone().narrow(0, 1, 1);
        let (model, held) = if self.update_now {
            let at = (self.lr, self.scale);
            (update(opt, self.zero, at, model, (grads, norm)), None)
        } else {
            (model, Some((grads, norm)))
        };
        RankOut {
            model,
            held,
            stats,
            numerics: micro.numerics,
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

impl<B: crate::TrainBackend> Session<'_, B> {
    /// [`Session::step`] of a data-parallel run.
    pub(super) fn step_parallel(
        &mut self,
        model: Gpt<B>,
        step: u64,
    ) -> Result<(Gpt<B>, StepOutcome)> {
        let t0 = Instant::now();
        let cfg = self.cfg;
        let lr = lr_at(cfg, step as usize);
        let probes = Probes::for_step(&self.recipe, cfg, step);
        let scale = self.scaler.scale();
        let update_now = self.scaler.setting.is_off();
        let poison = self.opts.poison_steps.contains(&(step + 1));
        let ranks = self.ranks.as_ref().expect("a data-parallel session");
        let watch = ranks
            .watchdog
            .arm(format!("step {}", step + 1), ranks.limit());
        ranks.send(|| Job::Step {
            step,
            lr,
            scale,
            update_now,
        });
        let work = RankStep {
            ctx: StepCtx {
                cfg,
                data: &self.data,
                compute_dtype: self.compute_dtype,
                gemm: self.gemm,
                fp8_linear: self.fp8_linear,
            },
            ids: &ranks.ids,
            zero: ranks.zero.as_ref().map(|z| &z.0),
            step,
            lr,
            scale,
            update_now,
        };
        let device = &ranks.devices[0];
        let out = as_rank(0, ranks.gpus[0], || {
            work.run::<B>(0, device, model, &mut self.opt, &probes, poison)
        });
        // Each rank's reserved memory (bytes), as its thread sees it after its last job.
        let mut memory = ranks.wait();
        let numerics = probes.taps.is_some().then(|| numerics::read(out.numerics));
        // One read-back per step, on rank 0, as on one device.
        let (loss, grad_norm, finite) = super::read_stats(out.stats, scale);
        ranks.watchdog.progress().finished(0);
        let mut model = out.model;
        let skipped = match self.scaler.update(finite, step + 1) {
            Verdict::Apply => {
                if let Some(held) = out.held {
                    // The update is the step's second part (with ZeRO-1, its own collectives).
                    ranks.watchdog.reset_progress();
                    ranks.send(|| Job::Apply { lr, scale });
                    let zero = ranks.zero.as_ref().map(|z| &z.0);
                    model = update(&mut self.opt, zero, (lr, scale), model, held);
                    ranks.watchdog.progress().finished(0);
                    memory = ranks.wait();
                }
                false
            }
            Verdict::Skip => {
                if !update_now {
                    ranks.watchdog.reset_progress();
                    ranks.watchdog.progress().finished(0);
                    ranks.send(|| Job::Skip);
                    memory = ranks.wait();
                }
                true
            }
            Verdict::Stop(why) => bail!(self.stop_message(step, loss, grad_norm, &why)),
        };
        drop(watch);
        // The first step compiles the kernels: the limit follows the steps after it.
        let took = t0.elapsed();
        if ranks.steps.replace(ranks.steps.get() + 1) > 0 {
            ranks
                .slowest
                .set(Some(ranks.slowest.get().map_or(took, |s| s.max(took))));
        }
        let memory: Vec<Option<u64>> = std::iter::once(B::memory_reserved(&ranks.devices[0]))
            .chain(memory.into_iter().map(|m| (m > 0).then_some(m)))
            .collect();
        Ok((
            model,
            StepOutcome {
                loss,
                grad_norm,
                lr,
                scale,
                skipped,
                seconds: t0.elapsed().as_secs_f64(),
                memory_reserved: memory[0],
                memory_per_rank: memory,
                numerics,
                fp8_probe: probes.fp8,
            },
        ))
    }
}
