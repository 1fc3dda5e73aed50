//! The CUDA profiler's capture range: `cuProfilerStart` and `cuProfilerStop` on a device's primary
//! context, the one CubeCL runs on. A profiler told to wait for the application
//! (`ncu --profile-from-start off`, `nsys profile --capture-range=cudaProfilerApi`) records only
//! the kernels launched between the two calls; without a profiler attached both do nothing.
//!
//! CubeCL launches from its device thread, in the order work was queued: wait for the device
//! (`Backend::sync`) before either call, so that the range holds exactly the work queued between
//! them.

use cudarc::driver::sys;

use crate::cuda_context::with_primary_context;

/// Opens the capture range on CUDA device `device` (its index).
pub fn start(device: usize) -> Result<(), String> {
    // SAFETY: no arguments; the device's primary context is current during the call.
    call(device, "cuProfilerStart", || unsafe {
        sys::cuProfilerStart()
    })
}

/// Closes the capture range on CUDA device `device` (its index).
pub fn stop(device: usize) -> Result<(), String> {
    // SAFETY: as for `start`.
    call(device, "cuProfilerStop", || unsafe {
        sys::cuProfilerStop()
    })
}

fn call(device: usize, name: &str, f: impl FnOnce() -> sys::CUresult) -> Result<(), String> {
    match with_primary_context(device, f)? {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        err => Err(format!("{name} on CUDA device {device}: {err:?}")),
    }
}
