//! What a backend says about its device memory.

use burn::tensor::backend::Backend as BurnBackend;

/// Device memory queries. The default knows nothing; `CubeBackend` (and `Autodiff` over it)
/// reports CubeCL's memory pools.
pub trait MemoryOps: BurnBackend {
    /// Bytes the device's memory pools hold now (allocated by the backend, in use or cached for
    /// reuse, as PyTorch's `memory_reserved`), or `None` where the backend does not say.
    fn memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }
}

impl<R, F, I, BT> MemoryOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|u| u.bytes_reserved)
    }
}

impl<B: crate::KernelOps, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy>
    MemoryOps for burn::backend::Autodiff<B, C>
{
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }
}
