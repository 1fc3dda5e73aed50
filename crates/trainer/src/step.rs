//! One rank's part of a training step, the same for every world size (one device is a
//! data-parallel group of one): the forward and backward of its rows of the step's micro-batches
//! on its compute copy, the gradients and the loss averaged over the ranks (nothing to average for
//! a group of one), the gradient norm, and the update, queued at once or held for the loss
//! scaler's verdict. The session (`crate::train`) runs rank 0's part on its own thread; a
//! data-parallel run's other ranks run theirs in threads of their own (`crate::parallel::ranks`).

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use model::{BlockHook, Gpt};

use crate::config::Config;
use crate::data::Dataset;
use crate::numerics::{self, Probes};
use crate::optim::{accumulate_grads, grads_to_f32, poison_grads, AdamW};
use crate::parallel::fsdp::GatherBlocks;
use crate::parallel::overlap::{self, BucketPlan, Hooks, Reducer};
use crate::parallel::zero::Shard;
use crate::parallel::{self as dp, Collective, Peers};
use crate::rng::SplitMix64;

/// The random stream of the dropout masks drawn inside the kernels (stream 3 seeds Burn's).
pub(crate) const KERNEL_DROPOUT_STREAM: u64 = 5;

/// What the session decided for a step before any rank starts it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// 0-based.
    pub step: u64,
    pub lr: f64,
    /// The loss scale (1 without loss scaling).
    pub scale: f64,
    /// Queue the update with the step (no loss scaling: a non-finite step stops the run, so the
    /// update never needs the verdict) rather than hold it for the loss scaler's verdict.
    pub update_now: bool,
}

/// What the forward and backward of a step read: the config, the data and the recipe's dtypes.
/// Shared by the ranks of a data-parallel run, each on its own device.
pub(crate) struct StepCtx<'a> {
    pub cfg: &'a Config,
    pub data: &'a Arc<Dataset>,
    pub compute_dtype: FloatDType,
    pub gemm: kernels::Gemm,
    pub fp8_linear: Option<kernels::Fp8LinearConfig>,
    /// The rank's FP8 amax histories (delayed scaling), advanced after each step.
    pub fp8_history: Option<&'a kernels::Fp8AmaxHistory>,
}

/// The device a step's part runs on, and its place in the group.
pub(crate) struct Rank<'a, B: Backend> {
    pub device: &'a B::Device,
    /// `(rank, the other ranks as the collectives reach them)`; `None` for a group of one, which
    /// reads whole micro-batches and has nothing to average.
    pub of: Option<(usize, Peers<'a>)>,
}

impl<B: Backend> Rank<'_, B> {
    /// The index that seeds this rank's dropout masks at `step`: the step itself on one device,
    /// `(step, rank)` in a data-parallel run.
    fn stream_index(&self, step: u64) -> u64 {
        match self.of {
            None => step,
            Some((rank, peers)) => step * peers.world_size() as u64 + rank as u64,
        }
    }
}

impl StepCtx<'_> {
    /// The compute copy (weights cast to the compute dtype once per step; the master itself for
    /// fp32) that runs forward and backward; its gradients arrive under the master's ids. With
    /// the fused optimizer the copies written by the last step are reused (a resumed or first
    /// step, or one after a skipped step with no copies, casts).
    fn compute_copy<B: crate::TrainBackend>(
        &self,
        model: &Gpt<B>,
        opt: &AdamW<B::InnerBackend>,
    ) -> Gpt<B> {
        model.compute_copy_with(self.compute_dtype, &|id| {
            opt.copies.get(&id).map(|c| B::from_inner(c.clone()))
        })
    }

    /// The precision of this step's forwards: the recipe's, with the step's probes.
    fn precision(&self, probes: &Probes) -> model::Precision {
        model::Precision {
            dtype: self.compute_dtype,
            gemm: self.gemm,
            fp8: self.fp8_linear,
            fp8_edge_blocks: self.cfg.fp8.bf16_edge_blocks,
            fp8_compute_paths: self.cfg.fp8.projections.compute_paths(),
            fp8_history: self.fp8_history.cloned(),
            probes: probes.for_model(self.compute_dtype),
        }
    }

    /// Forward and backward of the step's `training.grad_accum` micro-batches: their gradients
    /// under the master's ids. One micro-batch's stay in the dtypes they arrive in; several are
    /// summed in f32 ([`accumulate_grads`], the cast in the same pass); a data-parallel rank's are
    /// f32 for the mean over ranks. With `overlap`, the last micro-batch's backward hands each
    /// block's gradients (plus the earlier micro-batches') to the reducer as it produces them,
    /// and the gradients returned are already averaged over the ranks.
    ///
    /// Under ZeRO-3 (`gathers`) every micro-batch's forward gathers each block just before it
    /// runs, and its backward reduce-scatters the block's gradients onto this rank's shards: the
    /// gradients returned are this rank's shares, averaged over the ranks.
    fn backward<B: crate::TrainBackend>(
        &self,
        model: &Gpt<B>,
        compute: &Gpt<B>,
        rank: &Rank<'_, B>,
        step: u64,
        scale: f64,
        probes: &Probes,
        micro: &mut MicroBatches<B>,
        overlap: Option<&Reducer<B::InnerBackend>>,
        gathers: Option<&GatherBlocks<B>>,
    ) -> GradientsParams {
        let accum = self.cfg.training.grad_accum as u64;
        let mut sum: Option<GradientsParams> = None;
        let hooks = overlap.map(|reducer| Hooks::<B> {
            reducer: reducer.clone(),
        });
        for m in 0..accum {
            let last = m + 1 == accum;
            if let (true, Some(reducer)) = (last, overlap) {
                // The earlier micro-batches' sum joins the last one's gradients in the buckets.
                if let Some(earlier) = sum.take() {
                    reducer.carry::<B, _>(model, earlier);
                }
            }
            let hook: Option<&dyn BlockHook<B>> = match (&hooks, gathers) {
                (Some(h), _) if last => Some(h),
                (_, Some(g)) => Some(g),
                _ => None,
            };
            let index = step * accum + m;
            let g = self.micro_batch(compute, rank, index, scale, probes, micro, hook);
            sum = Some(match sum {
                Some(earlier) => accumulate_grads::<B, _>(model, earlier, g),
                None => g,
            });
        }
        let mut grads = sum.expect("grad_accum >= 1");
        if let Some(reducer) = overlap {
            return reducer.clone().finish::<B, _>(model, grads);
        }
        // The norm and the AdamW kernel read bf16 and f16 gradients themselves (in f32); only the
        // data-parallel mean runs on f32 gradients (ZeRO-3's arrive averaged, in f32).
        if rank.of.is_some() && gathers.is_none() {
            grads_to_f32::<B, _>(model, &mut grads);
        }
        grads
    }

    /// Forward and backward of micro-batch `index` on the compute copy: adds its loss to
    /// `micro.loss_sum` and returns its gradients under the master's ids, each in the dtype its
    /// weight computes in (bf16 or f16 for the weights with a low-precision copy, f32 for the
    /// rest). On a numerics step, the first micro-batch's output and weight gradients are
    /// measured into `micro.numerics`. A rank of a data-parallel run reads its rows of the
    /// micro-batch. With `hook`, the forward takes each block as the hook hands it over (the
    /// overlapped reducer's or ZeRO-3's gathers, [`model::BlockHook`]).
    fn micro_batch<B: crate::TrainBackend>(
        &self,
        compute: &Gpt<B>,
        rank: &Rank<'_, B>,
        index: u64,
        scale: f64,
        probes: &Probes,
        micro: &mut MicroBatches<B>,
        hook: Option<&dyn BlockHook<B>>,
    ) -> GradientsParams {
        let cfg = self.cfg;
        let batch = cfg.training.batch_size;
        let (x, y) = match rank.of {
            None => {
                self.data
                    .train_batch::<B>(cfg.seed, index, batch, cfg.model.context, rank.device)
            }
            Some((r, peers)) => self.data.train_batch_rows::<B>(
                cfg.seed,
                index,
                batch * peers.world_size(),
                dp::rows(r, batch),
                cfg.model.context,
                rank.device,
            ),
        };
        kernels::memory::trace::<B>(rank.device, || "the batch queued".into());
        let factor = scale / cfg.training.grad_accum as f64;
        let precision = self.precision(probes);
        let (l, pieces) = if cfg.model.recompute != model::RecomputeKind::Full {
            let loss = match hook {
                Some(hook) => compute.forward_loss_hooked(x, y, &precision, hook),
                None => compute.forward_loss_in(x, y, &precision),
            };
            model::dtype::debug_assert_dtype(&loss, FloatDType::F32, "loss");
            kernels::memory::trace::<B>(rank.device, || "after the forward".into());
            let l = loss.clone().inner();
            let loss = if factor == 1.0 {
                loss
            } else {
                loss.mul_scalar(factor)
            };
            (l, vec![loss.backward()])
        } else {
            compute.loss_and_grads_recomputed(x, y, &precision, cfg.model.z_loss, factor, hook)
        };
        kernels::memory::trace::<B>(rank.device, || "after the backward".into());
        micro.loss_sum = Some(match micro.loss_sum.take() {
            Some(s) => s + l,
            None => l,
        });
        let measure = probes.taps.is_some() && micro.numerics.is_empty();
        if let Some(taps) = &probes.taps {
            // Taken on every micro-batch, so the sink does not keep later ones' records. The
            // backward made them from the last layer to the first: listed in forward order.
            let recorded = kernels::format_stats::take_records::<B::InnerBackend>(taps);
            if measure {
                for (name, rows, elements) in recorded.into_iter().rev() {
                    let s = numerics::Pending { rows, elements };
                    micro.numerics.push((format!("{name}.grad_output"), s));
                }
            }
        }
        // With recomputation, the gradients of each piece of the model; only a tied embedding's
        // are in two of them.
        let g = pieces
            .into_iter()
            .map(|raw| GradientsParams::from_grads(raw, compute))
            .reduce(|sum, g| accumulate_grads::<B, _>(compute, sum, g))
            .expect("one backward at least");
        if measure {
            for (name, lin) in compute.projections() {
                if let Some(w) = g.get::<B::InnerBackend, 2>(lin.weight.id) {
                    let s = numerics::stats(w, self.compute_dtype);
                    micro.numerics.push((format!("{name}.weight_grad"), s));
                }
            }
        }
        g
    }
}

/// What the micro-batches of one step gather: their summed loss and, on a numerics step, the
/// first micro-batch's gradient statistics (still on the device).
struct MicroBatches<B: crate::TrainBackend> {
    loss_sum: Option<Tensor<B::InnerBackend, 1>>,
    numerics: Vec<(String, numerics::Pending<B::InnerBackend>)>,
}

/// A held update: the gradients (averaged over the ranks) and their scaled norm.
pub(crate) type Held<B> = (
    GradientsParams,
    Tensor<<B as burn::tensor::backend::AutodiffBackend>::InnerBackend, 1>,
);

/// What one rank's part of a step leaves for the rest of the step.
pub(crate) struct RankOut<B: crate::TrainBackend> {
    pub model: Gpt<B>,
    /// The update, while it waits for the loss scaler's verdict (`None` when it was queued at
    /// once).
    pub held: Option<Held<B>>,
    /// [mean loss (over the ranks), scaled gradient norm, stop]: the step's one read-back, on
    /// rank 0, started as soon as they are computed (before the update is queued).
    pub stats: kernels::StartedRead,
    /// On a numerics step, the gradients' statistics, still on the device.
    pub numerics: Vec<(String, numerics::Pending<B::InnerBackend>)>,
}

/// A rank's part of a step, up to (and with `plan.update_now`, including) the update.
pub(crate) struct RankStep<'a> {
    pub ctx: StepCtx<'a>,
    /// ZeRO: this rank's share.
    pub zero: Option<&'a Shard>,
    pub plan: Plan,
}

impl RankStep<'_> {
    /// Runs this part on `rank`. `poison` overwrites one gradient with inf/NaN (fault injection)
    /// before any average, so that a data-parallel run sees it on every rank.
    pub fn run<B: crate::TrainBackend>(
        &self,
        rank: &Rank<'_, B>,
        model: Gpt<B>,
        opt: &mut AdamW<B::InnerBackend>,
        probes: &Probes,
        poison: bool,
    ) -> RankOut<B> {
        let (cfg, plan) = (self.ctx.cfg, self.plan);
        // Dropout masks depend only on (seed, step), like the batches, so a resumed run repeats
        // them: Burn's dropout draws from the backend's generator, the kernels' from the model's
        // dropout seed. In a data-parallel run each rank draws at (step, rank); the backends'
        // generator is shared by the devices, so the masks of Burn's dropout modules (the
        // reference ops or plain attention) still race with the other ranks' draws and such a run
        // is not bit-reproducible. The kernels' dropout (the fused ops with flash attention)
        // draws from the rank's own seed.
        let index = rank.stream_index(plan.step);
        B::seed(
            rank.device,
            SplitMix64::for_stream(cfg.seed, 3, index).next_u64(),
        );
        let mut compute = self.ctx.compute_copy(&model, opt);
        compute.set_dropout_seed(
            SplitMix64::for_stream(cfg.seed, KERNEL_DROPOUT_STREAM, index).next_u64(),
        );
        let mut micro = MicroBatches {
            loss_sum: None,
            numerics: Vec::new(),
        };
        let overlap = self.overlap::<B>(&model, rank, probes, poison);
        let gathers = self.zero.and_then(|z| z.gathers::<B>());
        let mut grads = self.ctx.backward(
            &model,
            &compute,
            rank,
            plan.step,
            plan.scale,
            probes,
            &mut micro,
            overlap.as_ref(),
            gathers.as_ref(),
        );
        drop(compute);
        // The step's amaxes join the FP8 histories whatever the step's verdict: the amax skips
        // non-finite values, and the next step's scales need them either way.
        if let Some(history) = self.ctx.fp8_history {
            history.advance();
        }
        if poison {
            poison_grads::<B, _>(&model, &mut grads);
        }
        let loss_sum = micro.loss_sum.expect("at least one micro-batch");
        let (stats, norm) = match rank.of {
            None => self.alone::<B>(&model, &grads, loss_sum),
            Some((_, peers)) => {
                let averaged = overlap.is_some();
                self.averaged::<B>(&model, &mut grads, loss_sum, peers, averaged)
            }
        };
        kernels::memory::trace::<B>(rank.device, || "the statistics computed".into());
        let stats =
            <B::InnerBackend as kernels::ReadBackOps>::start_read(stats.into_primitive().tensor());
        let (model, held) = if plan.update_now {
            // The update is queued before the step's read-back: the GPU runs it while the host
            // waits, instead of idling while the host queues it afterwards. Without loss scaling
            // a non-finite step ends the run and nothing of it is kept (the last checkpoint stays
            // as it was); with loss scaling the verdict decides whether the update runs at all.
            let at = (plan.lr, plan.scale);
            let model = update(opt, self.zero, at, model, (grads, norm));
            kernels::memory::trace::<B>(rank.device, || "after the update".into());
            (model, None)
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

    /// The bucketed reduction during the backward ([`crate::parallel::overlap`]), where this step
    /// takes it: a rank of a run of processes that takes the buckets
    /// ([`overlap::after_backward_because`]), on neither a numerics step (whose statistics read
    /// the weight gradients of each micro-batch) nor a poisoned one (whose non-finite gradient
    /// must reach every rank through the mean). Every rank decides alike (the probes and the
    /// poisoned steps come from the run's config and options, the same on every rank), as their
    /// NCCL calls must match.
    fn overlap<B: crate::TrainBackend>(
        &self,
        model: &Gpt<B>,
        rank: &Rank<'_, B>,
        probes: &Probes,
        poison: bool,
    ) -> Option<Reducer<B::InnerBackend>> {
        let cfg = self.ctx.cfg;
        let Some((_, Peers::Processes(group))) = rank.of else {
            return None;
        };
        let zero = self.zero.map_or(0, |z| z.stage);
        let after = overlap::after_backward_because(cfg, zero).is_some();
        if after || probes.taps.is_some() || poison {
            return None;
        }
        let bytes = (cfg.training.bucket_mb * 1024.0 * 1024.0) as usize;
        Some(Reducer::new(
            Arc::new(group.clone()),
            BucketPlan::new(model, bytes),
        ))
    }

    /// A group of one: [mean loss, scaled gradient norm, stop] and the norm, nothing exchanged.
    /// The norm tells whether the gradients are finite (a single inf or NaN makes it
    /// non-finite); stop is 1 when a stop was asked for ([`crate::stop`]).
    fn alone<B: crate::TrainBackend>(
        &self,
        model: &Gpt<B>,
        grads: &GradientsParams,
        loss_sum: Tensor<B::InnerBackend, 1>,
    ) -> (Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>) {
        let norm = AdamW::<B::InnerBackend>::grad_norm::<B, _>(model, grads);
        let loss = loss_sum.div_scalar(self.ctx.cfg.training.grad_accum as f64);
        let stop = stop_flag::<B::InnerBackend>(&loss.device());
        (Tensor::cat(vec![loss, norm.clone(), stop], 0), norm)
    }

    /// A data-parallel rank: the gradients, then [mean loss, scaled gradient norm, stop] averaged
    /// over the ranks (stop is above 0 when any rank was asked to stop), the collectives in the
    /// same order on every rank; that stats tensor and the norm. Under ZeRO-2 each gradient is
    /// averaged onto its owner alone (under ZeRO-3 the backward averaged each onto the ranks'
    /// shards), and the norm is the square root of the ranks' summed sums of squares over their
    /// own gradients. `averaged`: the backward averaged the gradients
    /// already ([`crate::parallel::overlap`]).
    fn averaged<B: crate::TrainBackend>(
        &self,
        model: &Gpt<B>,
        grads: &mut GradientsParams,
        loss_sum: Tensor<B::InnerBackend, 1>,
        peers: Peers<'_>,
        averaged: bool,
    ) -> (Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>) {
        // ZeRO-2 and 3: each rank holds its share of the averaged gradients.
        let sharded = self.zero.filter(|z| z.stage >= 2);
        match sharded {
            Some(z) if z.stage == 2 => z.reduce_grads::<B, _>(model, grads),
            // ZeRO-3's backward reduce-scattered them onto the shards.
            Some(_) => {}
            None if averaged => {}
            None => dp::mean_grads::<B, _>(model, grads, peers),
        }
        let loss = loss_sum.div_scalar(self.ctx.cfg.training.grad_accum as f64);
        let inner = loss.device();
        sync::<B::InnerBackend>(peers, &inner);
        // The norm (and so the clip factor) is averaged too, so that replicas never clip by
        // different factors and drift apart: the kernels' sum of squares adds in a fixed order,
        // but a backend's own full-tensor sum may not (Burn's adds with atomics on CUDA). NCCL
        // gives every rank the same mean. Under ZeRO-2 a rank's part is its own gradients' sum of
        // squares times the world size, whose mean over the ranks is the sum.
        let norm_part = match sharded {
            None => AdamW::<B::InnerBackend>::grad_norm::<B, _>(model, grads),
            Some(z) => AdamW::<B::InnerBackend>::grad_sum_squares::<B, _>(model, grads)
                .unwrap_or_else(|| Tensor::zeros([1], &inner))
                .mul_scalar(z.world() as f64),
        };
        let stop = stop_flag::<B::InnerBackend>(&inner);
        let stats = dp::reduce(
            Tensor::cat(vec![loss, norm_part, stop], 0),
            dp::ReduceOperation::Mean,
            peers,
        );
        sync::<B::InnerBackend>(peers, &inner);
        let stats = match sharded {
            None => stats,
            Some(_) => {
                let part = |i| stats.clone().narrow(0, i, 1);
                Tensor::cat(vec![part(0), part(1).sqrt(), part(2)], 0)
            }
        };
        let norm = stats.clone().narrow(0, 1, 1);
        (stats, norm)
    }
}

/// Makes `device`'s compute stream wait for the collectives of a run of threads
/// ([`Collective::sync`]). Between processes there is nothing to wait for: the collectives run on
/// CubeCL's own stream, in its order.
fn sync<B: Collective>(peers: Peers<'_>, device: &B::Device) {
    if let Peers::Threads(_) = peers {
        <B as Collective>::sync(device);
    }
}

/// The update of a step: AdamW on the (averaged) gradients, then with ZeRO every rank's share
/// handed to the others.
pub(crate) fn update<B: crate::TrainBackend>(
    opt: &mut AdamW<B::InnerBackend>,
    zero: Option<&Shard>,
    (lr, scale): (f64, f64),
    model: Gpt<B>,
    (grads, norm): Held<B>,
) -> Gpt<B> {
    let model = opt.step::<B, _>(lr, model, grads, norm, scale);
    match zero {
        Some(z) => z.publish::<B, _>(model, opt),
        None => model,
    }
}

/// The step's one read-back, [mean loss, scaled gradient norm, stop] (see [`RankOut::stats`]):
/// the loss, the true gradient norm, and whether both are finite. It waits for the step's work up
/// to the statistics, so the step's timing is real.
pub(crate) fn read_stats(stats: kernels::StartedRead, scale: f64) -> Stats {
    let stats: Vec<f64> = stats.wait().convert::<f64>().into_vec().expect("f64 stats");
    let (loss, grad_norm) = (stats[0], stats[1] / scale);
    Stats {
        loss,
        grad_norm,
        finite: loss.is_finite() && grad_norm.is_finite(),
        stop: stats[2] > 0.0,
    }
}

/// A step's statistics, as read back once per step.
pub(crate) struct Stats {
    /// Mean loss over the ranks.
    pub loss: f64,
    /// Unscaled gradient norm (averaged over the ranks).
    pub grad_norm: f64,
    /// Whether the loss and gradients are finite.
    pub finite: bool,
    /// Whether some rank was asked to stop ([`crate::stop`]).
    pub stop: bool,
}

/// 1 when this process was asked to stop ([`crate::stop`]), else 0, as a one-element tensor that
/// joins the step's statistics.
fn stop_flag<B: Backend>(device: &B::Device) -> Tensor<B, 1> {
    let flag = if crate::stop::requested() {
        1.0f32
    } else {
        0.0
    };
    Tensor::from_floats([flag], device)
}

/// The weights that train through a copy in the compute dtype, with that dtype (none in f32).
pub(crate) fn copied_weights<B: Backend>(
    model: &Gpt<B>,
    compute_dtype: FloatDType,
) -> Option<(FloatDType, HashSet<ParamId>)> {
    (compute_dtype != FloatDType::F32).then(|| (compute_dtype, model.compute_copy_ids()))
}

#[cfg(test)]
mod tests {
    use burn::backend::ndarray::NdArrayDevice;
    use burn::module::{Module, ModuleVisitor, Param};

    use super::*;
    use crate::CpuBackend as B;

    /// Every gradient of `g`, as f32 values in module order.
    fn values(model: &Gpt<B>, g: &GradientsParams) -> Vec<Vec<f32>> {
        struct Values<'a>(&'a GradientsParams, Vec<Vec<f32>>);
        impl ModuleVisitor<B> for Values<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                let g = self
                    .0
                    .get::<burn::backend::NdArray, D>(p.id)
                    .expect("a gradient");
                self.1
                    .push(g.into_data().convert::<f32>().into_vec().unwrap());
            }
        }
        let mut v = Values(g, Vec::new());
        model.visit(&mut v);
        v.1
    }

    /// With `training.grad_accum = 3` the step's gradients are the sum of its three
    /// micro-batches' (each scaled by 1/3), every micro-batch counted once.
    #[test]
    fn accumulation_sums_every_micro_batch() {
        let mut cfg = Config::default();
        cfg.model.kernels = model::KernelsKind::Reference;
        cfg.model.attention = model::AttentionKind::Plain;
        cfg.model.n_layer = 2;
        cfg.model.n_head = 2;
        cfg.model.d_model = 32;
        cfg.model.context = 16;
        cfg.data.embedded_chars = 20_000;
        cfg.training.batch_size = 4;
        cfg.training.grad_accum = 3;
        let data = Arc::new(Dataset::build(&cfg, None).expect("the embedded corpus"));
        let device = NdArrayDevice::Cpu;
        let model = Gpt::<B>::new(&cfg.model, data.vocab_size(), &device);
        let ctx = StepCtx {
            cfg: &cfg,
            data: &data,
            compute_dtype: FloatDType::F32,
            gemm: model.precision().gemm,
            fp8_linear: None,
            fp8_history: None,
        };
        let rank = Rank::<B> {
            device: &device,
            of: None,
        };
        let probes = Probes {
            fp8: None,
            taps: None,
        };
        let micro = || MicroBatches::<B> {
            loss_sum: None,
            numerics: Vec::new(),
        };
        let step = 5;
        let got = ctx.backward(
            &model,
            &model,
            &rank,
            step,
            1.0,
            &probes,
            &mut micro(),
            None,
            None,
        );
        let got = values(&model, &got);
        let mut want: Option<Vec<Vec<f32>>> = None;
        for m in 0..3 {
            let g = ctx.micro_batch(
                &model,
                &rank,
                step * 3 + m,
                1.0,
                &probes,
                &mut micro(),
                None,
            );
            let g = values(&model, &g);
            want = Some(match want {
                None => g,
                Some(w) => w
                    .iter()
                    .zip(&g)
                    .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x + y).collect())
                    .collect(),
            });
        }
        let want = want.unwrap();
        let one = ctx.micro_batch(&model, &rank, step * 3, 1.0, &probes, &mut micro(), None);
        let one = values(&model, &one);
        let mut largest = 0f32;
        let mut from_one = 0f32;
        for ((g, w), o) in got.iter().zip(&want).zip(&one) {
            for ((a, b), c) in g.iter().zip(w).zip(o) {
                largest = largest.max((a - b).abs() / b.abs().max(1e-3));
                from_one = from_one.max((a - c).abs());
            }
        }
        assert!(
            largest < 1e-4,
            "accumulated gradients differ from the sum by {largest}"
        );
        assert!(
            from_one > 1e-4,
            "the micro-batches' gradients are all alike"
        );
    }
}
