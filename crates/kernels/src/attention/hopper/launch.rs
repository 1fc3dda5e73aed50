//! The Hopper attention kernels' launches, queued on CubeCL's CUDA device thread: the tensor maps
//! need the buffers' device addresses, which only that thread knows. Asked for from the caller,
//! each address would be a blocking round trip to it (three or four per attention call); queued
//! there, they are read at once and the caller does not wait.

use std::sync::{Arc, Mutex};

use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::tensor_map::MapOf;
use crate::cuda_source::{launch, CudaSource};
use crate::device_thread::{runner, Runners};

/// One launch: the kernel's buffers in order, the tensor maps of the first `maps.len()` of them
/// but for their addresses, the `Info` words after the maps, the kernel and its grid.
pub(super) struct Launch {
    pub(super) tensors: Vec<CubeTensor<CudaRuntime>>,
    pub(super) maps: Vec<MapOf>,
    pub(super) words: Vec<u64>,
    pub(super) kernel: CudaSource,
    pub(super) cubes: (u32, u32, u32),
}

/// The Hopper kernels' service on CubeCL's device thread.
struct HopperService;

impl cubecl_common::device::DeviceService for HopperService {
    fn init(_: cubecl_common::device::DeviceId) -> Self {
        HopperService
    }
    fn utilities(&self) -> cubecl_common::device::ServerUtilitiesHandle {
        Arc::new(())
    }
}

static RUNNERS: Runners<HopperService> = Mutex::new(Vec::new());

/// Queues `job` on its device's CubeCL thread, in order with CubeCL's own tasks, without waiting.
pub(super) fn queue(job: Launch) {
    let runner = runner(&RUNNERS, &job.tensors[0].device);
    runner.submit(move |_| job.run());
    // CubeCL's device thread takes its queue 32 tasks at a time: the launch would otherwise wait
    // for later tasks to fill the batch.
    runner.flush_queue();
}

impl Launch {
    /// Reads the addresses (on the caller's CubeCL stream: the task runs under its stream id),
    /// completes the `Info` words and launches the kernel.
    fn run(self) {
        let mut info = Vec::with_capacity(64);
        for (t, map) in self.tensors.iter().zip(&self.maps) {
            // The caller encoded the same map at a stand-in address as aligned as this one, so
            // neither step fails while the buffers live. If one did, the output would never be
            // written: a panic here would be caught by CubeCL's device thread and logged only, so
            // the process stops instead.
            let words = t
                .client
                .get_resource(t.handle.clone())
                .map_err(|e| format!("CubeCL did not give a live buffer's address: {e:?}"))
                .and_then(|r| map.encode(r.resource().ptr));
            match words {
                Ok(words) => info.extend(words),
                Err(why) => {
                    eprintln!("error: kernels::attention: a Hopper attention kernel's launch failed after it was queued: {why}");
                    std::process::abort();
                }
            }
        }
        info.extend(&self.words);
        // The kernel's `Info` is 64-byte aligned: its size is a multiple of 8 words.
        info.resize(info.len().next_multiple_of(8), 0);
        // The mapped tensors are passed as buffers too (the kernel reads them through the maps),
        // so that CubeCL orders the launch after their writers.
        let buffers = self
            .tensors
            .iter()
            .map(|t| t.handle.clone().binding())
            .collect();
        launch(
            &self.tensors[0].client,
            self.kernel,
            self.cubes,
            buffers,
            info,
        );
    }
}
