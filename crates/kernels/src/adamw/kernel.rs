//! Fused AdamW: one pass reads the f32 master weight, its gradient and both moments, and writes
//! the new weight, the new moments and (optionally) the weight in the compute dtype.

use cubecl::prelude::*;

/// Scalars of one AdamW step, folded on the host.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub(crate) struct AdamWScalars {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// `lr / (1 - beta1^t)`
    pub step_size: f32,
    /// `1 / sqrt(1 - beta2^t)`
    pub inv_sqrt_bc2: f32,
    /// `1 - lr * weight_decay` (1 for parameters that are not decayed)
    pub decay: f32,
}

/// `g' = g * factor[0]`; `m = b1 m + (1 - b1) g'`; `v = b2 v + (1 - b2) g'^2`;
/// `p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)`; `copy = p` in `C`.
#[cube(launch)]
pub(crate) fn adamw_kernel<G: Float, C: Float, N: Size>(
    param: &Array<Vector<f32, N>>,
    grad: &Array<Vector<G, N>>,
    m: &Array<Vector<f32, N>>,
    v: &Array<Vector<f32, N>>,
    factor: &Array<f32>,
    param_out: &mut Array<Vector<f32, N>>,
    m_out: &mut Array<Vector<f32, N>>,
    v_out: &mut Array<Vector<f32, N>>,
    copy: &mut Array<Vector<C, N>>,
    s: AdamWScalars,
    total: usize,
    #[comptime] write_copy: bool,
    #[define(G, C)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < total {
        let g = Vector::<f32, N>::cast_from(grad[i]) * Vector::new(factor[0]);
        let m1 = m[i] * Vector::new(s.beta1) + g * Vector::new(1.0 - s.beta1);
        let v1 = v[i] * Vector::new(s.beta2) + g * g * Vector::new(1.0 - s.beta2);
        let denom = v1.sqrt() * Vector::new(s.inv_sqrt_bc2) + Vector::new(s.eps);
        let p = param[i] * Vector::new(s.decay) - Vector::new(s.step_size) * m1 / denom;
        param_out[i] = p;
        m_out[i] = m1;
        v_out[i] = v1;
        if comptime!(write_copy) {
            copy[i] = Vector::cast_from(p);
        }
    }
}
