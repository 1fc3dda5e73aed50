//! What a backend says about its device memory.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

/// Device memory queries. The default knows nothing; `CubeBackend` (and `Autodiff` over it)
/// reports CubeCL's memory pools.
pub trait MemoryOps: BurnBackend {
    /// Bytes the device's memory pools hold now (allocated by the backend, in use or cached for
    /// reuse, as PyTorch's `memory_reserved`), or `None` where the backend does not say.
    fn memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }
}

impl<R, F, I, BT> MemoryOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|u| u.bytes_reserved)
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
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        CubeBackend::<R, F, I, BT>::memory_reserved(device)
    }
}
