//! The primary context of a CUDA device (the one CubeCL runs on), made current on the caller's
//! thread for the driver calls that need a current context: encoding TMA tensor maps, the
//! profiler's capture range.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::sys;

/// Runs `f` with the device's primary context (the one CubeCL uses) current on this thread, then
/// makes the thread's earlier context (or none) current again: the driver refuses such calls
/// without a current context, a caller's thread has none of its own (CubeCL's calls
/// run on its device thread), and a context left current would change what the caller's own
/// CUDA calls act on.
pub(crate) fn with_primary_context<T>(device: usize, f: impl FnOnce() -> T) -> Result<T, String> {
    use cudarc::driver::result as drv;
    let earlier = drv::ctx::get_current().map_err(|e| format!("cuCtxGetCurrent: {e:?}"))?;
    let primary = primary_context(device)?;
    // SAFETY: both contexts are live: the primary one is retained for the process's life, the
    // earlier one was current on this thread a moment ago (null: none).
    unsafe {
        drv::ctx::set_current(primary).map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let result = f();
        drv::ctx::set_current(earlier.unwrap_or(std::ptr::null_mut()))
            .map_err(|e| format!("cuCtxSetCurrent (restoring the caller's context): {e:?}"))?;
        Ok(result)
    }
}

/// The device's primary context, retained once per device for the process's life.
fn primary_context(device: usize) -> Result<sys::CUcontext, String> {
    use cudarc::driver::result as drv;
    static CONTEXTS: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());
    let mut contexts = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&ctx) = contexts.get(&device) {
        return Ok(ctx as sys::CUcontext);
    }
    // SAFETY: the driver was initialised by CubeCL's client (callers hold a tensor or a model on
    // the device); the retained context is never released.
    let ctx = unsafe {
        let dev =
            drv::device::get(device as i32).map_err(|e| format!("cuDeviceGet({device}): {e:?}"))?;
        drv::primary_ctx::retain(dev).map_err(|e| format!("cuDevicePrimaryCtxRetain: {e:?}"))?
    };
    contexts.insert(device, ctx as usize);
    Ok(ctx)
}
