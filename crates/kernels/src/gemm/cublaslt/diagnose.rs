//! A diagnostic of the `Stream` order's hand-over, run by the tests.

use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::driver::{result as drv, sys as dsys};

use super::device::device;
use super::handover::{gemm_wait, Flags};
use super::queue::runner;

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
