//! Per-device state: the cuBLASLt handle, the GEMMs' streams and workspaces, the cached calls,
//! the `Stream` order's flags and the GEMMs it holds tensors for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{result as drv, sys as dsys};

use super::call::Call;
use super::handover::Flags;
use super::problem::Problem;
use super::WORKSPACE_BYTES;
use crate::cuda_stream::{find_cubecl_stream, FindError};

/// In-flight GEMMs held at most; past this the host waits for the oldest.
const MAX_IN_FLIGHT: usize = 4096;

/// A GEMM queued on the GEMM's stream in a GPU order: an event recorded behind it, and clones of
/// the tensors whose memory it reads or writes. While a clone lives CubeCL does not hand that
/// memory out again.
struct InFlight {
    event: dsys::CUevent,
    _tensors: Vec<CubeTensor<CudaRuntime>>,
}

/// A problem's descriptors and the algorithm its calls use.
pub(super) struct Planned {
    pub(super) call: Call,
    /// The heuristic's first choice, or the fastest of its results once they were timed
    /// (`None`: cuBLASLt has no algorithm for the problem).
    pub(super) algo: Option<sys::cublasLtMatmulAlgo_t>,
    /// `BURNMIX_GEMM_ALGO=timed`: the heuristic's results, to be timed at the problem's next call
    /// (then emptied; empty where there is one result or nothing to time, or where the algorithm
    /// was read from a record).
    pub(super) to_time: Vec<sys::cublasLtMatmulAlgo_t>,
    /// With `to_time`: the problem's key in the record of timed algorithms ([`super::recorded`]).
    pub(super) record_key: String,
}

/// Per-device state. The raw handles are only used with the device's lock held.
pub(super) struct Device {
    pub(super) ctx: dsys::CUcontext,
    /// The GPU's name (`cuDeviceGetName`), which keys the record of timed algorithms.
    pub(super) name: String,
    /// Compute capability, major.
    pub(super) major: i32,
    /// Streaming multiprocessors.
    pub(super) sms: i32,
    pub(super) handle: sys::cublasLtHandle_t,
    /// The GEMMs' own stream and its workspace (`Stream` and `Host` orders).
    pub(super) stream: dsys::CUstream,
    pub(super) workspace: dsys::CUdeviceptr,
    /// Per problem: its descriptors and algorithm.
    pub(super) calls: HashMap<Problem, Planned>,
    /// `Order::Stream`: u32 flags in a CubeCL buffer ([0]: CubeCL to the GEMM, [1]: back), their
    /// device address, and the last sequence number.
    pub(super) flags: Option<Flags>,
    /// `Order::Same`: per slot of CubeCL's stream pool, CubeCL's `CUstream` there and a
    /// workspace for it, or why the stream could not be found.
    same: HashMap<usize, Result<(dsys::CUstream, dsys::CUdeviceptr), String>>,
    /// `Order::Same`: the slots of CubeCL's stream pool (known from the first description read),
    /// or why the description could not be read.
    pool_slots: Option<Result<usize, String>>,
    /// GEMMs in the `Stream` order that may still run, oldest first.
    in_flight: std::collections::VecDeque<InFlight>,
    /// Completed events, for reuse.
    spare_events: Vec<dsys::CUevent>,
}

// SAFETY: the handles are plain CUDA objects usable from any thread once the device's context is
// current; every use goes through the `DEVICES` mutex.
unsafe impl Send for Device {}

/// Per device index: its state, or why it could not be set up (not retried).
static DEVICES: Mutex<Vec<Option<Arc<Mutex<Result<Device, String>>>>>> = Mutex::new(Vec::new());

pub(super) fn device(index: usize) -> Arc<Mutex<Result<Device, String>>> {
    let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if devices.len() <= index {
        devices.resize_with(index + 1, || None);
    }
    devices[index]
        .get_or_insert_with(|| Arc::new(Mutex::new(Device::new(index))))
        .clone()
}

/// Forgets every device's plans (descriptors and algorithms), so that each problem is planned
/// again at its next call, as in a new process.
pub(super) fn forget_plans() {
    let devices: Vec<_> = (DEVICES.lock().unwrap_or_else(|p| p.into_inner()).iter())
        .flatten()
        .cloned()
        .collect();
    for dev in &devices {
        if let Ok(dev) = dev.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            // The descriptors are read when a call is queued, not when it runs: dropping them
            // once the calls were issued is allowed.
            dev.calls.clear();
        }
    }
}

impl Device {
    fn new(index: usize) -> Result<Self, String> {
        // SAFETY: the driver was initialised by CubeCL's client (the tensors exist); the primary
        // context is the one CubeCL uses, so pointers from its allocations are valid in it.
        unsafe {
            let dev = drv::device::get(index as i32)
                .map_err(|e| format!("cuDeviceGet({index}): {e:?}"))?;
            let ctx = drv::primary_ctx::retain(dev)
                .map_err(|e| format!("cuDevicePrimaryCtxRetain: {e:?}"))?;
            drv::ctx::set_current(ctx).map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
            let name = drv::device::get_name(dev).map_err(|e| format!("cuDeviceGetName: {e:?}"))?;
            let major = drv::device::get_attribute(
                dev,
                dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
            .map_err(|e| format!("cuDeviceGetAttribute: {e:?}"))?;
            let sms = drv::device::get_attribute(
                dev,
                dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| format!("cuDeviceGetAttribute: {e:?}"))?;
            let handle = lt::create_handle().map_err(|e| format!("cublasLtCreate: {e:?}"))?;
            let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking)
                .map_err(|e| format!("cuStreamCreate: {e:?}"))?;
            let workspace = drv::malloc_sync(WORKSPACE_BYTES)
                .map_err(|e| format!("cuMemAlloc({WORKSPACE_BYTES}): {e:?}"))?;
            Ok(Self {
                ctx,
                name,
                major,
                sms,
                handle,
                stream,
                workspace,
                calls: HashMap::new(),
                flags: None,
                same: HashMap::new(),
                pool_slots: None,
                in_flight: Default::default(),
                spare_events: Vec::new(),
            })
        }
    }

    /// `Order::Same`: CubeCL's `CUstream` for the current stream id (on CubeCL's device thread,
    /// the id of the host thread that queued the task) and a workspace for GEMMs on it, or why
    /// not. Looked up once per slot of CubeCL's stream pool (a slot's stream lives as long as
    /// CubeCL's server); ids that share a slot share its stream and workspace, whose GEMMs run in
    /// that stream's order. The device's context must be current.
    pub(super) unsafe fn same_stream(
        &mut self,
        like: &CubeTensor<CudaRuntime>,
    ) -> Result<(dsys::CUstream, dsys::CUdeviceptr), String> {
        let id = cubecl_common::stream_id::StreamId::current().value;
        let slot_of = |n: usize| (id % (n as u64 - 1)) as usize;
        match &self.pool_slots {
            Some(Err(why)) => return Err(why.clone()),
            Some(Ok(n)) => {
                if let Some(found) = self.same.get(&slot_of(*n)) {
                    return found.clone();
                }
            }
            None => {}
        }
        match find_cubecl_stream(like, id, self.ctx) {
            Ok((slots, slot, stream)) => {
                self.pool_slots = Some(Ok(slots));
                let found = drv::malloc_sync(WORKSPACE_BYTES)
                    .map(|w| (stream, w))
                    .map_err(|e| format!("cuMemAlloc({WORKSPACE_BYTES}): {e:?}"));
                self.same.insert(slot, found.clone());
                found
            }
            Err(FindError::Description(why)) => {
                // Not read again: the description will not change its shape.
                self.pool_slots = Some(Err(why.clone()));
                Err(why)
            }
            Err(FindError::Slot { slots, why }) => {
                self.pool_slots = Some(Ok(slots));
                self.same.insert(slot_of(slots), Err(why.clone()));
                Err(why)
            }
        }
    }

    /// Releases the tensors of every GEMM at the front of `in_flight` whose event has completed;
    /// with `wait`, first waits for the oldest. The device's context must be current.
    unsafe fn retire(&mut self, wait: bool) {
        if wait {
            if let Some(front) = self.in_flight.front() {
                let _ = drv::event::synchronize(front.event);
            }
        }
        while let Some(front) = self.in_flight.front() {
            match drv::event::query(front.event) {
                Ok(()) => {}
                Err(drv::DriverError(dsys::CUresult::CUDA_ERROR_NOT_READY)) => break,
                // An error here is the GEMM stream's error; waiting makes sure it is over.
                Err(_) => {
                    let _ = drv::stream::synchronize(self.stream);
                }
            }
            let done = self.in_flight.pop_front().expect("front exists");
            self.spare_events.push(done.event);
        }
    }

    /// Records an event behind the work queued on the GEMM's stream so far and holds `tensors`
    /// until it completes. If no event can be recorded, waits for the GEMM's stream instead.
    pub(super) unsafe fn hold(&mut self, tensors: Vec<CubeTensor<CudaRuntime>>) {
        self.retire(self.in_flight.len() >= MAX_IN_FLIGHT);
        let event = match self.spare_events.pop() {
            Some(e) => Ok(e),
            None => drv::event::create(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
        };
        match event {
            Ok(event) => match drv::event::record(event, self.stream) {
                Ok(()) => self.in_flight.push_back(InFlight {
                    event,
                    _tensors: tensors,
                }),
                Err(_) => {
                    // Kept for reuse; recording it again replaces this failed record.
                    self.spare_events.push(event);
                    let _ = drv::stream::synchronize(self.stream);
                }
            },
            Err(_) => {
                let _ = drv::stream::synchronize(self.stream);
            }
        }
    }
}
