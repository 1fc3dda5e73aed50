//! cuBLASLt on the device pointers of CubeCL's CUDA buffers.
//!
//! Row-major `C [m, n] = op(A) [m, k] op(B) [k, n]` is, read column-major, `C^T = op(B)^T op(A)^T`:
//! cuBLASLt is called with B's buffer as its first operand and A's as its second, each with its own
//! transpose flag, and writes C^T column-major with leading dimension `n`, which is C row-major.
//!
//! Per device this keeps one cuBLASLt handle, a 32 MiB workspace (what cuBLAS uses on Hopper) per
//! stream the GEMMs run on (CubeCL's streams in the `Same` order, a stream of its own otherwise)
//! and, per problem (shape, layouts, alignments), the call's descriptors and the heuristic's
//! algorithm; they live as long as the process.
//!
//! Every call runs on CubeCL's device thread ([`GemmService`]): CubeCL 0.10 runs each device's
//! CUDA server on one thread that takes every task (launches, allocations, frees) from every host
//! thread in order, and a GEMM queued there sits between the CubeCL work queued before and after
//! it. On that thread the buffers' addresses and the hand-over kernels cost no round trips, and a
//! problem that has run on cuBLASLt before is queued without the caller waiting (the host keeps
//! running ahead of the GPU as it does for CubeCL's kernels); a new problem, an FP8 call or the
//! host order waits for the answer, so that a refusal falls back on the caller's side.
//!
//! Ordering with CubeCL's work ([`Order`]):
//! - `Same` (the default; `BURNMIX_GEMM_ORDER=same`): the GEMM is issued on CubeCL's own CUDA
//!   stream, the one CubeCL uses for the calling host thread, so it runs after CubeCL's earlier
//!   work and before its later work with nothing else on the GPU. CubeCL 0.10 has no accessor for
//!   that `CUstream`; its CUDA server's `Debug` description prints it (`sys: 0x...` in the slot of
//!   its stream pool that the thread's stream id maps to), so it is read from there once per
//!   stream ([`stream_slots`]) and checked with `cuStreamGetCtx` (it must be a live stream of the
//!   device's context). The buffers' addresses are taken through CubeCL on that stream, which
//!   makes CubeCL order any buffer last written on another of its streams first. CubeCL's memory
//!   pools are stream-ordered, so a buffer freed after the call is reused only behind the GEMM:
//!   nothing needs holding. Each such stream gets its own 32 MiB workspace. Where the stream
//!   cannot be found (another CubeCL version), the GEMMs take the `Stream` order, with a warning.
//! - `Stream` (`BURNMIX_GEMM_ORDER=stream`): no host waits. A one-thread CubeCL
//!   kernel stores a sequence number `v` into a flag word after CubeCL's earlier work; a
//!   one-thread kernel on the GEMM's stream (`burnmix_gemm_wait` in [`WAIT_PTX`]) spins until it
//!   reads `v`, the GEMM runs, a one-thread kernel behind it (`burnmix_gemm_post`) fences and
//!   stores `v` into a second flag; a one-thread CubeCL kernel spins on that flag before CubeCL's
//!   later work. (The driver's stream memory operations, `cuStreamWaitValue32` /
//!   `cuStreamWriteValue32`, refuse CubeCL's buffers, which come from stream-ordered memory pools:
//!   `CUDA_ERROR_INVALID_VALUE` on an H100 with CUDA 13.0.) Sequence numbers are only taken on
//!   the device thread, so they reach both streams in one order. GEMMs from a host thread other
//!   than the one that created the flags are host-synchronised.
//!   The flags alone are not enough: CubeCL may hand the memory of a tensor the caller dropped
//!   after the call to a new tensor and write it while the GEMM still runs (with the GPU shared
//!   between processes a small GPT's logits then moved when a later token changed). So clones of
//!   the GEMM's operands, output and scales are held, with an event recorded behind the GEMM on its
//!   stream, until that event has completed (checked at the next GEMMs, never waited for unless
//!   4096 are in flight).
//! - `Host` (`BURNMIX_GEMM_ORDER=host`): CubeCL's stream is synchronised before the GEMM, and
//!   the GEMM's stream after it. The device thread, and the caller, stall once per GEMM.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{result as drv, sys as dsys};

const WORKSPACE_BYTES: usize = 32 << 20;

pub(crate) use crate::settings::GemmOrder as Order;

impl Order {
    /// Whether the flags order the GEMM on the GPU.
    fn uses_flags(self) -> bool {
        self == Order::Stream
    }
    /// Whether the host never waits for the GEMM (`Same`, `Stream`).
    fn on_gpu(self) -> bool {
        self != Order::Host
    }
}

/// Set once CubeCL's stream could not be found for a GEMM in the `Same` order: that GEMM, and
/// every later one from a stream that cannot be found, takes the `Stream` order instead.
static SAME_UNAVAILABLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The order the bf16/f16/f32 GEMMs take: [`order`], or `Stream` once `Same` could not find
/// CubeCL's stream for some GEMM (reported for the process: the GEMMs of threads whose stream was
/// found still run on it).
pub(crate) fn effective_order() -> Order {
    match order() {
        Order::Same if SAME_UNAVAILABLE.load(std::sync::atomic::Ordering::Relaxed) => Order::Stream,
        o => o,
    }
}

/// The bf16, f16 and f32 GEMMs' order ([`crate::settings::Settings::gemm_order`]), fixed at the
/// first GEMM.
pub(crate) fn order() -> Order {
    static ORDER: OnceLock<Order> = OnceLock::new();
    *ORDER.get_or_init(|| crate::settings::read(|s| s.gemm_order))
}

/// The FP8 GEMMs' order, fixed at the first FP8 GEMM.
fn fp8_order() -> Order {
    static ORDER: OnceLock<Order> = OnceLock::new();
    // Not set apart: the order the other GEMMs fixed.
    *ORDER.get_or_init(|| crate::settings::read(|s| s.fp8_gemm_order).unwrap_or_else(order))
}

/// Diagnostic ([`crate::settings::Settings::gemm_hold`] off): the GPU order does not hold a GEMM's
/// tensors until it has run (see the module docs), which shows the race that the holding prevents.
fn hold_tensors() -> bool {
    crate::settings::read(|s| s.gemm_hold)
}

/// In-flight GEMMs held at most; past this the host waits for the oldest.
const MAX_IN_FLIGHT: usize = 4096;

/// A GEMM queued on the GEMM's stream in a GPU order: an event recorded behind it, and clones of
/// the tensors whose memory it reads or writes. While a clone lives CubeCL does not hand that
/// memory out again.
struct InFlight {
    event: dsys::CUevent,
    _tensors: Vec<CubeTensor<CudaRuntime>>,
}

/// Stores `value` into `flag[0]` (CubeCL's side of the hand-over to the GEMM's stream).
#[cube(launch_unchecked)]
fn gemm_signal(flag: &mut Tensor<Atomic<u32>>, value: u32) {
    if ABSOLUTE_POS == 0 {
        flag[0].store(value);
    }
}

/// Spins until `flag[1] == value` (the GEMM's stream writes it after the GEMM). The atomic load
/// is a read-modify-write on CUDA, so it is never hoisted out of the loop.
#[cube(launch_unchecked)]
fn gemm_wait(flag: &mut Tensor<Atomic<u32>>, value: u32) {
    if ABSOLUTE_POS == 0 {
        loop {
            if flag[1].load() == value {
                break;
            }
        }
    }
}

/// The GEMM stream's side of `Order::Stream`. `burnmix_gemm_wait`: one thread spins (acquire loads
/// at GPU scope) until the u32 at `flag` equals `value`, so the GEMM queued behind it starts after
/// CubeCL's signal. `burnmix_gemm_post`: one thread, queued behind the GEMM, fences and stores
/// `value` at `flag` (release, GPU scope) for CubeCL's waiting kernel.
/// Hand-written PTX, JIT-compiled by the driver once per device.
const WAIT_PTX: &str = "\
.version 7.0
.target sm_75
.address_size 64

.visible .entry burnmix_gemm_wait(.param .u64 flag, .param .u32 value)
{
    .reg .pred %p;
    .reg .b32 %v, %s;
    .reg .b64 %a;
    ld.param.u64 %a, [flag];
    ld.param.u32 %s, [value];
    cvta.to.global.u64 %a, %a;
SPIN:
    ld.acquire.gpu.global.u32 %v, [%a];
    setp.ne.u32 %p, %v, %s;
    @%p bra SPIN;
    ret;
}

.visible .entry burnmix_gemm_post(.param .u64 flag, .param .u32 value)
{
    .reg .b32 %s;
    .reg .b64 %a;
    ld.param.u64 %a, [flag];
    ld.param.u32 %s, [value];
    cvta.to.global.u64 %a, %a;
    fence.sc.sys;
    st.release.gpu.global.u32 [%a], %s;
    ret;
}
\0";

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

/// A row-major matrix as cuBLASLt reads it: `rows x cols` with leading dimension `ld`, transposed
/// by the GEMM when `trans`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Layout {
    rows: usize,
    cols: usize,
    ld: usize,
    trans: bool,
}

/// The layout of a 2-D tensor with the GEMM's flag, if its strides are a row-major or a
/// column-major (transposed view) matrix; `None` if it needs a copy first.
fn layout(shape: [usize; 2], strides: [usize; 2], trans: bool) -> Option<Layout> {
    let [r, c] = shape;
    let [s0, s1] = strides;
    // One row or one column: the stride along the length-1 axis is never used.
    if r == 1 && (s1 == 1 || c == 1) {
        return Some(Layout {
            rows: 1,
            cols: c,
            ld: c,
            trans,
        });
    }
    if c == 1 && r > 1 && s0 >= 1 {
        return Some(Layout {
            rows: r,
            cols: 1,
            ld: s0,
            trans,
        });
    }
    if s1 == 1 && s0 >= c {
        return Some(Layout {
            rows: r,
            cols: c,
            ld: s0,
            trans,
        });
    }
    // A transposed view: the storage is row-major [c, r], read with the opposite flag.
    if s0 == 1 && s1 >= r {
        return Some(Layout {
            rows: c,
            cols: r,
            ld: s1,
            trans: !trans,
        });
    }
    None
}

fn dims2(t: &CubeTensor<CudaRuntime>) -> ([usize; 2], [usize; 2]) {
    let (s, st) = (t.meta.shape(), t.meta.strides());
    ([s[0], s[1]], [st[0], st[1]])
}

/// The operand's layout, copying it to contiguous rows first if its strides are neither layout.
fn operand(t: CubeTensor<CudaRuntime>, trans: bool) -> (CubeTensor<CudaRuntime>, Layout) {
    let (shape, strides) = dims2(&t);
    if let Some(l) = layout(shape, strides, trans) {
        return (t, l);
    }
    let t = into_contiguous(t);
    let (shape, strides) = dims2(&t);
    let l = layout(shape, strides, trans).expect("a contiguous matrix is row-major");
    (t, l)
}

/// Everything that selects an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Problem {
    /// cuBLASLt's data types of its A (our `b`), its B (our `a`) and C/D.
    types: [sys::cudaDataType; 3],
    compute: sys::cublasComputeType_t,
    /// Scale modes of cuBLASLt's A and B (FP8).
    scale_modes: Option<[sys::cublasLtMatmulMatrixScale_t; 2]>,
    m: usize,
    n: usize,
    k: usize,
    a: Layout,
    b: Layout,
    /// Largest power of two (<= 256 bytes) dividing each of the pointers of A, B and C.
    align: [u32; 3],
}

/// Per-device state. The raw handles are only used with the device's lock held.
struct Device {
    ctx: dsys::CUcontext,
    /// Compute capability, major.
    major: i32,
    /// Streaming multiprocessors.
    sms: i32,
    handle: sys::cublasLtHandle_t,
    /// The GEMMs' own stream and its workspace (`Stream` and `Host` orders).
    stream: dsys::CUstream,
    workspace: dsys::CUdeviceptr,
    /// Per problem: its descriptors and the heuristic's algorithm (`None`: cuBLASLt has none).
    calls: HashMap<Problem, (Call, Option<sys::cublasLtMatmulAlgo_t>)>,
    /// `Order::Stream`: u32 flags in a CubeCL buffer ([0]: CubeCL to the GEMM, [1]: back), their
    /// device address, and the last sequence number.
    flags: Option<Flags>,
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

struct Flags {
    /// Holding the tensor keeps its allocation (and so `ptr`) alive.
    tensor: CubeTensor<CudaRuntime>,
    ptr: u64,
    seq: u32,
    /// `burnmix_gemm_wait` from [`WAIT_PTX`].
    wait: dsys::CUfunction,
    /// `burnmix_gemm_post` from [`WAIT_PTX`].
    post: dsys::CUfunction,
    /// CubeCL gives each host thread its own stream, and the hand-over orders one stream only:
    /// GEMMs from other threads are host-synchronised.
    thread: std::thread::ThreadId,
}

impl Flags {
    /// Runs on CubeCL's device thread (its CubeCL calls run at once there); `caller` is the host
    /// thread whose stream the flags order.
    fn new(like: &CubeTensor<CudaRuntime>, caller: std::thread::ThreadId) -> Result<Self, String> {
        let handle = like.client.create_from_slice(&[0u8; 16]);
        let tensor = CubeTensor::new_contiguous(
            like.client.clone(),
            like.device.clone(),
            Shape::new([4]),
            handle,
            DType::U32,
        );
        let ptr = tensor
            .client
            .get_resource(tensor.handle.clone())
            .map_err(|e| format!("CubeCL resource: {e:?}"))?
            .resource()
            .ptr;
        // The flags are written by `create_from_slice` on CubeCL's stream; wait for that once.
        cubecl::future::block_on(tensor.client.sync())
            .map_err(|e| format!("CubeCL sync: {e:?}"))?;
        // SAFETY: the device's context is current (the caller set it); WAIT_PTX is NUL-terminated
        // and defines `burnmix_gemm_wait`. The module lives as long as the process.
        let (wait, post) = unsafe {
            let module = drv::module::load_data(WAIT_PTX.as_ptr() as *const c_void)
                .map_err(|e| format!("cuModuleLoadData (GEMM wait kernel): {e:?}"))?;
            let function = |name: &std::ffi::CStr| {
                drv::module::get_function(module, name.to_owned())
                    .map_err(|e| format!("cuModuleGetFunction({name:?}): {e:?}"))
            };
            (
                function(c"burnmix_gemm_wait")?,
                function(c"burnmix_gemm_post")?,
            )
        };
        Ok(Self {
            tensor,
            ptr,
            seq: 0,
            wait,
            post,
            thread: caller,
        })
    }

    /// Launches one of the one-thread flag kernels on the flags with `seq`.
    ///
    /// # Safety
    /// `kernel` is `gemm_signal` or `gemm_wait`, which index only the two flags.
    unsafe fn launch(
        &self,
        kernel: unsafe fn(
            &cubecl::client::ComputeClient<CudaRuntime>,
            CubeCount,
            CubeDim,
            TensorArg<CudaRuntime>,
            u32,
        ),
        seq: u32,
    ) {
        kernel(
            &self.tensor.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            self.tensor.clone().into_tensor_arg(),
            seq,
        );
    }
}

// SAFETY: the handles are plain CUDA objects usable from any thread once the device's context is
// current; every use goes through the `DEVICES` mutex.
unsafe impl Send for Device {}

/// Per device index: its state, or why it could not be set up (not retried).
static DEVICES: Mutex<Vec<Option<Arc<Mutex<Result<Device, String>>>>>> = Mutex::new(Vec::new());

fn device(index: usize) -> Arc<Mutex<Result<Device, String>>> {
    let mut devices = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if devices.len() <= index {
        devices.resize_with(index + 1, || None);
    }
    devices[index]
        .get_or_insert_with(|| Arc::new(Mutex::new(Device::new(index))))
        .clone()
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
    unsafe fn same_stream(
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
    unsafe fn hold(&mut self, tensors: Vec<CubeTensor<CudaRuntime>>) {
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

/// Why [`find_cubecl_stream`] found no stream.
enum FindError {
    /// The server's description has no stream pool this can read.
    Description(String),
    /// The pool (of `slots` slots) was read, but the slot of this stream id holds no usable stream.
    Slot { slots: usize, why: String },
}

/// CubeCL's `CUstream` for stream id `id` on `like`'s device, with the number of slots of its
/// stream pool and the slot's index: read from the CUDA server's `Debug` description
/// ([`stream_slots`]; CubeCL 0.10 has no accessor), and checked to be a stream (not the null
/// stream) of `ctx`. Runs on CubeCL's device thread, where the server call runs at once.
fn find_cubecl_stream(
    like: &CubeTensor<CudaRuntime>,
    id: u64,
    ctx: dsys::CUcontext,
) -> Result<(usize, usize, dsys::CUstream), FindError> {
    use cubecl_common::device::Device as _;
    type Server = <CudaRuntime as cubecl::Runtime>::Server;
    let server = cubecl_common::device_handle::DeviceHandle::<Server>::new(like.device.to_id());
    let description = server
        .submit_blocking(|server| format!("{server:?}"))
        .map_err(|_| FindError::Description("CubeCL's device thread is gone".into()))?;
    let slots = stream_slots(&description).map_err(FindError::Description)?;
    // The pool holds CubeCL's streams (`max_streams` of them) and one more for its own use.
    if slots.len() < 2 {
        return Err(FindError::Description(format!(
            "a stream pool of {} slots",
            slots.len()
        )));
    }
    let n = slots.len();
    let slot_error = |why: String| FindError::Slot { slots: n, why };
    let index = (id % (n as u64 - 1)) as usize;
    let stream = slots[index].ok_or_else(|| {
        slot_error(format!(
            "stream slot {index} of {n} is empty (no CubeCL work on it yet)"
        ))
    })? as dsys::CUstream;
    if stream.is_null() {
        // The legacy default stream, which CubeCL's non-blocking streams do not wait for.
        return Err(slot_error(format!(
            "stream slot {index} holds the null stream"
        )));
    }
    let mut owner: dsys::CUcontext = std::ptr::null_mut();
    // SAFETY: `stream` is the address CubeCL's live server prints for a stream it created and
    // keeps for its lifetime; the driver only reads its context.
    unsafe { dsys::cuStreamGetCtx(stream, &mut owner) }
        .result()
        .map_err(|e| {
            slot_error(format!(
                "cuStreamGetCtx on the stream read from CubeCL: {e:?}"
            ))
        })?;
    if owner != ctx {
        return Err(slot_error(
            "the stream read from CubeCL belongs to another context".into(),
        ));
    }
    Ok((slots.len(), index, stream))
}

/// The CUDA streams of CubeCL's stream pool, slot by slot (`None`: not created), from the CUDA
/// server's `Debug` description:
/// `... streams: StreamPool { streams: [None, Some(StreamWrapper { stream: Stream { sys: 0x..., ...`.
fn stream_slots(description: &str) -> Result<Vec<Option<u64>>, String> {
    const POOL: &str = "streams: StreamPool { streams: [";
    let start = description
        .find(POOL)
        .ok_or("no stream pool in CubeCL's CUDA server description")?
        + POOL.len();
    let slot = |text: &str| -> Result<Option<u64>, String> {
        let text = text.trim();
        if text == "None" {
            return Ok(None);
        }
        const SYS: &str = "sys: 0x";
        let at = text.find(SYS).ok_or("a stream slot without `sys: 0x...`")? + SYS.len();
        let hex: String = text[at..]
            .chars()
            .take_while(char::is_ascii_hexdigit)
            .collect();
        u64::from_str_radix(&hex, 16)
            .map(Some)
            .map_err(|e| format!("a stream address `{hex}`: {e}"))
    };
    let (mut slots, mut depth, mut quoted, mut escaped, mut from) =
        (Vec::new(), 0usize, false, false, start);
    for (i, c) in description[start..].char_indices() {
        let i = start + i;
        if quoted {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => quoted = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => quoted = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' if depth > 0 => depth -= 1,
            ']' => {
                if !description[from..i].trim().is_empty() {
                    slots.push(slot(&description[from..i])?);
                }
                return Ok(slots);
            }
            ',' if depth == 0 => {
                slots.push(slot(&description[from..i])?);
                from = i + 1;
            }
            _ => {}
        }
    }
    Err("the stream pool's list does not end".into())
}

fn data_type(dtype: DType) -> Option<(sys::cudaDataType, sys::cublasComputeType_t)> {
    use sys::cublasComputeType_t::*;
    use sys::cudaDataType::*;
    match dtype {
        DType::BF16 => Some((CUDA_R_16BF, CUBLAS_COMPUTE_32F)),
        DType::F16 => Some((CUDA_R_16F, CUBLAS_COMPUTE_32F)),
        // True f32 (PyTorch's default for f32 matmuls): the fp32 recipe is the accurate
        // reference the other recipes are compared with, so its GEMMs take no TF32 shortcut.
        DType::F32 => Some((CUDA_R_32F, CUBLAS_COMPUTE_32F)),
        _ => None,
    }
}

fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        (1u64 << ptr.trailing_zeros().min(8)) as u32
    }
}

/// `op(a) op(b)` on cuBLASLt, or why not.
pub(crate) fn gemm(
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    trans_a: bool,
    trans_b: bool,
) -> Result<CubeTensor<CudaRuntime>, Refused> {
    let Some((dt, compute)) = data_type(a.dtype) else {
        return Err(Refused::NotApplicable);
    };
    let (ad, _) = dims2(&a);
    let (bd, _) = dims2(&b);
    let ([m, k, n], _) = super::dims(ad, bd, trans_a, trans_b);
    if m == 0 || n == 0 || k == 0 || library().is_err() || a.device != b.device {
        return Err(Refused::NotApplicable);
    }
    let (a, la) = operand(a, trans_a);
    let (b, lb) = operand(b, trans_b);
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::new([m, n]),
        a.dtype,
    );
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
    };
    execute(Job {
        a,
        b,
        out: out.clone(),
        scales: None,
        problem,
        views: Some((trans_a, trans_b)),
        beta: 0.0,
        order: order(),
        caller: std::thread::current().id(),
    })?;
    Ok(out)
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
    };
    let done = execute(Job {
        a,
        b,
        out: out.clone(),
        scales: None,
        problem,
        // Not queued: a refused call hands `acc` back unchanged, for the caller's fallback.
        views: None,
        beta,
        order: order(),
        caller: std::thread::current().id(),
    });
    match done {
        Ok(()) => Ok(out),
        Err(why) => Err((why, given.then_some(out))),
    }
}

/// The GEMMs' service on CubeCL's device thread.
///
/// CubeCL 0.10 runs each device's CUDA server on one thread and hands it every task (kernel
/// launches, allocations, frees, reads) from every host thread, in order. Another service
/// registered for the same device runs on that thread too, in the same queue. The GEMMs are
/// queued there ([`execute`]): a GEMM runs after every CubeCL task queued before it and before
/// every later one, the CubeCL calls it makes (the buffers' addresses, the hand-over kernels) run
/// at once on that thread instead of each being a round trip from the caller, and the caller does
/// not wait for it.
struct GemmService;

impl cubecl_common::device::DeviceService for GemmService {
    fn init(_: cubecl_common::device::DeviceId) -> Self {
        GemmService
    }
    fn utilities(&self) -> cubecl_common::device::ServerUtilitiesHandle {
        Arc::new(())
    }
}

type Runner = cubecl_common::device_handle::DeviceHandle<GemmService>;

/// The queues the GEMMs were sent to, by device index.
static RUNNERS: Mutex<Vec<Option<Runner>>> = Mutex::new(Vec::new());

/// The GEMM service on `device`'s CubeCL thread.
fn runner(device: &cubecl::cuda::CudaDevice) -> Runner {
    use cubecl_common::device::Device as _;
    let mut runners = RUNNERS.lock().unwrap_or_else(|p| p.into_inner());
    if runners.len() <= device.index {
        runners.resize_with(device.index + 1, || None);
    }
    runners[device.index]
        .get_or_insert_with(|| Runner::new(device.to_id()))
        .clone()
}

/// Waits until every GEMM queued so far, on every device, has been issued (not run).
fn drain_queues() {
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

/// Problems (per device, with the alignments their buffers' offsets imply) that have run on
/// cuBLASLt: their later calls are queued without waiting.
static PROVEN: Mutex<Option<HashSet<(usize, Problem)>>> = Mutex::new(None);

/// One cuBLASLt call and what it needs, run on CubeCL's device thread ([`GemmService`]).
struct Job {
    a: CubeTensor<CudaRuntime>,
    b: CubeTensor<CudaRuntime>,
    out: CubeTensor<CudaRuntime>,
    /// FP8: the scales of `a` and `b`.
    scales: Option<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
    /// The call; `align` is filled in from the buffers' addresses.
    problem: Problem,
    /// bf16/f16/f32: `op(a) op(b)`'s transpose flags, for Burn's matmul if a queued call fails.
    views: Option<(bool, bool)>,
    /// cuBLASLt's beta: 1 adds the product into `out`.
    beta: f32,
    order: Order,
    /// The host thread that asked for the GEMM (its CubeCL stream is the one ordered with).
    caller: std::thread::ThreadId,
}

/// The byte alignment (<= 256) a buffer's offset implies: CubeCL's CUDA allocations start at
/// 256-byte multiples, so a view's address is as aligned as its offset.
fn offset_alignment(t: &CubeTensor<CudaRuntime>) -> u32 {
    alignment(t.handle.offset_start.unwrap_or(0))
}

/// Runs `job` (one cuBLASLt call on the buffers of its tensors) on CubeCL's device thread.
///
/// A bf16/f16/f32 problem that has run on cuBLASLt before, in the GPU order, is queued and this
/// returns at once: if it fails there after all (its buffers less aligned than their offsets
/// imply and no algorithm for that), the device thread computes it with Burn's matmul into the
/// same output, with the warning, before any later CubeCL work. Every other call (a new problem,
/// FP8, the host order) waits for the device thread's answer, so the caller can fall back.
fn execute(job: Job) -> Result<(), Refused> {
    let runner = runner(&job.a.device);
    let queue =
        job.views.is_some() && job.order.on_gpu() && crate::settings::read(|s| s.gemm_queue);
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

/// Fallbacks of queued GEMMs, by the thread that asked for them.
static QUEUED_FALLBACKS: Mutex<Option<HashMap<std::thread::ThreadId, usize>>> = Mutex::new(None);

impl Job {
    /// [`Job::run`] for a queued call, which nobody waits for: if it fails, Burn's matmul computes
    /// `out` here, on the device thread, before CubeCL's later work.
    fn run_queued(self) {
        let forced = crate::settings::read(|s| s.gemm_refuse_queued);
        let (a, b, out) = (self.a.clone(), self.b.clone(), self.out.clone());
        let (views, caller, problem) = (self.views, self.caller, self.problem);
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
        let (ta, tb) = views.expect("only bf16/f16/f32 GEMMs are queued");
        let view = |t: CubeTensor<CudaRuntime>, trans: bool| {
            if trans {
                burn_cubecl::ops::permute(t, &[1, 0])
            } else {
                t
            }
        };
        let dtype = out.dtype;
        let done = burn_cubecl::kernel::matmul::matmul(
            view(a, ta),
            view(b, tb),
            Some(out),
            burn_cubecl::kernel::matmul::MatmulStrategy::Cube,
            dtype,
        );
        *QUEUED_FALLBACKS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(HashMap::new)
            .entry(caller)
            .or_default() += 1;
        match done {
            Ok(_) => warn_once(format!(
                "kernels::gemm: {why}; this GEMM runs on Burn's matmul instead"
            )),
            // Nothing can compute this product: stop rather than train on a wrong one.
            Err(e) => {
                eprintln!("error: kernels::gemm: {why}, and Burn's matmul failed too: {e:?}");
                std::process::abort();
            }
        }
    }

    /// Runs the call on CubeCL's device thread, where CubeCL's own calls run at once.
    fn run(self) -> Result<(), Refused> {
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
            let mut order = self.order;
            // `Same`: CubeCL's stream and its workspace.
            let mut same = None;
            if order == Order::Same {
                match dev.same_stream(a) {
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
            let mut problem = self.problem;
            problem.align = [alignment(pa), alignment(pb), alignment(pc)];
            debug_assert_eq!(
                out.meta.strides()[0],
                problem.n,
                "a contiguous output has rows of n"
            );
            // The descriptors and the heuristic's algorithm, once per problem. A problem cuBLASLt
            // refuses is refused before anything is queued.
            if !dev.calls.contains_key(&problem) {
                // In the GPU order CubeCL's one-thread waiting kernel stays resident on one SM
                // while the GEMM runs; cuBLASLt is told to plan for the others.
                let sm_target = (order.uses_flags() && crate::settings::read(|s| s.gemm_spare_sm))
                    .then_some(dev.sms - 1)
                    .filter(|&n| n > 0);
                let call = Call::new(&problem, sm_target)
                    .map_err(|e| Refused::Unsupported(format!("cuBLASLt descriptors: {e:?}")))?;
                if let Some((sa, sb)) = &rs {
                    // The heuristic rejects block-scaled FP8 without scale pointers (any valid
                    // address does: they are set again for each call below).
                    call.set_scales(sb.resource().ptr, sa.resource().ptr)
                        .map_err(|e| {
                            Refused::Unsupported(format!("cuBLASLt scale pointers: {e:?}"))
                        })?;
                }
                let algo = match call.heuristic(dev.handle, &problem) {
                    Ok(algo) => Some(algo),
                    // No algorithm for this problem: remembered, so it is asked once.
                    Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => None,
                    Err(e) => {
                        return Err(Refused::Unsupported(format!(
                            "cuBLASLt heuristic for {}: {e:?}",
                            describe(&problem)
                        )))
                    }
                };
                dev.calls.insert(problem, (call, algo));
            }
            let (call, algo) = &dev.calls[&problem];
            let Some(algo) = algo else {
                return Err(Refused::Unsupported(format!(
                    "cuBLASLt has no algorithm for {} (alignments {:?} bytes)",
                    describe(&problem),
                    problem.align
                )));
            };
            if let Some((sa, sb)) = &rs {
                // cuBLASLt's A scales are `b`'s, its B scales `a`'s.
                call.set_scales(sb.resource().ptr, sa.resource().ptr)
                    .map_err(|e| Refused::Unsupported(format!("cuBLASLt scale pointers: {e:?}")))?;
            }
            // What orders the GEMM with CubeCL's later work once it is issued.
            let after = match order {
                // Already in CubeCL's order.
                Order::Same => After::Nothing,
                Order::Stream => {
                    if dev.flags.is_none() {
                        dev.flags = Some(Flags::new(a, self.caller).map_err(Refused::Unsupported)?);
                    }
                    let flags = dev.flags.as_mut().expect("just created");
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
                        dev.stream,
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
                    cubecl::future::block_on(a.client.sync())
                        .map_err(|e| Refused::Unsupported(format!("CubeCL sync: {e:?}")))?;
                    After::SyncGemmStream
                }
            };
            let (alpha, beta) = (1.0f32, self.beta);
            let done = lt::matmul(
                dev.handle,
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
            .map_err(|e| {
                Refused::Unsupported(format!("cublasLtMatmul for {}: {e:?}", describe(&problem)))
            });
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
                        dev.hold(tensors);
                    }
                }
            }
            done?;
            drop((ra, rb, rc, rs));
        }
        Ok(())
    }
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

/// A cuBLASLt data type's short name.
fn type_name(t: sys::cudaDataType) -> &'static str {
    use sys::cudaDataType::*;
    match t {
        CUDA_R_16BF => "bf16",
        CUDA_R_16F => "f16",
        CUDA_R_32F => "f32",
        CUDA_R_8F_E4M3 => "e4m3",
        CUDA_R_8F_E5M2 => "e5m2",
        _ => "?",
    }
}

/// A problem in one line, for messages.
fn describe(p: &Problem) -> String {
    let [tb, ta, tc] = p.types;
    match p.scale_modes {
        None => format!(
            "{}{} [m, k, n] = [{}, {}, {}] (leading dimensions {}, {})",
            type_name(ta),
            if tc == ta {
                String::new()
            } else {
                format!(" into {}", type_name(tc))
            },
            p.m,
            p.k,
            p.n,
            p.a.ld,
            p.b.ld
        ),
        Some([sb, sa]) => format!(
            "FP8 {} x {} [m, k, n] = [{}, {}, {}] (scales {sa:?} x {sb:?}, out {})",
            type_name(ta),
            type_name(tb),
            p.m,
            p.k,
            p.n,
            type_name(tc)
        ),
    }
}

/// The descriptors of one call, destroyed on drop.
struct Call {
    desc: sys::cublasLtMatmulDesc_t,
    /// B's buffer (cuBLASLt's A), A's buffer (cuBLASLt's B), and C.
    first: sys::cublasLtMatrixLayout_t,
    second: sys::cublasLtMatrixLayout_t,
    out: sys::cublasLtMatrixLayout_t,
}

impl Call {
    /// `sm_target`: the number of SMs cuBLASLt plans the GEMM for (`SM_COUNT_TARGET`), when
    /// others are busy.
    ///
    /// # Safety
    /// Plain descriptor creation; the caller destroys `Call` before the handle. With
    /// `p.scale_modes`, the scale pointers are set per call ([`Call::set_scales`]).
    unsafe fn new(p: &Problem, sm_target: Option<i32>) -> Result<Self, lt::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t::*;
        let desc = lt::create_matmul_desc(p.compute, sys::cudaDataType::CUDA_R_32F)?;
        let mut call = Self {
            desc,
            first: std::ptr::null_mut(),
            second: std::ptr::null_mut(),
            out: std::ptr::null_mut(),
        };
        let set = |attr, value: *const c_void, size: usize| {
            lt::set_matmul_desc_attribute(desc, attr, value, size)
        };
        // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (an int32).
        let (op_a, op_b) = (p.b.trans as i32, p.a.trans as i32);
        set(
            CUBLASLT_MATMUL_DESC_TRANSA,
            &op_a as *const i32 as *const c_void,
            4,
        )?;
        set(
            CUBLASLT_MATMUL_DESC_TRANSB,
            &op_b as *const i32 as *const c_void,
            4,
        )?;
        if let Some(sms) = sm_target {
            set(
                CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                &sms as *const i32 as *const c_void,
                4,
            )?;
        }
        if let Some([mode_a, mode_b]) = p.scale_modes {
            // Per-tensor scales are the default mode (and older cuBLASLt has no mode attribute).
            let scalar = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
            if (mode_a, mode_b) != (scalar, scalar) {
                let (mode_a, mode_b) = (mode_a as i32, mode_b as i32);
                set(
                    CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                    &mode_a as *const i32 as *const c_void,
                    4,
                )?;
                set(
                    CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                    &mode_b as *const i32 as *const c_void,
                    4,
                )?;
            }
            // f32 accumulation promoted as cuBLASLt's block scaling requires (no fast
            // accumulation).
            let fast: i8 = 0;
            set(
                CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                &fast as *const i8 as *const c_void,
                1,
            )?;
        }
        let [ta, tb, td] = p.types;
        // A row-major [rows, cols] matrix with leading dimension ld is column-major [cols, rows].
        call.first = lt::create_matrix_layout(ta, p.b.cols as u64, p.b.rows as u64, p.b.ld as i64)?;
        call.second =
            lt::create_matrix_layout(tb, p.a.cols as u64, p.a.rows as u64, p.a.ld as i64)?;
        call.out = lt::create_matrix_layout(td, p.n as u64, p.m as u64, p.n as i64)?;
        Ok(call)
    }

    /// Sets the device addresses of cuBLASLt's A and B scales (FP8) for the next call.
    ///
    /// # Safety
    /// The addresses must stay valid until the call queued with them has run.
    unsafe fn set_scales(&self, sa: u64, sb: u64) -> Result<(), lt::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t::*;
        for (attr, ptr) in [
            (CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa as *const c_void),
            (CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb as *const c_void),
        ] {
            lt::set_matmul_desc_attribute(
                self.desc,
                attr,
                &ptr as *const *const c_void as *const c_void,
                std::mem::size_of::<*const c_void>(),
            )?;
        }
        Ok(())
    }

    /// cuBLASLt's first choice for this problem within the workspace and alignments.
    unsafe fn heuristic(
        &self,
        handle: sys::cublasLtHandle_t,
        p: &Problem,
    ) -> Result<sys::cublasLtMatmulAlgo_t, lt::CublasError> {
        let pref = lt::create_matmul_pref()?;
        let result = (|| {
            use sys::cublasLtMatmulPreferenceAttributes_t::*;
            let ws = WORKSPACE_BYTES as u64;
            lt::set_matmul_pref_attribute(
                pref,
                CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )?;
            // cuBLASLt's A is B's buffer and its B is A's.
            for (attr, align) in [
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align[1]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align[0]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.align[2]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align[2]),
            ] {
                lt::set_matmul_pref_attribute(
                    pref,
                    attr,
                    &align as *const u32 as *const c_void,
                    4,
                )?;
            }
            // Split-K partial sums only in f32. Otherwise cuBLASLt may add a low-precision
            // output's partial sums in that precision (the in-place and output-type reduction
            // schemes): on an H200 it split a bf16 [64, 32] x [32, 301] product 88 ways with
            // bf16 partial sums and a fifth of the entries came out wrong by up to 180 units of
            // the bound in `kernel_cases::gemm_rounding`. The heuristic's choices at GPT-2's
            // shapes already reduce in f32, so they are unchanged.
            if p.types[2] != sys::cudaDataType::CUDA_R_32F {
                use sys::cublasLtReductionScheme_t::*;
                let mask = CUBLASLT_REDUCTION_SCHEME_NONE as u32
                    | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
                lt::set_matmul_pref_attribute(
                    pref,
                    CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    &mask as *const u32 as *const c_void,
                    4,
                )?;
            }
            lt::get_matmul_algo_heuristic(
                handle,
                self.desc,
                self.first,
                self.second,
                self.out,
                self.out,
                pref,
            )
            .map(|r| r.algo)
        })();
        let _ = lt::destroy_matmul_pref(pref);
        result
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Call::new` and is destroyed once.
        unsafe {
            for l in [self.first, self.second, self.out] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

thread_local! {
    /// GEMMs this thread sent to cuBLASLt that ran on another path instead.
    static FALLBACKS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
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

/// A GEMM sent to cuBLASLt runs on another path: counted, and `msg` printed once per distinct
/// message.
pub(crate) fn fell_back(msg: String) {
    FALLBACKS.with(|c| c.set(c.get() + 1));
    warn_once(msg);
}

/// Prints `msg` once per distinct message.
fn warn_once(msg: String) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(msg.clone()) {
        eprintln!("warning: {msg}");
    }
}

#[cfg(test)]
mod tests {
    use super::{layout, Layout};

    #[test]
    fn layouts_of_strided_matrices() {
        // Row-major with pitched rows: ld is the row stride.
        assert_eq!(
            layout([3, 5], [8, 1], false),
            Some(Layout {
                rows: 3,
                cols: 5,
                ld: 8,
                trans: false
            })
        );
        // A transposed view of a row-major [5, 3] matrix: read the storage with the flag flipped.
        assert_eq!(
            layout([3, 5], [1, 3], false),
            Some(Layout {
                rows: 5,
                cols: 3,
                ld: 3,
                trans: true
            })
        );
        assert_eq!(
            layout([3, 5], [1, 4], true),
            Some(Layout {
                rows: 5,
                cols: 3,
                ld: 4,
                trans: false
            })
        );
        // One row or one column.
        assert_eq!(
            layout([1, 5], [0, 1], false),
            Some(Layout {
                rows: 1,
                cols: 5,
                ld: 5,
                trans: false
            })
        );
        assert_eq!(
            layout([4, 1], [2, 7], true),
            Some(Layout {
                rows: 4,
                cols: 1,
                ld: 2,
                trans: true
            })
        );
        // Broadcast rows or a non-unit inner stride need a copy.
        assert_eq!(layout([3, 5], [0, 1], false), None);
        assert_eq!(layout([3, 5], [10, 2], false), None);
    }

    /// The stream pool read from a description shaped as CubeCL 0.10's CUDA server prints it
    /// (derived `Debug` of structs of the same names and nesting, raw pointers included), with
    /// brackets, commas and quotes inside strings and nested lists around it.
    #[test]
    #[allow(dead_code)] // The structs are only printed.
    fn stream_slots_from_a_server_description() {
        use std::collections::HashMap;
        #[derive(Debug)]
        struct Stream {
            sys: *mut u8,
            memory_management_gpu: &'static str,
            errors: Vec<String>,
        }
        #[derive(Debug)]
        struct StreamWrapper {
            stream: Stream,
            cursor: u64,
            last_synced: HashMap<usize, u64>,
        }
        #[derive(Debug)]
        struct StreamPool {
            streams: Vec<Option<StreamWrapper>>,
            max_streams: usize,
        }
        #[derive(Debug)]
        struct MultiStream {
            streams: StreamPool,
            shared_bindings_pool: Vec<(u64, u64)>,
        }
        #[derive(Debug)]
        struct CudaServer {
            ctx: Vec<Option<(i32, String)>>,
            streams: MultiStream,
        }
        let wrapper = |sys: usize, note: &'static str| {
            Some(StreamWrapper {
                stream: Stream {
                    sys: sys as *mut u8,
                    memory_management_gpu: note,
                    errors: vec!["a ] in (an, error\" \\".into()],
                },
                cursor: 7,
                last_synced: HashMap::from([(1, 2)]),
            })
        };
        let server = CudaServer {
            ctx: vec![Some((1, "streams: [".into())), None],
            streams: MultiStream {
                streams: StreamPool {
                    streams: vec![
                        None,
                        wrapper(0x7f00_dead_beef, "DynamicMemoryManagement \"a[b], {c}\""),
                        None,
                        wrapper(0x55aa_0010, ""),
                    ],
                    max_streams: 3,
                },
                shared_bindings_pool: vec![(1, 2)],
            },
        };
        let description = format!("{server:?}");
        assert_eq!(
            super::stream_slots(&description),
            Ok(vec![None, Some(0x7f00_dead_beef), None, Some(0x55aa_0010)]),
            "{description}"
        );
        assert!(super::stream_slots("CudaServer { ctx: [] }").is_err());
        assert!(super::stream_slots("streams: StreamPool { streams: [None, Some(").is_err());
    }
}

/// How an FP8 operand's scales are laid out for cuBLASLt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fp8Scales {
    /// One f32 scale for the matrix (`SCALAR_32F`).
    Tensor,
    /// Per row per 128 of k (`VEC128_32F`): f32 `[k_tiles, rows]`, rows contiguous.
    Vec128,
    /// Per 128 x 128 block (`BLK128x128_32F`): f32 `[ceil(rows / 128), k_tiles4]`, k contiguous,
    /// `k_tiles4` the tile count rounded up to a multiple of 4 (zero-padded).
    Blk128,
}

/// One FP8 operand in cuBLASLt's terms: payload words `[rows, k_pad / 4]` (four E4M3 or E5M2
/// codes each, little-endian, so the bytes are the row-major `[rows, k_pad]` codes) and its scales,
/// already in the layout `scales` names.
pub(crate) struct Fp8Operand {
    pub payload: CubeTensor<CudaRuntime>,
    pub scales: CubeTensor<CudaRuntime>,
    pub e5m2: bool,
    pub layout: Fp8Scales,
    pub rows: usize,
}

/// The first cuBLASLt version with 1x128 and 128x128 FP8 block scaling (12.9, Hopper).
const BLOCK_SCALING_VERSION: usize = 120900;

/// Whether cuBLASLt's 1x128 / 128x128 block-scaled FP8 GEMM runs on `t`'s device: CUDA, a
/// cuBLASLt that has it (12.9+), and a Hopper GPU (compute capability 9.x; cuBLASLt scales FP8
/// blocks this way on Hopper only).
pub(crate) fn fp8_block_scaling_supported(t: &CubeTensor<CudaRuntime>) -> bool {
    if !library().is_ok_and(|v| v >= BLOCK_SCALING_VERSION) {
        return false;
    }
    let state = device(t.device.index);
    let state = state.lock().unwrap_or_else(|p| p.into_inner());
    state.as_ref().is_ok_and(|d| d.major == 9)
}

/// `a [m, k] x b [n, k]^T -> [m, n]` in `out` on cuBLASLt's FP8 tensor cores, both operands
/// quantized along k (padded to `k_pad`, a multiple of 128, with zero codes); or why not.
///
/// cuBLASLt's FP8 GEMM on Hopper takes the "TN" form: its A (our `b`) transposed and its B (our
/// `a`) not, both with k contiguous, which is how the payloads are stored. Its requirements,
/// checked here: not both operands E5M2; not both 128x128 blocks; either both scaled per tensor or
/// both by tiles/blocks (cuBLASLt >= 12.9); m and n multiples of 8; rows of 16-byte multiples.
pub(crate) fn fp8_gemm(
    a: Fp8Operand,
    b: Fp8Operand,
    k_pad: usize,
    out: DType,
) -> Result<CubeTensor<CudaRuntime>, Refused> {
    use sys::cublasLtMatmulMatrixScale_t::*;
    use sys::cudaDataType::*;
    let Some((dt_out, _)) = data_type(out) else {
        return Err(Refused::NotApplicable);
    };
    let version = library().map_err(|_| Refused::NotApplicable)?;
    let (m, n) = (a.rows, b.rows);
    let block = a.layout != Fp8Scales::Tensor;
    if (a.e5m2 && b.e5m2)
        || (a.layout == Fp8Scales::Blk128 && b.layout == Fp8Scales::Blk128)
        || (a.layout == Fp8Scales::Tensor) != (b.layout == Fp8Scales::Tensor)
        || (block && version < BLOCK_SCALING_VERSION)
        || m == 0
        || n == 0
        || m % 8 != 0
        || n % 8 != 0
        || k_pad == 0
        || !k_pad.is_multiple_of(128)
        || a.payload.device != b.payload.device
    {
        return Err(Refused::NotApplicable);
    }
    // The scales must be exactly what cuBLASLt reads for the layout, densely stored.
    let tiles = k_pad / 128;
    for t in [&a, &b] {
        let want = match t.layout {
            Fp8Scales::Tensor => [1, 1],
            Fp8Scales::Vec128 => [tiles, t.rows],
            Fp8Scales::Blk128 => [t.rows.div_ceil(128), tiles.div_ceil(4) * 4],
        };
        let (shape, strides) = dims2(&t.scales);
        // (The stride of a length-1 axis is never used.)
        let dense = (shape[1] == 1 || strides[1] == 1) && (shape[0] == 1 || strides[0] == want[1]);
        if t.payload.meta.shape()[0] != t.rows
            || shape != want
            || !dense
            || t.scales.dtype != DType::F32
        {
            return Err(Refused::Unsupported(format!(
                "FP8 operand of {} rows: payload {:?}, {:?} scales {:?} with strides {:?} ({:?}); expected f32 scales {want:?}, dense",
                t.rows,
                t.payload.meta.shape(),
                t.layout,
                shape,
                strides,
                t.scales.dtype
            )));
        }
    }
    let codes =
        |t: &Fp8Operand, trans: bool| -> Result<(CubeTensor<CudaRuntime>, Layout), Refused> {
            let t_payload = if t.payload.meta.strides()[1] == 1 {
                t.payload.clone()
            } else {
                into_contiguous(t.payload.clone())
            };
            let words = t_payload.meta.strides()[0];
            if t_payload.meta.shape()[1] * 4 != k_pad
                || (words * 4) % 16 != 0
                || t.payload.dtype.size() != 4
            {
                return Err(Refused::Unsupported(format!(
                    "FP8 payload {:?} of {:?} (strides {:?}) is not [rows, {}] 32-bit words",
                    t_payload.meta.shape(),
                    t_payload.dtype,
                    t_payload.meta.strides(),
                    k_pad / 4
                )));
            }
            Ok((
                t_payload,
                Layout {
                    rows: t.rows,
                    cols: k_pad,
                    ld: words * 4,
                    trans,
                },
            ))
        };
    let (pa, la) = codes(&a, false)?;
    let (pb, lb) = codes(&b, true)?;
    let mode = |l: Fp8Scales| match l {
        Fp8Scales::Tensor => CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
        Fp8Scales::Vec128 => CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
        Fp8Scales::Blk128 => CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
    };
    let format = |e5m2: bool| if e5m2 { CUDA_R_8F_E5M2 } else { CUDA_R_8F_E4M3 };
    let c = empty_device_contiguous_dtype(
        pa.client.clone(),
        pa.device.clone(),
        Shape::new([m, n]),
        out,
    );
    let problem = Problem {
        types: [format(b.e5m2), format(a.e5m2), dt_out],
        compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        scale_modes: Some([mode(b.layout), mode(a.layout)]),
        m,
        n,
        k: k_pad,
        a: la,
        b: lb,
        align: [0; 3],
    };
    execute(Job {
        a: pa,
        b: pb,
        out: c.clone(),
        scales: Some((a.scales.clone(), b.scales.clone())),
        problem,
        views: None,
        beta: 0.0,
        order: fp8_order(),
        caller: std::thread::current().id(),
    })?;
    Ok(c)
}

/// Diagnostic of the hand-over's CubeCL side: queues CubeCL's waiting kernel for a value nobody
/// has written yet, then a CubeCL copy of `probe` behind it, and reads the copy; another thread
/// writes the value after `delay`. Returns how long the read took: about `delay` when the waiting
/// kernel holds CubeCL's later work back, much less when it does not.
#[doc(hidden)]
pub fn diagnose_wait(
    probe: &CubeTensor<CudaRuntime>,
    delay: std::time::Duration,
) -> Result<std::time::Duration, String> {
    // The flags are made and advanced on CubeCL's device thread, in order with the GEMMs.
    let like = probe.clone();
    let caller = std::thread::current().id();
    let (flags_tensor, ptr, value, ctx) = runner(&probe.device)
        .submit_blocking(move |_| -> Result<_, String> {
            let state = device(like.device.index);
            let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
            let dev = state.as_mut().map_err(|e| e.clone())?;
            // SAFETY: the device's context is the primary context CubeCL uses.
            unsafe { drv::ctx::set_current(dev.ctx).map_err(|e| format!("{e:?}"))? };
            if dev.flags.is_none() {
                dev.flags = Some(Flags::new(&like, caller)?);
            }
            let flags = dev.flags.as_mut().expect("just created");
            flags.seq = flags.seq.wrapping_add(1).max(1);
            Ok((flags.tensor.clone(), flags.ptr, flags.seq, dev.ctx as usize))
        })
        .map_err(|_| "CubeCL's device thread is gone".to_string())??;
    // The releasing thread: writes flag[1] = value after `delay` (a synchronous memset).
    let release = std::thread::spawn(move || {
        std::thread::sleep(delay);
        // SAFETY: `ptr` is the live flags buffer of this device; the context is its primary one.
        unsafe {
            drv::ctx::set_current(ctx as dsys::CUcontext).map_err(|e| format!("{e:?}"))?;
            dsys::cuMemsetD32_v2(ptr + 4, value, 1)
                .result()
                .map_err(|e| format!("cuMemsetD32: {e:?}"))
        }
    });
    let start = std::time::Instant::now();
    // SAFETY: `gemm_wait` indexes only the flags.
    unsafe {
        gemm_wait::launch_unchecked::<CudaRuntime>(
            &flags_tensor.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            flags_tensor.clone().into_tensor_arg(),
            value,
        );
    }
    let copy = into_contiguous(probe.clone());
    let bytes = copy
        .client
        .read_one(copy.handle.clone())
        .map_err(|e| format!("read: {e:?}"))?;
    let took = start.elapsed();
    drop(bytes);
    release
        .join()
        .map_err(|_| "the releasing thread panicked".to_string())??;
    Ok(took)
}
