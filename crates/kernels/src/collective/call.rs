//! One collective call ([`Call`]) and how it is issued: queued on CubeCL's device thread, then, on
//! that thread, issued on CubeCL's stream for the caller (or, where that stream cannot be found,
//! on the communicator's own stream between two synchronisations). An overlapped call runs on the
//! communicator's own stream once CubeCL's stream has reached it, beside CubeCL's later work,
//! until [`wait_overlapped`] makes CubeCL's stream wait for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{result as drv, sys as dsys};
use cudarc::nccl::{result as nccl, sys as nsys};

use super::comm::{describe, Comm};
use super::ReduceOp;
use crate::cuda_stream::{find_cubecl_stream, FindError};

/// Which collective.
#[derive(Clone, Copy, Debug)]
pub(super) enum Kind {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    /// The reduction lands on rank `root` only.
    Reduce {
        op: ReduceOp,
        root: usize,
    },
    /// Rank `root`'s buffer to every rank.
    Broadcast {
        root: usize,
    },
}

/// A call on dense one-dimensional buffers: `send` of the call's input elements, `recv` of its
/// output's (the same buffer for an all-reduce, which runs in place).
pub(super) struct Call {
    pub(super) kind: Kind,
    pub(super) send: CubeTensor<CudaRuntime>,
    pub(super) recv: CubeTensor<CudaRuntime>,
    /// Run beside CubeCL's later work, on the communicator's own stream.
    pub(super) overlapped: bool,
}

/// The collectives' service on CubeCL's device thread (as the GEMMs', `gemm/cublaslt/queue.rs`):
/// a call queued there runs after every CubeCL task queued before it, and the caller does not
/// wait.
struct CollectiveService;

impl cubecl_common::device::DeviceService for CollectiveService {
    fn init(_: cubecl_common::device::DeviceId) -> Self {
        CollectiveService
    }
    fn utilities(&self) -> cubecl_common::device::ServerUtilitiesHandle {
        Arc::new(())
    }
}

/// The service on each device's thread, by device index.
static RUNNERS: crate::device_thread::Runners<CollectiveService> = Mutex::new(Vec::new());

/// Queues `call` on its device's thread. A call on a tensor of another device than the
/// communicator's, or after an error, is not issued (the error is recorded).
pub(super) fn issue(comm: &Arc<Comm>, call: Call) {
    issue_group(comm, vec![call]);
}

/// Queues `calls` on their device's thread as one NCCL group (`ncclGroupStart` .. `ncclGroupEnd`:
/// one launch for all of them), every one overlapped or every one in order. Not issued at all if
/// one of them is on another device than the communicator's, or after an error.
pub(super) fn issue_group(comm: &Arc<Comm>, calls: Vec<Call>) {
    let Some(first) = calls.first() else {
        return;
    };
    if comm.error().is_some() {
        return;
    }
    if let Some(other) = calls
        .iter()
        .flat_map(|c| [&c.send, &c.recv])
        .find(|t| t.device.index != comm.device)
    {
        comm.fail(format!(
            "kernels::collective: a tensor on GPU {} was given to the process group of GPU {}",
            other.device.index, comm.device
        ));
        return;
    }
    debug_assert!(calls.iter().all(|c| c.overlapped == first.overlapped));
    let gathered: u64 = calls
        .iter()
        .filter(|c| matches!(c.kind, Kind::AllGather))
        .map(|c| (c.recv.meta.shape().num_elements() * c.recv.dtype.size()) as u64)
        .sum();
    comm.gathered_bytes.fetch_add(gathered, Ordering::Relaxed);
    let runner = crate::device_thread::runner(&RUNNERS, &first.send.device);
    let comm = comm.clone();
    runner.submit(move |_| {
        if comm.error().is_some() {
            return;
        }
        match run(&comm, &calls) {
            Ok(Issued::Overlapped) => {
                let mut held = comm.in_flight.lock().unwrap_or_else(|p| p.into_inner());
                for call in calls {
                    held.push(call.send);
                    held.push(call.recv);
                }
            }
            Ok(Issued::InOrder) => {}
            Err(why) => comm.fail(why),
        }
    });
    // CubeCL's device thread takes its queue in batches: without this the call would wait for
    // later tasks to fill one (the caller still does not wait).
    runner.flush_queue();
}

/// Queues, on `like`'s device thread, the wait of CubeCL's stream for the overlapped calls issued
/// so far: CubeCL's work queued after it (reading their results, or reusing their memory) runs
/// once they have finished. Nothing to do when none is in flight.
pub(super) fn wait_overlapped(comm: &Arc<Comm>, like: CubeTensor<CudaRuntime>) {
    let runner = crate::device_thread::runner(&RUNNERS, &like.device);
    let comm = comm.clone();
    runner.submit(move |_| {
        let held = std::mem::take(&mut *comm.in_flight.lock().unwrap_or_else(|p| p.into_inner()));
        if held.is_empty() {
            return;
        }
        // SAFETY: on CubeCL's device thread; the event and both streams are live. The held
        // buffers are released only once CubeCL's stream waits for the calls that use them.
        let waited = unsafe {
            drv::ctx::set_current(comm.ctx)
                .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))
                .and_then(|()| cubecl_stream(&comm, &like))
                .and_then(|cubecl| {
                    drv::event::record(comm.overlapped_done, comm.own_stream)
                        .and_then(|()| {
                            drv::stream::wait_event(
                                cubecl,
                                comm.overlapped_done,
                                dsys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                            )
                        })
                        .map_err(|e| {
                            format!("kernels::collective: waiting for the overlapped calls: {e:?}")
                        })
                })
        };
        if let Err(why) = waited {
            // Abort first, which ends the calls in flight (a peer may never join them); then the
            // buffers must outlive them: wait on the host.
            comm.fail(why);
            // SAFETY: the communicator's stream is live.
            let _ = unsafe { drv::stream::synchronize(comm.own_stream) };
        }
        drop(held);
    });
    runner.flush_queue();
}

/// Where a call was issued.
enum Issued {
    /// On CubeCL's stream, in its order (or finished, on the communicator's stream).
    InOrder,
    /// On the communicator's stream, behind an event on CubeCL's: its buffers are held until
    /// [`wait_overlapped`].
    Overlapped,
}

/// Set once CubeCL's stream could not be found for a call (warned once).
static OWN_STREAM_WARNED: AtomicBool = AtomicBool::new(false);

/// Issues `calls` (one or more, one NCCL group) on CubeCL's device thread, where CubeCL's own
/// calls run at once.
fn run(comm: &Comm, calls: &[Call]) -> Result<Issued, String> {
    let first = &calls[0];
    // SAFETY: the pointers are CubeCL's live allocations of the buffers' sizes, held (the calls'
    // tensors and resources) until the calls are issued on CubeCL's stream, in CubeCL's order, or
    // have finished on the communicator's stream.
    unsafe {
        drv::ctx::set_current(comm.ctx).map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let res = |t: &CubeTensor<CudaRuntime>| {
            t.client
                .get_resource(t.handle.clone())
                .map_err(|e| format!("kernels::collective: CubeCL resource: {e:?}"))
        };
        // Taken on the caller's CubeCL stream (this task runs under its stream id), which CubeCL
        // first orders behind any other of its streams that last wrote these buffers.
        let mut resources = Vec::with_capacity(calls.len());
        for call in calls {
            resources.push((res(&call.send)?, res(&call.recv)?));
        }
        let (stream, own) = match cubecl_stream(comm, &first.send) {
            Ok(s) => (s, false),
            Err(why) => {
                if !OWN_STREAM_WARNED.swap(true, Ordering::Relaxed) {
                    eprintln!("warning: kernels::collective: CubeCL's CUDA stream was not found ({why}); collectives synchronise with CubeCL's work from the host instead, which is slower");
                }
                // Everything CubeCL queued before (the inputs, earlier users of the output's
                // memory) has finished once its stream is synchronised.
                cubecl::future::block_on(first.send.client.sync())
                    .map_err(|e| format!("kernels::collective: CubeCL sync: {e:?}"))?;
                (comm.own_stream, true)
            }
        };
        let overlapped = first.overlapped && !own;
        let stream = if overlapped {
            // The inputs are written once CubeCL's stream reaches this point.
            drv::event::record(comm.inputs_ready, stream)
                .and_then(|()| {
                    drv::stream::wait_event(
                        comm.own_stream,
                        comm.inputs_ready,
                        dsys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                })
                .map_err(|e| format!("kernels::collective: ordering an overlapped call: {e:?}"))?;
            comm.own_stream
        } else {
            stream
        };
        let grouped = calls.len() > 1;
        if grouped {
            nccl::group_start().map_err(|e| {
                format!(
                    "NCCL ncclGroupStart failed: {}",
                    describe(&e, Some(comm.raw))
                )
            })?;
        }
        let mut issued = Ok(());
        for (call, (rs, rr)) in calls.iter().zip(&resources) {
            let (send, recv) = (rs.resource(), rr.resource());
            issued = issue_one(
                comm,
                call,
                (send.ptr, send.size),
                (recv.ptr, recv.size),
                stream,
            );
            if issued.is_err() {
                break;
            }
        }
        if grouped {
            // Ends the group even after a refusal (NCCL's groups must be balanced).
            let ended = nccl::group_end().map(|_| ()).map_err(|e| {
                format!(
                    "NCCL group of {} calls on rank {} of {} failed: {}",
                    calls.len(),
                    comm.rank,
                    comm.world,
                    describe(&e, Some(comm.raw))
                )
            });
            issued = issued.and(ended);
        }
        issued?;
        if own {
            drv::stream::synchronize(comm.own_stream).map_err(|e| {
                format!("kernels::collective: the communicator's stream failed: {e:?}")
            })?;
        }
        drop(resources);
        Ok(if overlapped {
            Issued::Overlapped
        } else {
            Issued::InOrder
        })
    }
}

/// Issues one NCCL call of `call`'s kind on `stream`, from buffer `send` into `recv` (each an
/// address and its size in bytes).
///
/// # Safety
/// On CubeCL's device thread with the context current; `send` and `recv` are live buffers, and
/// `stream` is ordered after what wrote them.
unsafe fn issue_one(
    comm: &Comm,
    call: &Call,
    (send, send_bytes): (u64, u64),
    (recv, recv_bytes): (u64, u64),
    stream: dsys::CUstream,
) -> Result<(), String> {
    let (dtype, size) = nccl_type(call.send.dtype)?;
    let send_count = call.send.meta.shape().num_elements();
    let recv_count = call.recv.meta.shape().num_elements();
    debug_assert!(
        send_bytes >= (send_count * size) as u64 && recv_bytes >= (recv_count * size) as u64
    );
    let s = stream as nsys::cudaStream_t;
    let (send, recv) = (
        send as *const std::ffi::c_void,
        recv as *mut std::ffi::c_void,
    );
    let issued = match call.kind {
        Kind::AllReduce(op) => {
            nccl::all_reduce(send, recv, send_count, dtype, nccl_op(op), comm.raw, s)
        }
        Kind::ReduceScatter(op) => {
            nccl::reduce_scatter(send, recv, recv_count, dtype, nccl_op(op), comm.raw, s)
        }
        Kind::AllGather => nccl::all_gather(send, recv, send_count, dtype, comm.raw, s),
        Kind::Reduce { op, root } => nccl::reduce(
            send,
            recv,
            send_count,
            dtype,
            nccl_op(op),
            root as i32,
            comm.raw,
            s,
        ),
        Kind::Broadcast { root } => {
            nccl::broadcast(send, recv, send_count, dtype, root as i32, comm.raw, s)
        }
    };
    issued.map(|_| ()).map_err(|e| {
        format!(
            "NCCL {:?} of {send_count} elements on rank {} of {} failed: {}",
            call.kind,
            comm.rank,
            comm.world,
            describe(&e, Some(comm.raw))
        )
    })
}

/// CubeCL's stream for the calling stream id, found once per slot of its stream pool.
///
/// # Safety
/// On CubeCL's device thread, with the device's context current.
unsafe fn cubecl_stream(
    comm: &Comm,
    like: &CubeTensor<CudaRuntime>,
) -> Result<dsys::CUstream, String> {
    let id = cubecl_common::stream_id::StreamId::current().value;
    let slot_of = |n: usize| (id % (n as u64 - 1)) as usize;
    let mut pool = comm.pool_slots.lock().unwrap_or_else(|p| p.into_inner());
    let mut streams = comm.streams.lock().unwrap_or_else(|p| p.into_inner());
    match &*pool {
        Some(Err(why)) => return Err(why.clone()),
        Some(Ok(n)) => {
            if let Some(found) = streams.get(&slot_of(*n)) {
                return found.clone();
            }
        }
        None => {}
    }
    match find_cubecl_stream(like, id, comm.ctx) {
        Ok((slots, slot, stream)) => {
            *pool = Some(Ok(slots));
            streams.insert(slot, Ok(stream));
            Ok(stream)
        }
        Err(FindError::Description(why)) => {
            *pool = Some(Err(why.clone()));
            Err(why)
        }
        Err(FindError::Slot { slots, why }) => {
            *pool = Some(Ok(slots));
            streams.insert(slot_of(slots), Err(why.clone()));
            Err(why)
        }
    }
}

fn nccl_op(op: ReduceOp) -> nsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nsys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => nsys::ncclRedOp_t::ncclAvg,
    }
}

/// NCCL's type for `dtype` and its size in bytes.
fn nccl_type(dtype: burn::tensor::DType) -> Result<(nsys::ncclDataType_t, usize), String> {
    use burn::tensor::DType;
    use nsys::ncclDataType_t as N;
    Ok(match dtype {
        DType::F32 => (N::ncclFloat32, 4),
        DType::F16 => (N::ncclFloat16, 2),
        DType::BF16 => (N::ncclBfloat16, 2),
        DType::F64 => (N::ncclFloat64, 8),
        // Integers travel in all-gathers (`Flat::Int`: FP8 codes), bytes for bytes.
        DType::I32 => (N::ncclInt32, 4),
        DType::U32 => (N::ncclUint32, 4),
        DType::I64 => (N::ncclInt64, 8),
        other => {
            return Err(format!(
                "kernels::collective: {other:?} tensors are not supported (f32, f16, bf16, f64, i32, u32, i64)"
            ))
        }
    })
}
