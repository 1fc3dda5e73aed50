//! When a step's read-back is taken: the steps are queued on the device, and each one's statistics
//! ([mean loss, gradient norm, stop], the step's one read from the device) are read either at once
//! or one step late, once the next step is queued behind it.
//!
//! Read at once, the device runs dry at every step boundary: the host waits for the last kernel of
//! step N, then takes its time (batch, graph, launches) before step N+1's first kernel reaches the
//! device. Read one step late, step N+1 is already queued when the host waits for step N's
//! statistics, so the device goes straight on from one step to the next.
//!
//! A step is read late only when nothing after it needs its result on the host before the next
//! step is queued ([`Session::reads_late`]): not the first step of a session (its time is the
//! compile time), not a step whose update waits for the loss scaler's verdict, that probes the
//! numerics, evaluates or checkpoints, not the last, not a fault-injection step, and only on a group
//! of one device (`training.read_back_late = false` reads every step at once). Late or not, the
//! same kernels run in the same order: the loss curve and the checkpoints are unchanged.
//!
//! A stop asked for (SIGINT, SIGTERM) that a late read reveals is taken at the step after it, which
//! is then read at once: that step carries the stop too (the request stays set), and its checkpoint
//! is the one written.

use std::time::Instant;

use anyhow::{bail, Result};
use model::Gpt;

use super::capture::Capture;
use super::{Session, StepOutcome};
use crate::numerics::{self, Probes};
use crate::parallel::watchdog::Watch;
use crate::precision::Verdict;
use crate::schedule::lr_at;
use crate::step::{read_stats, update, Held, Plan, RankOut, RankStep, StepCtx};

/// A step queued on the devices whose statistics have not been read yet.
pub(super) struct Queued<B: crate::TrainBackend> {
    step: u64,
    /// When the host started queuing it.
    t0: Instant,
    /// How long the host took to queue it.
    queuing: std::time::Duration,
    plan: Plan,
    probes: Probes,
    poison: bool,
    /// The update, while it waits for the loss scaler's verdict (`None`: queued with the step).
    held: Option<Held<B>>,
    stats: kernels::StartedRead,
    numerics: Vec<(String, numerics::Pending<B::InnerBackend>)>,
    /// Each other rank's reserved memory (bytes), as its thread saw it after its part.
    others: Vec<u64>,
    watch: Option<Watch>,
}

impl<B: crate::TrainBackend> Session<'_, B> {
    /// Trains steps `self.start_step..end`, reading each one's statistics at once or one step
    /// late. Returns when the run reaches `end` or was asked to stop.
    pub(super) fn run_steps(&mut self, mut model: Gpt<B>, end: u64) -> Result<()> {
        let mut behind: Option<Queued<B>> = None;
        let device = self.group.device.clone();
        let mut capture =
            Capture::from_env::<B::InnerBackend>(&device, (self.start_step, end), &self.log)?;
        for step in self.start_step..end {
            if let Some(c) = &mut capture {
                c.before::<B>(step, &device, &self.log)?;
            }
            if step == self.start_step && !self.opts.device_name.starts_with("CPU") {
                self.log.line(&format!(
                    "step {}: compiling the GPU kernels at this model's shapes (once per shape)...",
                    step + 1
                ));
            }
            let queued;
            let zero3 = self.group.zero().is_some_and(|z| z.stage == 3);
            let gathered_before = self
                .group
                .process()
                .filter(|_| zero3)
                .map(|p| p.gathered_bytes());
            (model, queued) = self.queue(model, step);
            if let (Some(p), Some(before)) = (self.group.process(), gathered_before) {
                self.progress.gathered_last_step = Some(p.gathered_bytes() - before);
            }
            let mut stop_seen = false;
            if let Some(earlier) = behind.take() {
                let done = earlier.step;
                let mut outcome;
                (model, outcome) = self.settle(earlier, model)?;
                // `model` is already this step's: the stop is taken after this step.
                stop_seen = std::mem::take(&mut outcome.stop);
                self.finish_step(&model, done, end, outcome)?;
            }
            let read_now = capture.as_ref().is_some_and(|c| c.reads_at_once(step));
            if !stop_seen && !read_now && self.reads_late(&queued, end) {
                self.progress.read_late += 1;
                behind = Some(queued);
                continue;
            }
            let outcome;
            (model, outcome) = self.settle(queued, model)?;
            if let Some(c) = &mut capture {
                c.after::<B>(step, &device, &self.log)?;
            }
            if self.finish_step(&model, step, end, outcome)? {
                self.log.line(&format!(
                    "stopped after step {} as asked (SIGINT or SIGTERM), with its checkpoint; continue with --resume {}",
                    step + 1,
                    self.opts.run_dir.display()
                ));
                break;
            }
        }
        debug_assert!(behind.is_none(), "the last step is read at once");
        if let Some(c) = &mut capture {
            c.close::<B>(&device, &self.log)?;
        }
        Ok(())
    }

    /// Queues one optimizer step on every rank of the group (one device is a group of one): each
    /// runs the forward and backward of its part of `training.grad_accum` micro-batches on its
    /// compute copy and the gradients are averaged over the ranks; without loss scaling the
    /// update is queued too. Returns the model (updated, or waiting for [`Session::settle`]).
    fn queue(&mut self, model: Gpt<B>, step: u64) -> (Gpt<B>, Queued<B>) {
        let t0 = Instant::now();
        let cfg = self.cfg;
        let plan = Plan {
            step,
            lr: lr_at(cfg, step as usize),
            scale: self.scaler.scale(),
            update_now: self.scaler.setting.is_off(),
        };
        let probes = Probes::for_step(&self.recipe, cfg, step);
        let poison = self.opts.poison_steps.contains(&(step + 1));
        // Ranks 1.. start their part (a group of one has none), watched until the step ends.
        let watch = self.group.begin(plan);
        let part = RankStep {
            ctx: StepCtx {
                cfg,
                data: &self.data,
                compute_dtype: self.compute_dtype,
                gemm: self.gemm,
                fp8_linear: self.fp8_linear,
                fp8_history: self.fp8_history.as_ref(),
            },
            zero: self.group.zero(),
            plan,
        };
        let rank = self.group.rank0();
        let opt = &mut self.opt;
        let RankOut {
            model,
            held,
            stats,
            numerics,
        } = self
            .group
            .on_rank0(|| part.run::<B>(&rank, model, opt, &probes, poison));
        // Each other rank's reserved memory (bytes), as its thread sees it after its part.
        let others = self.group.wait();
        let queued = Queued {
            step,
            t0,
            queuing: t0.elapsed(),
            plan,
            probes,
            poison,
            held,
            stats,
            numerics,
            others,
            watch,
        };
        (model, queued)
    }

    /// Whether `q`'s statistics may wait until the next step is queued (see the module's text).
    fn reads_late(&self, q: &Queued<B>, end: u64) -> bool {
        let done = q.step + 1;
        self.cfg.training.read_back_late
            && q.step > self.start_step
            && q.held.is_none()
            && q.probes.fp8.is_none()
            && q.probes.taps.is_none()
            && !q.poison
            && self.group.data_parallel().is_none()
            && self.group.process().is_none()
            && !self.evaluates_at(done)
            && !self.checkpoints_at(done, end)
    }

    /// The end of every step, for any world size: the step's one read-back (on rank 0), the loss
    /// scaler's verdict on it, applied on every rank (Apply: the held update runs; Skip: it is
    /// dropped; Stop: the run ends with an error), and the step's [`StepOutcome`]. `model` is the
    /// model as queued since (a step read late passes on the next step's). `q.watch` (the
    /// watchdog of a data-parallel run) is held until the verdict has been applied everywhere.
    fn settle(&mut self, q: Queued<B>, model: Gpt<B>) -> Result<(Gpt<B>, StepOutcome)> {
        let plan = q.plan;
        let numerics = q.probes.taps.is_some().then(|| numerics::read(q.numerics));
        // One read-back per step: [mean loss, scaled grad norm, stop]. It tells whether the gradients are
        // finite (a single inf or NaN makes the norm non-finite), and it synchronises, so the
        // timing is real.
        let stats = read_stats(q.stats, plan.scale);
        let (loss, grad_norm, finite) = (stats.loss, stats.grad_norm, stats.finite);
        // A run of processes: a collective that failed leaves the stats unreliable.
        self.group.check()?;
        self.group.rank0_finished();
        let (mut model, mut others) = (model, q.others);
        let skipped = match self.scaler.update(finite, plan.step + 1) {
            Verdict::Apply => {
                // Unless it was queued with the step (no loss scaling), the update is the step's
                // second part on every rank (with ZeRO-1, its own collectives).
                if let Some(held) = q.held {
                    let (opt, zero) = (&mut self.opt, self.group.zero());
                    let at = (plan.lr, plan.scale);
                    (model, others) = self
                        .group
                        .apply(plan, || update(opt, zero, at, model, held));
                }
                false
            }
            Verdict::Skip => {
                if !plan.update_now {
                    others = self.group.skip();
                }
                true
            }
            Verdict::Stop(why) => bail!(self.stop_message(plan.step, loss, grad_norm, &why)),
        };
        drop(q.watch);
        // A step read late began while the one before it was still being read: its time runs from
        // that read, so that steps in a row add up to about the wall time. But a step takes at
        // least the host's time to queue it: a step read at once after a late read was queued
        // before that read, and where the host sets the pace the device has nearly finished it by
        // then (its time from the read would be only its last kernels).
        let began = match self.last_read_back {
            Some(read) if read > q.t0 => read,
            _ => q.t0,
        };
        let took = began.elapsed().max(q.queuing);
        self.group.timed(took);
        let memory = self.group.memory(others);
        let outcome = StepOutcome {
            stop: stats.stop,
            loss,
            grad_norm,
            lr: plan.lr,
            scale: plan.scale,
            skipped,
            seconds: took.as_secs_f64(),
            host_seconds: q.queuing.as_secs_f64(),
            memory_reserved: memory[0],
            memory_per_rank: memory,
            numerics,
            fp8_probe: q.probes.fp8,
        };
        self.last_read_back = Some(Instant::now());
        Ok((model, outcome))
    }
}
