//! What a backend says about its device memory, and an optional trace of it through a step.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// Bytes of device memory a backend's pools account for at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUse {
    /// Held by live tensors (PyTorch's `memory_allocated`). Allocation happens when an op is
    /// queued, so this is the memory of the work queued so far, whether or not it ran.
    pub in_use: u64,
    /// Allocated from the device by the pools, in use or cached for reuse (PyTorch's
    /// `memory_reserved`). CubeCL's pools take memory in pages (on CUDA up to a quarter of the
    /// device for one page) and free them only on request, so this is at least `in_use` and
    /// grows in steps.
    pub reserved: u64,
}

/// Device memory queries. The default knows nothing; `CubeBackend` (and `Autodiff` over it)
/// reports CubeCL's memory pools.
pub trait MemoryOps: BurnBackend {
    /// The pools' bytes in use and reserved now, or `None` where the backend does not say.
    fn memory_use(_device: &Self::Device) -> Option<MemoryUse> {
        None
    }

    /// Bytes the device's memory pools hold now ([`MemoryUse::reserved`]).
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        Self::memory_use(device).map(|u| u.reserved)
    }
}

impl<R, F, I, BT> MemoryOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn memory_use(device: &Self::Device) -> Option<MemoryUse> {
        R::client(device).memory_usage().ok().map(|u| MemoryUse {
            in_use: u.bytes_in_use,
            reserved: u.bytes_reserved,
        })
    }
}

impl<R, F, I, BT, C> MemoryOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
    fn memory_use(device: &Self::Device) -> Option<MemoryUse> {
        CubeBackend::<R, F, I, BT>::memory_use(device)
    }
}

/// With the `memory_trace` setting on (`BURNMIX_MEMORY_TRACE=1`, [`crate::settings`]), prints one
/// line to stderr: `memory | <what>: in use X GiB, reserved Y GiB, host +T ms` (nothing where the
/// backend does not report its memory), T the host's time since the first traced line. For finding
/// where in a step memory peaks, and where the host waits for the device while it queues a step
/// (the work is queued asynchronously, so T runs ahead of the device unless something waits);
/// `what` is only formed when tracing.
pub fn trace<B: MemoryOps>(device: &B::Device, what: impl FnOnce() -> String) {
    if !crate::settings::read(|s| s.memory_trace) {
        return;
    }
    static FIRST: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let since = FIRST.get_or_init(std::time::Instant::now).elapsed();
    if let Some(u) = B::memory_use(device) {
        const GIB: f64 = (1u64 << 30) as f64;
        eprintln!(
            "memory | {}: in use {:.2} GiB, reserved {:.2} GiB, host +{:.3} ms",
            what(),
            u.in_use as f64 / GIB,
            u.reserved as f64 / GIB,
            since.as_secs_f64() * 1e3
        );
    }
}
