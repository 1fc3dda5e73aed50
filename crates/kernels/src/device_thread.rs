//! Work queued on CubeCL's CUDA device thread (the GEMMs, the collectives): each kind registers a
//! `DeviceService` there and keeps one handle per device, made here.

use std::sync::Mutex;

use cubecl_common::device::DeviceService;
use cubecl_common::device_handle::DeviceHandle;

/// The handles of one service, by device index.
pub(crate) type Runners<S> = Mutex<Vec<Option<DeviceHandle<S>>>>;

/// The handle of service `S` on `device`'s CubeCL thread, registered at its first use.
pub(crate) fn runner<S: DeviceService + 'static>(
    runners: &Runners<S>,
    device: &cubecl::cuda::CudaDevice,
) -> DeviceHandle<S> {
    use cubecl_common::device::Device as _;
    let mut runners = runners.lock().unwrap_or_else(|p| p.into_inner());
    if runners.len() <= device.index {
        runners.resize_with(device.index + 1, || None);
    }
    runners[device.index]
        .get_or_insert_with(|| DeviceHandle::new(device.to_id()))
        .clone()
}
