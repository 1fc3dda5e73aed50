//! The GEMMs' queue on CubeCL's device thread: the service registered there, which calls wait for
//! their answer and which are queued without waiting, and the fallback of a queued call that fails.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::fallback::{warn_once, QUEUED_FALLBACKS};
use super::job::{Job, QueuedFallback};
use super::problem::{alignment, describe, Problem};
use super::Refused;

/// The GEMMs' service on CubeCL's device thread.
///
/// CubeCL 0.10 runs each device's CUDA server on one thread and hands it every task (kernel
/// launches, allocations, frees, reads) from every host thread, in order. Another service
/// registered for the same device runs on that thread too, in the same queue. The GEMMs are
/// queued there ([`execute`]): a GEMM runs after every CubeCL task queued before it and before
/// every later one, the CubeCL calls it makes (the buffers' addresses, the hand-over kernels) run
/// at once on that thread instead of each being a round trip from the caller, and the caller does
/// not wait for it.
pub(super) struct GemmService;

impl cubecl_common::device::DeviceService for GemmService {
    fn init(_: cubecl_common::device::DeviceId) -> Self {
        GemmService
    }
    fn utilities(&self) -> cubecl_common::device::ServerUtilitiesHandle {
        Arc::new(())
    }
}

pub(super) type Runner = cubecl_common::device_handle::DeviceHandle<GemmService>;

/// The queues the GEMMs were sent to, by device index.
static RUNNERS: crate::device_thread::Runners<GemmService> = Mutex::new(Vec::new());

/// The GEMM service on `device`'s CubeCL thread.
pub(super) fn runner(device: &cubecl::cuda::CudaDevice) -> Runner {
    crate::device_thread::runner(&RUNNERS, device)
}

/// Waits until every GEMM queued so far, on every device, has been issued (not run).
pub(super) fn drain_queues() {
    let runners: Vec<Runner> = RUNNERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .flatten()
        .cloned()
        .collect();
    for r in runners {
        let _ = r.submit_blocking(|_| ());
    }
}

/// Waits until every GEMM queued so far on `device` has been issued (not run), if any was queued
/// there.
pub(super) fn drain_queue(device: &cubecl::cuda::CudaDevice) {
    let runner = RUNNERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(device.index)
        .cloned()
        .flatten();
    if let Some(r) = runner {
        let _ = r.submit_blocking(|_| ());
    }
}

/// Problems (per device, with the alignments their buffers' offsets imply) that have run on
/// cuBLASLt: their later calls are queued without waiting.
static PROVEN: Mutex<Option<HashSet<(usize, Problem)>>> = Mutex::new(None);

/// The byte alignment (<= 256) a buffer's offset implies: CubeCL's CUDA allocations start at
/// 256-byte multiples, so a view's address is as aligned as its offset.
fn offset_alignment(t: &CubeTensor<CudaRuntime>) -> u32 {
    alignment(t.handle.offset_start.unwrap_or(0))
}

/// Runs `job` (one cuBLASLt call on the buffers of its tensors) on CubeCL's device thread.
///
/// A problem that has run on cuBLASLt before, in the GPU order, with a fallback for a queued call
/// (bf16/f16/f32 products, FP8) is queued and this returns at once: if it fails there after all
/// (its buffers less aligned than their offsets imply and no algorithm for that), the device
/// thread computes it with the job's fallback (Burn's matmul; FP8: the dequantized operands) into
/// the same output, with the warning, before any later CubeCL work. Every other call (a new
/// problem, a GEMM accumulating into its caller's tensor, the host order) waits for the device
/// thread's answer, so the caller can fall back.
pub(super) fn execute(job: Job) -> Result<(), Refused> {
    let runner = runner(&job.a.device);
    let queue = !matches!(job.fallback, QueuedFallback::NotQueued)
        && job.order.on_gpu()
        && crate::settings::read(|s| s.gemm_queue);
    let key = {
        let mut p = job.problem;
        p.align = [
            offset_alignment(&job.a),
            offset_alignment(&job.b),
            offset_alignment(&job.out),
        ];
        (job.a.device.index, p)
    };
    if queue
        && PROVEN
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|s| s.contains(&key))
    {
        runner.submit(move |_| job.run_queued());
        // CubeCL's device thread takes its queue 32 tasks at a time; without this the GEMM would
        // wait for later tasks to fill the batch (the caller still does not wait).
        runner.flush_queue();
        return Ok(());
    }
    let result = runner
        .submit_blocking(move |_| job.run())
        .map_err(|_| Refused::Unsupported("CubeCL's device thread is gone".into()))?;
    if result.is_ok() && queue {
        PROVEN
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(HashSet::new)
            .insert(key);
    }
    result
}

impl Job {
    /// [`Job::run`] for a queued call, which nobody waits for: if it fails, the job's fallback
    /// computes `out` here, on the device thread, before CubeCL's later work.
    pub(super) fn run_queued(mut self) {
        let forced = crate::settings::read(|s| s.gemm_refuse_queued);
        let (a, b, out) = (self.a.clone(), self.b.clone(), self.out.clone());
        let fallback = std::mem::replace(&mut self.fallback, QueuedFallback::NotQueued);
        let (caller, problem) = (self.caller, self.problem);
        let result = if forced {
            Err(Refused::Unsupported(format!(
                "{}: refused on purpose (kernels::settings::Settings::gemm_refuse_queued)",
                describe(&problem)
            )))
        } else {
            self.run()
        };
        let Err(why) = result else { return };
        let why = match why {
            Refused::Unsupported(why) => why,
            Refused::NotApplicable => format!("{}: not applicable", describe(&problem)),
        };
        let view = |t: CubeTensor<CudaRuntime>, trans: bool| {
            if trans {
                burn_cubecl::ops::permute(t, &[1, 0])
            } else {
                t
            }
        };
        let (done, instead) = match fallback {
            QueuedFallback::Matmul(ta, tb) => {
                let dtype = out.dtype;
                let done = burn_cubecl::kernel::matmul::matmul(
                    view(a, ta),
                    view(b, tb),
                    Some(out),
                    burn_cubecl::kernel::matmul::MatmulStrategy::Cube,
                    dtype,
                );
                (
                    done.map(|_| ()).map_err(|e| format!("{e:?}")),
                    "Burn's matmul",
                )
            }
            QueuedFallback::Compute(compute) => {
                (compute(out), "its operands dequantized and Burn's matmul")
            }
            QueuedFallback::NotQueued => (
                Err("nothing was given to compute it".to_string()),
                "nothing",
            ),
        };
        *QUEUED_FALLBACKS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(HashMap::new)
            .entry(caller)
            .or_default() += 1;
        match done {
            Ok(()) => warn_once(format!(
                "kernels::gemm: {why}; this GEMM runs on {instead} instead"
            )),
            // Nothing can compute this product: stop rather than train on a wrong one.
            Err(e) => {
                eprintln!("error: kernels::gemm: {why}, and {instead} failed too: {e}");
                std::process::abort();
            }
        }
    }
}
