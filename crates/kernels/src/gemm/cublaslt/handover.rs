//! The `Stream` order's hand-over between CubeCL's stream and the GEMMs' own stream: the flag
//! words, CubeCL's one-thread signalling and waiting kernels, and the GEMM stream's PTX kernels.

use std::ffi::c_void;

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::driver::{result as drv, sys as dsys};

/// Stores `value` into `flag[0]` (CubeCL's side of the hand-over to the GEMM's stream).
#[cube(launch_unchecked)]
pub(super) fn gemm_signal(flag: &mut Tensor<Atomic<u32>>, value: u32) {
    if ABSOLUTE_POS == 0 {
        flag[0].store(value);
    }
}

/// Spins until `flag[1] == value` (the GEMM's stream writes it after the GEMM). The atomic load
/// is a read-modify-write on CUDA, so it is never hoisted out of the loop.
#[cube(launch_unchecked)]
pub(super) fn gemm_wait(flag: &mut Tensor<Atomic<u32>>, value: u32) {
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
pub(super) const WAIT_PTX: &str = "\
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

pub(super) struct Flags {
    /// Holding the tensor keeps its allocation (and so `ptr`) alive.
    pub(super) tensor: CubeTensor<CudaRuntime>,
    pub(super) ptr: u64,
    pub(super) seq: u32,
    /// `burnmix_gemm_wait` from [`WAIT_PTX`].
    pub(super) wait: dsys::CUfunction,
    /// `burnmix_gemm_post` from [`WAIT_PTX`].
    pub(super) post: dsys::CUfunction,
    /// CubeCL gives each host thread its own stream, and the hand-over orders one stream only:
    /// GEMMs from other threads are host-synchronised.
    pub(super) thread: std::thread::ThreadId,
}

impl Flags {
    /// Runs on CubeCL's device thread (its CubeCL calls run at once there); `caller` is the host
    /// thread whose stream the flags order.
    pub(super) fn new(
        like: &CubeTensor<CudaRuntime>,
        caller: std::thread::ThreadId,
    ) -> Result<Self, String> {
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
    pub(super) unsafe fn launch(
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
