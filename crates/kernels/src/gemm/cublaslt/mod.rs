//! cuBLASLt on the device pointers of CubeCL's CUDA buffers.
//!
//! Row-major `C [m, n] = op(A) [m, k] op(B) [k, n]` is, read column-major, `C^T = op(B)^T op(A)^T`:
//! cuBLASLt is called with B's buffer as its first operand and A's as its second, each with its own
//! transpose flag, and writes C^T column-major with leading dimension `n`, which is C row-major.
//!
//! Per device this keeps one cuBLASLt handle, a 32 MiB workspace (what cuBLAS uses on Hopper) per
//! stream the GEMMs run on (CubeCL's streams in the `Same` order, a stream of its own otherwise)
//! and, per problem (shape, layouts, alignments), the call's descriptors and the heuristic's
//! algorithm (or the fastest of its results, timed: [`timing`]); they live as long as the
//! process.
//!
//! Every call runs on CubeCL's device thread ([`GemmService`](queue::GemmService)): CubeCL 0.10
//! runs each device's CUDA server on one thread that takes every task (launches, allocations,
//! frees) from every host thread in order, and a GEMM queued there sits between the CubeCL work
//! queued before and after it. On that thread the buffers' addresses and the hand-over kernels cost
//! no round trips, and a problem that has run on cuBLASLt before is queued without the caller
//! waiting (the host keeps running ahead of the GPU as it does for CubeCL's kernels); a new
//! problem, a GEMM accumulating into the caller's tensor or the host order waits for the answer,
//! so that a refusal falls back on the caller's side (a queued call that fails after all runs its
//! job's [`QueuedFallback`] on the device thread).
//!
//! Ordering with CubeCL's work ([`Order`]):
//! - `Same` (the default; `BURNMIX_GEMM_ORDER=same`): the GEMM is issued on CubeCL's own CUDA
//!   stream, the one CubeCL uses for the calling host thread, so it runs after CubeCL's earlier
//!   work and before its later work with nothing else on the GPU. CubeCL 0.10 has no accessor for
//!   that `CUstream`; its CUDA server's `Debug` description prints it (`sys: 0x...` in the slot of
//!   its stream pool that the thread's stream id maps to), so it is read from there once per stream
//!   ([`stream_slots`](crate::cuda_stream::stream_slots)) and checked with `cuStreamGetCtx` (it must be a
//!   live stream of the device's context). The buffers' addresses are taken through CubeCL on that
//!   stream, which makes CubeCL order any buffer last written on another of its streams first.
//!   CubeCL's memory pools are stream-ordered, so a buffer freed after the call is reused only
//!   behind the GEMM: nothing needs holding. Each such stream gets its own 32 MiB workspace. Where
//!   the stream cannot be found (another CubeCL version), the GEMMs take the `Stream` order, with a
//!   warning.
//! - `Stream` (`BURNMIX_GEMM_ORDER=stream`): no host waits. A one-thread CubeCL kernel stores a
//!   sequence number `v` into a flag word after CubeCL's earlier work; a one-thread kernel on the
//!   GEMM's stream (`burnmix_gemm_wait` in [`WAIT_PTX`](handover::WAIT_PTX)) spins until it reads
//!   `v`, the GEMM runs, a one-thread kernel behind it (`burnmix_gemm_post`) fences and stores `v`
//!   into a second flag; a one-thread CubeCL kernel spins on that flag before CubeCL's later work.
//!   (The driver's stream memory operations, `cuStreamWaitValue32` / `cuStreamWriteValue32`, refuse
//!   CubeCL's buffers, which come from stream-ordered memory pools: `CUDA_ERROR_INVALID_VALUE` on
//!   an H100 with CUDA 13.0.) Sequence numbers are only taken on the device thread, so they reach
//!   both streams in one order. GEMMs from a host thread other than the one that created the flags
//!   are host-synchronised.
//!   The flags alone are not enough: CubeCL may hand the memory of a tensor the caller dropped
//!   after the call to a new tensor and write it while the GEMM still runs (with the GPU shared
//!   between processes a small GPT's logits then moved when a later token changed). So clones of
//!   the GEMM's operands, output and scales are held, with an event recorded behind the GEMM on its
//!   stream, until that event has completed (checked at the next GEMMs, never waited for unless
//!   4096 are in flight).
//! - `Host` (`BURNMIX_GEMM_ORDER=host`): CubeCL's stream is synchronised before the GEMM, and
//!   the GEMM's stream after it. The device thread, and the caller, stall once per GEMM.

mod call;
mod device;
mod diagnose;
mod fallback;
mod fp8;
mod handover;
mod job;
mod order;
mod problem;
mod queue;
mod recorded;
#[cfg(test)]
mod tests;
mod timing;

use std::any::Any;
use std::sync::OnceLock;

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::sys;

pub use diagnose::diagnose_wait;
pub(crate) use fallback::fell_back;
pub(crate) use fp8::{fp8_block_scaling_supported, fp8_gemm, Fp8Operand, Fp8Scales};
pub(crate) use job::QueuedFallback;
pub(crate) use order::{effective_order, Order};
pub use timing::{timed_gemms, TimedGemm};

use fallback::{FALLBACKS, QUEUED_FALLBACKS};
use job::Job;
use order::order;
use problem::{data_type, dims2, operand, Problem};

pub(crate) use problem::Epilogue;
use queue::{drain_queue, drain_queues, execute};

const WORKSPACE_BYTES: usize = 32 << 20;

/// Why a GEMM did not run on cuBLASLt.
#[derive(Debug)]
pub(crate) enum Refused {
    /// Not a CUDA tensor, or a dtype cuBLASLt is not used for here: the caller uses Burn's matmul.
    NotApplicable,
    /// cuBLASLt has no algorithm for this problem (alignment, size): Burn's matmul, with a warning.
    Unsupported(String),
}

/// `Ok(version)` if libcublasLt loads.
pub(crate) fn library() -> Result<usize, String> {
    static STATUS: OnceLock<Result<usize, String>> = OnceLock::new();
    STATUS
        .get_or_init(|| {
            // SAFETY: both only load the library (cudarc loads it at run time) and read its
            // version.
            unsafe {
                if !sys::is_culib_present() {
                    return Err("libcublasLt could not be loaded; install the CUDA toolkit's cuBLAS or put its lib directory on LD_LIBRARY_PATH".into());
                }
                Ok(sys::cublasLtGetVersion())
            }
        })
        .clone()
}

/// `t` as a CUDA tensor, if it is one.
pub(crate) fn as_cuda<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<&CubeTensor<CudaRuntime>> {
    (t as &dyn Any).downcast_ref::<CubeTensor<CudaRuntime>>()
}

/// `t` as a CUDA tensor, if it is one.
pub(crate) fn into_cuda<R: CubeRuntime>(t: CubeTensor<R>) -> Option<CubeTensor<CudaRuntime>> {
    (Box::new(t) as Box<dyn Any>)
        .downcast::<CubeTensor<CudaRuntime>>()
        .ok()
        .map(|t| *t)
}

/// A CUDA tensor back as `CubeTensor<R>` (`R` is `CudaRuntime`).
pub(crate) fn from_cuda<R: CubeRuntime>(t: CubeTensor<CudaRuntime>) -> CubeTensor<R> {
    *(Box::new(t) as Box<dyn Any>)
        .downcast::<CubeTensor<R>>()
        .expect("the runtime is CUDA")
}

/// `op(a) op(b)` on cuBLASLt, or why not.
pub(crate) fn gemm(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    trans_a: bool,
    trans_b: bool,
) -> Result<CubeTensor<CudaRuntime>, Refused> {
    gemm_epilogue(a, b, trans_a, trans_b, Epilogue::None, None).map(|(out, _)| out)
}

/// `op(a) op(b)` on cuBLASLt with `epilogue` ([`Epilogue`]), or why not: `(out, aux)`.
/// - [`Epilogue::None`]: the product, no auxiliary matrix;
/// - [`Epilogue::Gelu`]: `gelu(p)`, no auxiliary matrix;
/// - [`Epilogue::GeluAux`]: `gelu(p)` and the product `p` itself (the pre-activation);
/// - [`Epilogue::DGelu`] with `h` (the pre-activation, a contiguous `[m, n]` of the operands'
///   dtype): `p * gelu'(h)`, `h` handed back as `aux`.
///
/// An auxiliary matrix needs the rows (`n` elements) a multiple of 8 (cuBLASLt's rule for its
/// leading dimension); `h` goes with `DGelu` only. Otherwise it is [`Refused::NotApplicable`].
/// Calls with a GELU are never queued without waiting ([`QueuedFallback::NotQueued`]): a refusal
/// falls back on the caller's side.
#[allow(clippy::type_complexity)]
pub(crate) fn gemm_epilogue(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    trans_a: bool,
    trans_b: bool,
    epilogue: Epilogue,
    h: Option<CubeTensor<CudaRuntime>>,
) -> Result<(CubeTensor<CudaRuntime>, Option<CubeTensor<CudaRuntime>>), Refused> {
    let Some((dt, compute)) = data_type(a.dtype) else {
        return Err(Refused::NotApplicable);
    };
    let (ad, _) = dims2(&a);
    let (bd, _) = dims2(&b);
    let ([m, k, n], _) = super::dims(ad, bd, trans_a, trans_b);
    if m == 0 || n == 0 || k == 0 || library().is_err() || a.device != b.device {
        return Err(Refused::NotApplicable);
    }
    let new = |t: &CubeTensor<CudaRuntime>| {
        empty_device_contiguous_dtype(
            t.client.clone(),
            t.device.clone(),
            Shape::new([m, n]),
            t.dtype,
        )
    };
    let aux = match (epilogue, h) {
        (Epilogue::None | Epilogue::Gelu, None) => None,
        (Epilogue::GeluAux, None) if n.is_multiple_of(8) => Some(new(&a)),
        (Epilogue::DGelu, Some(h))
            if n.is_multiple_of(8)
                && h.dtype == a.dtype
                && h.device == a.device
                && dims2(&h) == ([m, n], [n, 1]) =>
        {
            Some(h)
        }
        _ => return Err(Refused::NotApplicable),
    };
    let (a, la) = operand(a, trans_a);
    let (b, lb) = operand(b, trans_b);
    let out = new(&a);
    let problem = Problem {
        types: [dt, dt, dt],
        compute,
        scale_modes: None,
        m,
        n,
        k,
        a: la,
        b: lb,
        align: [0; 3],
        epilogue,
    };
    execute(Job {
        a,
        b,
        out: out.clone(),
        scales: None,
        aux: aux.clone(),
        problem,
        fallback: match epilogue {
            Epilogue::None => QueuedFallback::Matmul(trans_a, trans_b),
            // Burn's matmul would not apply the epilogue: the caller falls back.
            Epilogue::Gelu | Epilogue::GeluAux | Epilogue::DGelu => QueuedFallback::NotQueued,
        },
        beta: 0.0,
        order: order(),
        caller: std::thread::current().id(),
    })?;
    Ok((out, aux))
}

/// `op(a) op(b)` (+ `acc`) written in f32 on cuBLASLt (bf16/f16/f32 operands, f32 accumulation),
/// or why not, with `acc` handed back untouched. With `acc` (contiguous f32 `[m, n]` that nothing
/// else holds: [`CubeTensor::can_mut`]) the product is added into `acc`'s memory (beta = 1) and
/// `acc` is returned; otherwise a new tensor.
#[allow(clippy::type_complexity, clippy::result_large_err)]
pub(crate) fn gemm_f32(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    trans_a: bool,
    trans_b: bool,
    acc: Option<CubeTensor<CudaRuntime>>,
) -> Result<CubeTensor<CudaRuntime>, (Refused, Option<CubeTensor<CudaRuntime>>)> {
    use sys::cudaDataType::CUDA_R_32F;
    let Some((dt, compute)) = data_type(a.dtype) else {
        return Err((Refused::NotApplicable, acc));
    };
    let (ad, _) = dims2(&a);
    let (bd, _) = dims2(&b);
    let ([m, k, n], _) = super::dims(ad, bd, trans_a, trans_b);
    if m == 0 || n == 0 || k == 0 || library().is_err() || a.device != b.device {
        return Err((Refused::NotApplicable, acc));
    }
    if let Some(c) = &acc {
        let (cd, cs) = dims2(c);
        if c.dtype != DType::F32 || cd != [m, n] || cs != [n, 1] || !c.can_mut() {
            return Err((Refused::NotApplicable, acc));
        }
    }
    let (a, la) = operand(a, trans_a);
    let (b, lb) = operand(b, trans_b);
    let beta = if acc.is_some() { 1.0 } else { 0.0 };
    let given = acc.is_some();
    let out = acc.unwrap_or_else(|| {
        empty_device_contiguous_dtype(
            a.client.clone(),
            a.device.clone(),
            Shape::new([m, n]),
            DType::F32,
        )
    });
    let problem = Problem {
        types: [dt, dt, CUDA_R_32F],
        compute,
        scale_modes: None,
        m,
        n,
        k,
        a: la,
        b: lb,
        align: [0; 3],
        epilogue: Epilogue::None,
    };
    let done = execute(Job {
        a,
        b,
        out: out.clone(),
        scales: None,
        aux: None,
        problem,
        // Not queued: a refused call hands `acc` back unchanged, for the caller's fallback.
        fallback: QueuedFallback::NotQueued,
        beta,
        order: order(),
        caller: std::thread::current().id(),
    });
    match done {
        Ok(()) => Ok(out),
        Err(why) => Err((why, given.then_some(out))),
    }
}

/// The record of the algorithms timed in this process (or read from a record and used), for
/// [`read_record`] in a later process; `None` when there are none or cuBLASLt is not loaded.
pub(crate) fn record() -> Option<String> {
    recorded::text(library().ok()?)
}

/// Reads a record written by [`record`]: its problems then take the recorded algorithms instead
/// of timing them. How many it holds, or why it was refused (another cuBLASLt release).
pub(crate) fn read_record(text: &str) -> Result<usize, String> {
    recorded::read(text, library()?)
}

/// How many problems in this process took an algorithm read with [`read_record`].
pub(crate) fn record_used() -> usize {
    recorded::used()
}

/// Forgets every plan and every algorithm timed or read, as in a new process (for tests of the
/// record), once the GEMMs queued so far were issued.
pub(crate) fn forget_algorithms() {
    drain_queues();
    device::forget_plans();
    recorded::forget();
}

/// Whether nothing else holds `t`'s buffer ([`CubeTensor::can_mut`]), asked again after the GEMMs
/// queued on its device were issued if something does: a queued GEMM holds its operands and its
/// output until CubeCL's device thread issues it, so the output of a GEMM queued a moment ago
/// looks shared. Waits for the device thread only for a CUDA tensor that looks shared. In the
/// `stream` GEMM order (`BURNMIX_GEMM_ORDER`, or `same` where CubeCL's stream cannot be found) a
/// GEMM keeps its tensors until the GPU has run it, so its output still looks shared after this.
pub(crate) fn can_mut_once_issued<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    if t.can_mut() {
        return true;
    }
    match as_cuda(t) {
        Some(cuda) => {
            drain_queue(&cuda.device);
            t.can_mut()
        }
        None => false,
    }
}

/// GEMMs that were sent to cuBLASLt on this thread and ran on another path (a refused problem,
/// a failed launch): the one-line warnings, counted. Tests read it to tell the fast path from a
/// fallback that computes the same numbers.
pub(crate) fn fallbacks_on_this_thread() -> usize {
    // Queued GEMMs that failed fell back on CubeCL's device thread; wait until every GEMM queued
    // so far has been issued, then add those this thread asked for.
    drain_queues();
    let queued = QUEUED_FALLBACKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .and_then(|m| m.get(&std::thread::current().id()).copied())
        .unwrap_or(0);
    FALLBACKS.with(|c| c.get()) + queued
}
