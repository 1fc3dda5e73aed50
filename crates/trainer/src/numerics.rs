//! How gradients fit the fp16 or bf16 format they are computed in, per projection: the share of
//! values held as subnormals (below the format's smallest normal number, so with fewer significant
//! bits, one step from being flushed to zero), the share that overflowed (inf or NaN) and the
//! largest magnitude. Measured on the device; one read-back for all tensors of a step.

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

use crate::metrics::LayerHealth;

/// Smallest positive normal number and largest finite value of `dtype`.
pub fn limits(dtype: FloatDType) -> (f64, f64) {
    match dtype {
        FloatDType::F16 => (2f64.powi(-14), 65504.0),
        FloatDType::BF16 => (2f64.powi(-126), 3.389_531_389_251_535_5e38),
        _ => (f32::MIN_POSITIVE as f64, f32::MAX as f64),
    }
}

/// `[amax, underflow, not finite]` of `x` as held in `format` (see [`LayerHealth`]), still on the
/// device.
pub fn stats<B: Backend>(x: Tensor<B, 2>, format: FloatDType) -> Tensor<B, 1> {
    let (min_normal, _) = limits(format);
    let n = x.shape().num_elements().max(1) as f64;
    let x = x.cast(FloatDType::F32);
    let finite = x.clone().is_finite();
    let abs = x.abs().mask_fill(finite.clone().bool_not(), 0.0);
    let amax = abs.clone().max();
    let nonzero = abs.clone().greater_elem(0.0);
    let subnormal = nonzero.clone().bool_and(abs.lower_elem(min_normal));
    let count = |b: Tensor<B, 2, burn::tensor::Bool>| b.int().sum().float().cast(FloatDType::F32);
    let nonzero = count(nonzero).clamp_min(1.0);
    let underflow = count(subnormal) / nonzero;
    let not_finite = count(finite.bool_not()).div_scalar(n);
    Tensor::cat(vec![amax, underflow, not_finite], 0)
}

/// Reads back the [`stats`] of named tensors in one transfer.
pub fn read<B: Backend>(named: Vec<(String, Tensor<B, 1>)>) -> Vec<LayerHealth> {
    if named.is_empty() {
        return Vec::new();
    }
    let (names, stats): (Vec<String>, Vec<Tensor<B, 1>>) = named.into_iter().unzip();
    let values: Vec<f64> = Tensor::cat(stats, 0)
        .into_data()
        .convert::<f64>()
        .into_vec()
        .unwrap_or_default();
    names
        .into_iter()
        .zip(values.chunks(3))
        .map(|(layer, v)| LayerHealth {
            layer,
            amax: v[0],
            underflow: v[1],
            saturated: v[2],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    #[test]
    fn shares_of_subnormal_and_non_finite_values() {
        let device = Default::default();
        let x = Tensor::<NdArray, 2>::from_data(
            TensorData::new(
                vec![
                    0.0f32,
                    1e-6,
                    -3e-5,
                    1.0,
                    f32::INFINITY,
                    -2.0,
                    7e-5,
                    f32::NAN,
                ],
                [2, 4],
            ),
            &device,
        );
        // Nonzero finite: 1e-6, -3e-5, 1, -2, 7e-5; below f16's 2^-14 = 6.1e-5: 1e-6 and -3e-5.
        let h = read(vec![
            ("f16".to_string(), stats(x.clone(), FloatDType::F16)),
            ("bf16".to_string(), stats(x, FloatDType::BF16)),
        ]);
        assert_eq!(h[0].layer, "f16");
        assert_eq!(h[0].amax, 2.0);
        assert!((h[0].underflow - 2.0 / 5.0).abs() < 1e-6, "{:?}", h[0]);
        assert!((h[0].saturated - 2.0 / 8.0).abs() < 1e-6, "{:?}", h[0]);
        // bf16 has f32's exponent range: none of these is subnormal.
        assert_eq!(h[1].underflow, 0.0);
        assert_eq!(limits(FloatDType::F16), (2f64.powi(-14), 65504.0));
    }
}
