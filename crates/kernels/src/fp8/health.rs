//! How well a tensor fits its FP8 format: measured on the device, read when needed.

use burn::tensor::{FloatDType, Tensor, TensorPrimitive};

use super::*;
use crate::gemm::GemmOps;

/// How well a tensor fits its FP8 format under a quantization spec.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Health {
    /// Largest finite |x|.
    pub amax: f64,
    /// Share of the nonzero finite values that quantize to zero.
    pub underflow: f64,
    /// Share of the finite values clipped at the largest code of their tile (beyond the max by more
    /// than half an ulp). Zero by construction under current (amax) scaling, which maps the amax to
    /// at most the max; under delayed scaling, the values above the amax the site's history gave
    /// (a tensor that outgrew its history).
    pub saturated: f64,
}

impl Fp8Health {
    /// Combines partial rows `[amax, nonzero, underflow, saturated]` (as
    /// [`Fp8Ops::fp8_health_partials`] returns them) of a tensor of `elements` elements.
    pub fn from_rows(rows: &[f32], elements: usize) -> Self {
        let (mut amax, mut nonzero, mut under, mut sat) = (0f64, 0f64, 0f64, 0f64);
        for r in rows.chunks_exact(4) {
            amax = amax.max(r[0] as f64);
            nonzero += r[1] as f64;
            under += r[2] as f64;
            sat += r[3] as f64;
        }
        Fp8Health {
            amax,
            underflow: under / nonzero.max(1.0),
            saturated: sat / (elements.max(1) as f64),
        }
    }
}

/// An [`Fp8Health`] measured on the device and not read yet: [`PendingHealth::resolve`] reads it
/// (a small transfer, which waits for the work queued before it).
pub struct PendingHealth(Box<dyn FnOnce() -> Fp8Health + Send>);

impl PendingHealth {
    /// Reads the health back.
    pub fn resolve(self) -> Fp8Health {
        (self.0)()
    }
}

impl std::fmt::Debug for PendingHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingHealth")
    }
}

/// [`Fp8Health`] of the 2-D `x` quantized as `spec` says: the quantizer, then one kernel that
/// reads `x` and the codes once ([`Fp8Ops::fp8_health_partials`]); reading the result back waits
/// for the device.
pub fn fp8_health<B: Fp8Ops + GemmOps>(x: Tensor<B, 2>, spec: QuantSpec) -> Fp8Health {
    fp8_health_pending(x, spec).resolve()
}

/// [`fp8_health`] without waiting: the work is queued and the result read when resolved (the FP8
/// layers record their operands' health this way in the middle of a step).
pub fn fp8_health_pending<B: Fp8Ops + GemmOps>(x: Tensor<B, 2>, spec: QuantSpec) -> PendingHealth {
    fp8_health_pending_at(x, spec, None)
}

/// [`fp8_health_pending`] of `x` quantized as its GEMM quantizes it: with a delayed-scaling site
/// and role (`(site, "input")`, ...) and a per-tensor `spec`, scaled by the amax the site's history
/// gives, so values above it count as saturated; otherwise by `x`'s own amax. Records nothing into
/// the history.
pub fn fp8_health_pending_at<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    spec: QuantSpec,
    site: Option<(&Fp8ScaleSite, &str)>,
) -> PendingHealth {
    let [r, c] = x.dims();
    let q = match site.filter(|_| spec.granularity == Fp8Granularity::Tensor) {
        Some((site, role)) => site.quantize(role, x.clone(), spec, Fp8Record::No),
        None => fp8_quantize(x.clone(), spec),
    };
    let rows = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::fp8_health_partials(
        x.into_primitive().tensor(),
        q.payload.into_primitive(),
        q.scales.into_primitive().tensor(),
        &spec,
    )));
    PendingHealth(Box::new(move || {
        let rows = rows
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap_or_default();
        Fp8Health::from_rows(&rows, r * c)
    }))
}
