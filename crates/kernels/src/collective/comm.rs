//! The NCCL communicator of a process group: the library check, the unique id, joining, the first
//! error and the abort, with NCCL's own text for its errors.

use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result as drv, sys as dsys};
use cudarc::nccl::{result as nccl, sys as nsys};

/// The bytes of NCCL's unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// NCCL's version (e.g. 22703 for 2.27.3), or why the library cannot be loaded.
pub fn library() -> Result<i32, String> {
    static STATUS: OnceLock<Result<i32, String>> = OnceLock::new();
    STATUS
        .get_or_init(|| {
            // SAFETY: only tries to open the library by its candidate names.
            if !unsafe { nsys::is_culib_present() } {
                return Err(format!(
                    "no NCCL library was found (looked for {} on the library path); install NCCL (the libnccl2 package, or the nvidia-nccl wheel) and make it visible under one of those names",
                    cudarc::get_lib_name_candidates("nccl").join(", ")
                ));
            }
            nccl::get_nccl_version().map_err(|e| format!("ncclGetVersion: {}", describe(&e, None)))
        })
        .clone()
}

/// A new NCCL unique id, drawn on one rank and handed to every rank of the group.
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], String> {
    library()?;
    let id =
        nccl::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {}", describe(&e, None)))?;
    Ok(id.internal.map(|c| c as u8))
}

/// NCCL's name and text for `e`, with the communicator's last error where there is one.
pub(super) fn describe(e: &nccl::NcclError, comm: Option<nsys::ncclComm_t>) -> String {
    // SAFETY: NCCL returns static strings (or strings it keeps for the communicator).
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let mut s = format!(
        "{:?} ({})",
        e.0,
        text(unsafe { nsys::ncclGetErrorString(e.0) })
    );
    if let Some(comm) = comm {
        let last = text(unsafe { nsys::ncclGetLastError(comm) });
        if !last.is_empty() {
            s.push_str(": ");
            s.push_str(&last);
        }
    }
    s
}

/// A joined communicator and what its calls need.
pub(super) struct Comm {
    pub(super) raw: nsys::ncclComm_t,
    pub(super) rank: usize,
    pub(super) world: usize,
    /// The CUDA device's index (CubeCL's device).
    pub(super) device: usize,
    /// The device's primary context, CubeCL's.
    pub(super) ctx: dsys::CUcontext,
    /// The communicator's own stream: for overlapped calls, and for calls whose CubeCL stream
    /// could not be found.
    pub(super) own_stream: dsys::CUstream,
    /// Recorded on CubeCL's stream before an overlapped call, which the own stream waits for.
    pub(super) inputs_ready: dsys::CUevent,
    /// Recorded on the own stream when CubeCL's stream is to wait for the overlapped calls.
    pub(super) overlapped_done: dsys::CUevent,
    /// The buffers of the overlapped calls issued since CubeCL's stream last waited for them,
    /// held so that CubeCL's pool does not hand their memory to its own work meanwhile.
    pub(super) in_flight: Mutex<Vec<burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>>>,
    /// Per slot of CubeCL's stream pool: its stream, or why it could not be found.
    pub(super) streams: Mutex<HashMap<usize, Result<dsys::CUstream, String>>>,
    /// The slots of CubeCL's stream pool, once read.
    pub(super) pool_slots: Mutex<Option<Result<usize, String>>>,
    /// Bytes received by this rank's all-gathers, counted as they are issued.
    pub(super) gathered_bytes: AtomicU64,
    /// The first error; once set, no call is issued.
    first_error: Mutex<Option<String>>,
    aborted: AtomicBool,
}

// SAFETY: the raw handles are plain CUDA/NCCL objects usable from any thread once the context is
// current; calls are issued from CubeCL's device thread only, and `ncclCommAbort` is the one call
// NCCL allows from another thread while the communicator is in use.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Joins the group (`ncclCommInitRank`) on device `device`, in CubeCL's primary context.
    pub(super) fn join(
        device: usize,
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world: usize,
    ) -> Result<Self, String> {
        library()?;
        // CubeCL's client initialises the driver and the device's primary context.
        let _ = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(
            &cubecl::cuda::CudaDevice::new(device),
        );
        let at = |what: &str, e: drv::DriverError| format!("{what} on GPU {device}: {e:?}");
        // SAFETY: the id is 128 bytes as NCCL wrote them; `comm` is written by a successful init.
        unsafe {
            let dev = drv::device::get(device as i32).map_err(|e| at("cuDeviceGet", e))?;
            let ctx =
                drv::primary_ctx::retain(dev).map_err(|e| at("cuDevicePrimaryCtxRetain", e))?;
            drv::ctx::set_current(ctx).map_err(|e| at("cuCtxSetCurrent", e))?;
            let own_stream = drv::stream::create(drv::stream::StreamKind::NonBlocking)
                .map_err(|e| at("cuStreamCreate", e))?;
            let event = || {
                drv::event::create(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| at("cuEventCreate", e))
            };
            let (inputs_ready, overlapped_done) = (event()?, event()?);
            let uid = nsys::ncclUniqueId {
                internal: id.map(|b| b as c_char),
            };
            let mut raw = MaybeUninit::uninit();
            nccl::comm_init_rank(raw.as_mut_ptr(), world as i32, uid, rank as i32).map_err(|e| {
                format!(
                    "NCCL could not join rank {rank} of {world} on GPU {device} (ncclCommInitRank): {}",
                    describe(&e, None)
                )
            })?;
            Ok(Self {
                raw: raw.assume_init(),
                rank,
                world,
                device,
                ctx,
                own_stream,
                inputs_ready,
                overlapped_done,
                in_flight: Mutex::new(Vec::new()),
                streams: Mutex::new(HashMap::new()),
                pool_slots: Mutex::new(None),
                first_error: Mutex::new(None),
                gathered_bytes: AtomicU64::new(0),
                aborted: AtomicBool::new(false),
            })
        }
    }

    /// The first error, if any.
    pub(super) fn error(&self) -> Option<String> {
        self.first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records `why` (the first error is kept) and aborts the communicator, so that the other
    /// ranks' calls fail instead of waiting for this one.
    pub(super) fn fail(&self, why: String) {
        self.first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(why.clone());
        self.abort(&why);
    }

    /// Aborts the communicator once; later calls are not issued.
    pub(super) fn abort(&self, why: &str) {
        self.first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(|| format!("the process group was aborted: {why}"));
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the communicator is live; abort is allowed while calls are in flight.
            let _ = unsafe { nccl::comm_abort(self.raw) };
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the last clone of the group is gone, so no call of this process is issued
            // any more; the ones issued finish first (their streams are in this context). Abort,
            // not destroy: it does not wait for ranks that may already have exited.
            unsafe {
                if drv::ctx::set_current(self.ctx).is_ok() {
                    let _ = drv::ctx::synchronize();
                }
                let _ = nccl::comm_abort(self.raw);
            }
        }
        // SAFETY: no call records or waits on the events any more (CUDA releases an event whose
        // recorded work is still pending once that work completes).
        unsafe {
            if drv::ctx::set_current(self.ctx).is_ok() {
                let _ = drv::event::destroy(self.inputs_ready);
                let _ = drv::event::destroy(self.overlapped_done);
            }
        }
    }
}
