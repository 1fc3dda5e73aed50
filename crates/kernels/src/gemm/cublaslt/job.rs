//! One cuBLASLt call ([`Job`]) and how it runs on CubeCL's device thread: the order it takes, the
//! call's descriptors, the hand-over before and after it, and the call itself.

use std::ffi::c_void;

use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{result as drv, sys as dsys};

use super::call::Call;
use super::device::{device, Device, Planned};
use super::fallback::warn_once;
use super::handover::{gemm_signal, gemm_wait, Flags};
use super::order::{hold_tensors, Order, SAME_UNAVAILABLE};
use super::problem::{alignment, describe, Problem};
use super::recorded;
use super::timing::{fastest, CANDIDATES};
use super::{Refused, WORKSPACE_BYTES};
use crate::settings::GemmAlgo;

/// One cuBLASLt call and what it needs, run on CubeCL's device thread
/// ([`GemmService`](super::queue::GemmService)).
pub(super) struct Job {
    pub(super) a: CubeTensor<CudaRuntime>,
    pub(super) b: CubeTensor<CudaRuntime>,
    pub(super) out: CubeTensor<CudaRuntime>,
    /// FP8: the scales of `a` and `b`.
    pub(super) scales: Option<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
    /// The epilogue's auxiliary matrix (contiguous, `out`'s shape and dtype): written by
    /// [`Epilogue::GeluAux`](super::problem::Epilogue::GeluAux), read by `DGelu`.
    pub(super) aux: Option<CubeTensor<CudaRuntime>>,
    /// The call; `align` is filled in from the buffers' addresses.
    pub(super) problem: Problem,
    /// What computes the product if the call is queued and fails there; whether it may be queued.
    pub(super) fallback: QueuedFallback,
    /// cuBLASLt's beta: 1 adds the product into `out`.
    pub(super) beta: f32,
    pub(super) order: Order,
    /// The host thread that asked for the GEMM (its CubeCL stream is the one ordered with).
    pub(super) caller: std::thread::ThreadId,
}

/// What computes a queued call's product if cuBLASLt fails it on the device thread: nobody waits
/// for a queued call, so it cannot hand the failure back to its caller.
pub(crate) enum QueuedFallback {
    /// Never queued: the caller waits for the answer and falls back itself.
    NotQueued,
    /// bf16/f16/f32: Burn's matmul of `op(a) op(b)`, with these transpose flags.
    Matmul(bool, bool),
    /// FP8: the caller's own computation of the product into the output it is given (the
    /// operands dequantized, then Burn's matmul); `Err` says why it failed.
    Compute(Box<dyn FnOnce(CubeTensor<CudaRuntime>) -> Result<(), String> + Send>),
}

impl Job {
    /// Runs the call on CubeCL's device thread, where CubeCL's own calls run at once.
    pub(super) fn run(self) -> Result<(), Refused> {
        let state = device(self.a.device.index);
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        let dev = state
            .as_mut()
            .map_err(|e| Refused::Unsupported(format!("cuBLASLt set-up failed: {e}")))?;
        let (a, b, out) = (&self.a, &self.b, &self.out);

        // SAFETY: the pointers come from live CubeCL allocations of the sizes the layouts describe
        // (rows, cols and ld are the tensors' own shapes and strides); the GEMM is ordered after
        // CubeCL's writes of its inputs and before CubeCL's next use of its memory (host
        // synchronisation, or the flags and the tensors held until the GEMM is done).
        unsafe {
            drv::ctx::set_current(dev.ctx)
                .map_err(|e| Refused::Unsupported(format!("cuCtxSetCurrent: {e:?}")))?;
            let (order, same) = self.resolve_order(dev);
            let (stream, workspace) = same.unwrap_or((dev.stream, dev.workspace));
            // The addresses are taken on the caller's CubeCL stream (this task runs under its
            // stream id): CubeCL first orders that stream behind any other of its streams that
            // last wrote these buffers.
            let res = |t: &CubeTensor<CudaRuntime>| {
                t.client
                    .get_resource(t.handle.clone())
                    .map_err(|e| Refused::Unsupported(format!("CubeCL resource: {e:?}")))
            };
            let (ra, rb, rc) = (res(a)?, res(b)?, res(out)?);
            let (pa, pb, pc) = (ra.resource().ptr, rb.resource().ptr, rc.resource().ptr);
            let rs = match &self.scales {
                Some((sa, sb)) => Some((res(sa)?, res(sb)?)),
                None => None,
            };
            // The addresses of `a`'s and `b`'s scales (FP8), live while `rs` is held.
            let scale_ptrs = rs
                .as_ref()
                .map(|(sa, sb)| (sa.resource().ptr, sb.resource().ptr));
            let raux = self.aux.as_ref().map(res).transpose()?;
            // The epilogue's auxiliary matrix, live while `raux` is held.
            let aux_ptr = raux.as_ref().map(|r| r.resource().ptr);
            let mut problem = self.problem;
            problem.align = [alignment(pa), alignment(pb), alignment(pc)];
            if let Some(aux) = aux_ptr {
                // The heuristic reads the auxiliary matrix's alignment too.
                problem.align[2] = problem.align[2].min(alignment(aux));
            }
            debug_assert_eq!(
                out.meta.strides()[0],
                problem.n,
                "a contiguous output has rows of n"
            );
            // The descriptors and the heuristic's algorithm, once per problem. A problem cuBLASLt
            // refuses is refused before anything is queued.
            if !dev.calls.contains_key(&problem) {
                plan_call(dev, &problem, order, scale_ptrs, aux_ptr)?;
            }
            let planned = &dev.calls[&problem];
            let call = &planned.call;
            let Some(mut algo) = planned.algo else {
                return Err(Refused::Unsupported(format!(
                    "cuBLASLt has no algorithm for {} (alignments {:?} bytes)",
                    describe(&problem),
                    problem.align
                )));
            };
            if let Some((sa, sb)) = scale_ptrs {
                // cuBLASLt's A scales are `b`'s, its B scales `a`'s.
                call.set_scales(sb, sa)
                    .map_err(|e| Refused::Unsupported(format!("cuBLASLt scale pointers: {e:?}")))?;
            }
            if let Some(aux) = aux_ptr {
                call.set_aux(aux).map_err(|e| {
                    Refused::Unsupported(format!("cuBLASLt epilogue pointer: {e:?}"))
                })?;
            }
            // What orders the GEMM with CubeCL's later work once it is issued.
            let after = self.order_before(order, &mut dev.flags, dev.stream)?;
            // `BURNMIX_GEMM_ALGO=timed`: the problem's first call times the heuristic's results
            // here, where the call itself is ordered, and keeps the fastest.
            let timed = (!planned.to_time.is_empty()).then(|| {
                let out_bytes = problem.m * problem.n * out.dtype.size();
                let run = |a: &sys::cublasLtMatmulAlgo_t, target: u64| {
                    issue(
                        dev.handle,
                        call,
                        a,
                        self.beta,
                        [pa, pb, target],
                        stream,
                        workspace,
                        &problem,
                    )
                    .map_err(|e| format!("{e:?}"))
                };
                let chosen = fastest(
                    &planned.to_time,
                    &problem,
                    self.beta,
                    pc,
                    out_bytes,
                    stream,
                    run,
                );
                match chosen {
                    Ok(i) => {
                        algo = planned.to_time[i];
                        recorded::note(planned.record_key.clone(), &algo);
                    }
                    Err(why) => warn_once(format!(
                        "kernels::gemm: timing cuBLASLt's algorithms for {} failed ({why}); its heuristic's first choice is kept",
                        describe(&problem)
                    )),
                }
                algo
            });
            let done = issue(
                dev.handle,
                call,
                &algo,
                self.beta,
                [pa, pb, pc],
                stream,
                workspace,
                &problem,
            );
            if let Some(kept) = timed {
                let planned = dev.calls.get_mut(&problem).expect("planned above");
                planned.algo = Some(kept);
                planned.to_time.clear();
            }
            self.order_after(after, dev)?;
            done?;
            drop((ra, rb, rc, rs, raux));
        }
        Ok(())
    }

    /// The order this call takes and, in `Same`, CubeCL's stream and its workspace: `Stream`
    /// where CubeCL's stream cannot be found (warned once), `Host` for a GEMM in the `Stream`
    /// order from a host thread other than the one the flags order.
    ///
    /// # Safety
    /// The device's context is current.
    unsafe fn resolve_order(
        &self,
        dev: &mut Device,
    ) -> (Order, Option<(dsys::CUstream, dsys::CUdeviceptr)>) {
        let mut order = self.order;
        // `Same`: CubeCL's stream and its workspace.
        let mut same = None;
        if order == Order::Same {
            match dev.same_stream(&self.a) {
                Ok(found) => same = Some(found),
                Err(why) => {
                    if !SAME_UNAVAILABLE.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        warn_once(format!(
                            "kernels::gemm: CubeCL's CUDA stream was not found ({why}); GEMMs from streams that cannot be found are ordered with CubeCL's work through flags instead (BURNMIX_GEMM_ORDER=stream)"
                        ));
                    }
                    order = Order::Stream;
                }
            }
        }
        if order.uses_flags() && dev.flags.as_ref().is_some_and(|f| f.thread != self.caller) {
            order = Order::Host;
        }
        (order, same)
    }

    /// Orders the GEMM after CubeCL's earlier work, as `order` says: nothing in `Same` (the GEMM
    /// is on CubeCL's stream); in `Stream`, CubeCL's signal and the wait kernel on the GEMM's
    /// stream `gemm_stream` (creating `flags` at the first GEMM); in `Host`, a synchronisation of
    /// CubeCL's stream. Returns what orders the GEMM with CubeCL's later work once it is issued.
    ///
    /// # Safety
    /// The device's context is current; `gemm_stream` is the device's own GEMM stream.
    unsafe fn order_before(
        &self,
        order: Order,
        flags: &mut Option<Flags>,
        gemm_stream: dsys::CUstream,
    ) -> Result<After, Refused> {
        let after = match order {
            // Already in CubeCL's order.
            Order::Same => After::Nothing,
            Order::Stream => {
                if flags.is_none() {
                    *flags = Some(Flags::new(&self.a, self.caller).map_err(Refused::Unsupported)?);
                }
                let flags = flags.as_mut().expect("just created");
                flags.seq = flags.seq.wrapping_add(1).max(1);
                // CubeCL's stream: flag[0] = seq after everything queued so far (launched now:
                // this is CubeCL's device thread).
                flags.launch(gemm_signal::launch_unchecked::<CudaRuntime>, flags.seq);
                // The GEMM's stream: spin until flag[0] == seq.
                let (mut flag_arg, mut seq_arg) = (flags.ptr, flags.seq);
                let mut params = [
                    &mut flag_arg as *mut u64 as *mut c_void,
                    &mut seq_arg as *mut u32 as *mut c_void,
                ];
                if let Err(e) = drv::launch_kernel(
                    flags.wait,
                    (1, 1, 1),
                    (1, 1, 1),
                    0,
                    gemm_stream,
                    &mut params,
                ) {
                    // Nothing waits for CubeCL's signal: harmless.
                    return Err(Refused::Unsupported(format!(
                        "launching the GEMM-stream wait kernel: {e:?}"
                    )));
                }
                After::Flag(flags.seq)
            }
            Order::Host => {
                // Everything CubeCL queued before this GEMM (the inputs, and earlier users of
                // the output's memory) has finished once its stream is synchronised.
                cubecl::future::block_on(self.a.client.sync())
                    .map_err(|e| Refused::Unsupported(format!("CubeCL sync: {e:?}")))?;
                After::SyncGemmStream
            }
        };
        Ok(after)
    }

    /// Orders the issued GEMM before CubeCL's later work, as `after` says: in `Host` the host
    /// waits for the GEMM's stream; in `Stream` the GEMM's stream raises the flag behind the GEMM,
    /// CubeCL's waiting kernel is queued, and the GEMM's tensors are held until it has run.
    ///
    /// # Safety
    /// The device's context is current; the GEMM (or its failed issue) is the last work queued
    /// on the stream it was issued on.
    unsafe fn order_after(&self, after: After, dev: &mut Device) -> Result<(), Refused> {
        let (a, b, out) = (&self.a, &self.b, &self.out);
        match after {
            After::Nothing => {}
            After::SyncGemmStream => drv::stream::synchronize(dev.stream)
                .map_err(|e| Refused::Unsupported(format!("GEMM stream: {e:?}")))?,
            After::Flag(seq) => {
                // Completed whether or not the GEMM was queued: the GEMM's stream is already
                // waiting for `seq`, and CubeCL's next hand-over must not overtake it.
                let flags = dev.flags.as_ref().expect("created above");
                // The GEMM's stream: flag[1] = seq once the GEMM is done; CubeCL's stream
                // waits for it.
                let (mut flag_arg, mut seq_arg) = (flags.ptr + 4, seq);
                let mut params = [
                    &mut flag_arg as *mut u64 as *mut c_void,
                    &mut seq_arg as *mut u32 as *mut c_void,
                ];
                let written = drv::launch_kernel(
                    flags.post,
                    (1, 1, 1),
                    (1, 1, 1),
                    0,
                    dev.stream,
                    &mut params,
                )
                .map_err(|e| format!("launching the GEMM-stream flag kernel: {e:?}"));
                if let Err(e) = written {
                    // Without the flag CubeCL cannot wait on the GPU: wait for both streams
                    // here.
                    let _ = drv::stream::synchronize(dev.stream);
                    return Err(Refused::Unsupported(e));
                }
                flags.launch(gemm_wait::launch_unchecked::<CudaRuntime>, seq);
                if hold_tensors() {
                    let mut tensors = vec![a.clone(), b.clone(), out.clone()];
                    if let Some((sa, sb)) = &self.scales {
                        tensors.extend([sa.clone(), sb.clone()]);
                    }
                    tensors.extend(self.aux.clone());
                    dev.hold(tensors);
                }
            }
        }
        Ok(())
    }
}

/// Creates the descriptors of `problem` and asks the heuristic for its algorithm (and, with
/// `BURNMIX_GEMM_ALGO=timed`, for the results to time at the first call), remembered in
/// `dev.calls` (`None` where cuBLASLt has none, so it is asked once). `scale_ptrs`: the addresses
/// of `a`'s and `b`'s scales (FP8); `aux_ptr`: the epilogue's auxiliary matrix.
///
/// # Safety
/// The device's context is current; `scale_ptrs` and `aux_ptr` are live device addresses.
unsafe fn plan_call(
    dev: &mut Device,
    problem: &Problem,
    order: Order,
    scale_ptrs: Option<(u64, u64)>,
    aux_ptr: Option<u64>,
) -> Result<(), Refused> {
    // In the GPU order CubeCL's one-thread waiting kernel stays resident on one SM
    // while the GEMM runs; cuBLASLt is told to plan for the others.
    let sm_target = (order.uses_flags() && crate::settings::read(|s| s.gemm_spare_sm))
        .then_some(dev.sms - 1)
        .filter(|&n| n > 0);
    let call = Call::new(problem, sm_target)
        .map_err(|e| Refused::Unsupported(format!("cuBLASLt descriptors: {e:?}")))?;
    if let Some((sa, sb)) = scale_ptrs {
        // The heuristic rejects block-scaled FP8 without scale pointers (any valid
        // address does: they are set again for each call in `Job::run`).
        call.set_scales(sb, sa)
            .map_err(|e| Refused::Unsupported(format!("cuBLASLt scale pointers: {e:?}")))?;
    }
    if let Some(aux) = aux_ptr {
        // The heuristic reads the auxiliary matrix's alignment from its address.
        call.set_aux(aux)
            .map_err(|e| Refused::Unsupported(format!("cuBLASLt epilogue pointer: {e:?}")))?;
    }
    let timed = crate::settings::read(|s| s.gemm_algo) == GemmAlgo::Timed;
    let record_key = if timed {
        recorded::key(&dev.name, problem, sm_target)
    } else {
        String::new()
    };
    // An algorithm an earlier process of the run timed for this problem is taken as it is;
    // otherwise the heuristic's results (all of them to be timed, with `timed`).
    let recorded = timed
        .then(|| recorded_algo(dev.handle, &call, problem, &record_key))
        .flatten();
    let (algo, to_time) = match recorded {
        Some(algo) => (Some(algo), Vec::new()),
        None => {
            let count = if timed { CANDIDATES } else { 1 };
            let mut results = match call.heuristics(dev.handle, problem, count) {
                Ok(results) => results,
                // No algorithm for this problem: remembered, so it is asked once.
                Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => {
                    Vec::new()
                }
                Err(e) => {
                    return Err(Refused::Unsupported(format!(
                        "cuBLASLt heuristic for {}: {e:?}",
                        describe(problem)
                    )))
                }
            };
            let algo = results.first().copied();
            if results.len() < 2 {
                results.clear();
            }
            (algo, results)
        }
    };
    dev.calls.insert(
        *problem,
        Planned {
            call,
            algo,
            to_time,
            record_key,
        },
    );
    Ok(())
}

/// The algorithm an earlier process recorded for `key` ([`recorded::read`]), if cuBLASLt's check
/// accepts it for `call` (then counted as used); one it refuses is warned about, once.
///
/// # Safety
/// The device's context is current; `handle` and `call` are the device's.
unsafe fn recorded_algo(
    handle: sys::cublasLtHandle_t,
    call: &Call,
    problem: &Problem,
    key: &str,
) -> Option<sys::cublasLtMatmulAlgo_t> {
    let algo = recorded::read_for(key)?;
    match call.check(handle, &algo) {
        Ok(()) => {
            recorded::count_used();
            Some(algo)
        }
        Err(why) => {
            warn_once(format!(
                "kernels::gemm: the recorded algorithm for {} is not valid here ({why}); it is timed again",
                describe(problem)
            ));
            None
        }
    }
}

/// Queues the cuBLASLt call on `stream` with `workspace`: C = alpha op(A) op(B) + beta C with
/// alpha 1, on the buffers at `[pa, pb, pc]` (`a`'s, `b`'s and `out`'s; cuBLASLt's A is `b`'s
/// buffer and its B `a`'s, see the module docs).
///
/// # Safety
/// As in [`Job::run`]: live buffers of the sizes `problem`'s layouts describe, ordered with
/// CubeCL's work; `call` and `algo` are `problem`'s.
unsafe fn issue(
    handle: sys::cublasLtHandle_t,
    call: &Call,
    algo: &sys::cublasLtMatmulAlgo_t,
    beta: f32,
    [pa, pb, pc]: [u64; 3],
    stream: dsys::CUstream,
    workspace: dsys::CUdeviceptr,
    problem: &Problem,
) -> Result<(), Refused> {
    let alpha = 1.0f32;
    lt::matmul(
        handle,
        call.desc,
        &alpha as *const f32 as *const c_void,
        &beta as *const f32 as *const c_void,
        pb as *const c_void,
        call.first,
        pa as *const c_void,
        call.second,
        pc as *const c_void,
        call.out,
        pc as *mut c_void,
        call.out,
        algo,
        workspace as *mut c_void,
        WORKSPACE_BYTES,
        stream as sys::cudaStream_t,
    )
    .map_err(|e| Refused::Unsupported(format!("cublasLtMatmul for {}: {e:?}", describe(problem))))
}

/// What orders an issued GEMM with CubeCL's later work ([`Job::run`]).
enum After {
    /// `Same`: the GEMM is on CubeCL's stream.
    Nothing,
    /// `Host`: the host waits for the GEMM's stream.
    SyncGemmStream,
    /// `Stream`: the GEMM's stream raises this flag value, which CubeCL's stream waits for.
    Flag(u32),
}
