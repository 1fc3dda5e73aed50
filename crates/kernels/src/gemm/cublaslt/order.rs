//! Which order the GEMMs take with CubeCL's work ([`Order`]), fixed at the first GEMM, and the
//! switches that change it.

use std::sync::OnceLock;

pub(crate) use crate::settings::GemmOrder as Order;

impl Order {
    /// Whether the flags order the GEMM on the GPU.
    pub(super) fn uses_flags(self) -> bool {
        self == Order::Stream
    }
    /// Whether the host never waits for the GEMM (`Same`, `Stream`).
    pub(super) fn on_gpu(self) -> bool {
        self != Order::Host
    }
}

/// Set once CubeCL's stream could not be found for a GEMM in the `Same` order: that GEMM, and
/// every later one from a stream that cannot be found, takes the `Stream` order instead.
pub(super) static SAME_UNAVAILABLE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

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
pub(super) fn fp8_order() -> Order {
    static ORDER: OnceLock<Order> = OnceLock::new();
    // Not set apart: the order the other GEMMs fixed.
    *ORDER.get_or_init(|| crate::settings::read(|s| s.fp8_gemm_order).unwrap_or_else(order))
}

/// Diagnostic ([`crate::settings::Settings::gemm_hold`] off): the GPU order does not hold a GEMM's
/// tensors until it has run (see the module docs), which shows the race that the holding prevents.
pub(super) fn hold_tensors() -> bool {
    crate::settings::read(|s| s.gemm_hold)
}
