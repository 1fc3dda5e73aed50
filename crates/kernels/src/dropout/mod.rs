//! Dropout of any tensor with its mask drawn inside the kernel: `x * Z`, `Z` 0 for a dropped
//! entry and `1 / keep` for a kept one, from the Philox generator ([`crate::philox`]) keyed by a
//! seed. The backward is the same kernel on the output gradient, drawing the same mask again, so
//! nothing but the seed is kept between them (Burn's `Dropout` keeps its random tensor), and one
//! seed gives one mask on every runtime, whatever the other threads or devices draw.
//!
//! Entry `e` (its index in row-major order) takes draw `e % 8` of Philox call `e / 8`: counter
//! `(e / 8, 0, STREAM, 0)`, key the seed; word `(e % 8) / 2`, its low 16 bits for even `e`, high
//! for odd. It is kept when the draw is at least `round(p * 65536)`.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod kernel;

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorData};

use cubecl::prelude::Runtime;

use crate::philox::{philox4x32_10, DropScalarsLaunch};

/// The third counter word of elementwise dropout's Philox calls ("drop").
pub const STREAM: u32 = 0x6472_6f70;

/// Dropout's probability `p` of zeroing an entry and the seed of its mask, for
/// [`crate::dropout()`] and [`crate::flash_attention_dropout`]. One seed gives one mask; give each
/// layer, micro-batch and step its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// In [0, 1); applied in steps of 1/65536.
    pub p: f64,
    pub seed: u64,
}

impl Dropout {
    pub fn new(p: f64, seed: u64) -> Self {
        Self { p, seed }
    }

    /// Why `p` is unusable, if it is.
    pub(crate) fn problem(&self) -> Option<String> {
        (!(0.0..1.0).contains(&self.p))
            .then(|| format!("dropout p is {}; it must be in [0, 1)", self.p))
    }

    /// Draws (16-bit) below this are dropped: `round(p * 65536)`, at most 65535.
    pub fn threshold(&self) -> u32 {
        ((self.p * 65536.0).round() as u32).min(65535)
    }

    /// The probability that an entry is kept, `1 - threshold / 65536`.
    pub fn keep_probability(&self) -> f64 {
        (65536 - self.threshold()) as f64 / 65536.0
    }

    /// The factor of a kept entry, `1 / keep_probability`.
    pub fn keep_scale(&self) -> f32 {
        (65536.0 / (65536 - self.threshold()) as f64) as f32
    }

    /// Whether any entry can be dropped (`p` rounds to at least 1/65536).
    pub fn is_active(&self) -> bool {
        self.threshold() > 0
    }

    /// The seed as Philox's two key words.
    pub(crate) fn key(&self) -> (u32, u32) {
        (self.seed as u32, (self.seed >> 32) as u32)
    }
}

/// The kernels' dropout arguments: key words, threshold, keep scale; zeros when off.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DropArgs {
    pub on: bool,
    pub key0: u32,
    pub key1: u32,
    pub threshold: u32,
    pub scale: f32,
}

impl DropArgs {
    pub(crate) fn new(dropout: Option<Dropout>) -> Self {
        match dropout.filter(Dropout::is_active) {
            Some(d) => {
                let (key0, key1) = d.key();
                Self {
                    on: true,
                    key0,
                    key1,
                    threshold: d.threshold(),
                    scale: d.keep_scale(),
                }
            }
            None => Self {
                on: false,
                key0: 0,
                key1: 0,
                threshold: 0,
                scale: 1.0,
            },
        }
    }
}

impl DropArgs {
    /// The key words, threshold and keep scale as the kernels' one launch argument.
    pub(crate) fn scalars<R: Runtime>(&self) -> DropScalarsLaunch<R> {
        DropScalarsLaunch::new(self.key0, self.key1, self.threshold, self.scale)
    }
}

/// Fails `op` with the reason when `dropout`'s `p` is unusable.
pub(crate) fn check(op: &str, dropout: Option<Dropout>) {
    if let Some(problem) = dropout.and_then(|d| d.problem()) {
        crate::check::fail(op, problem);
    }
}

/// The 16-bit draw of entry `e` of a mask seeded with `seed`, on the host.
pub fn draw(seed: u64, e: usize) -> u32 {
    let words = philox4x32_10(
        [(e / 8) as u32, 0, STREAM, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    let word = words[(e % 8) / 2];
    if e.is_multiple_of(2) {
        word & 0xffff
    } else {
        word >> 16
    }
}

/// The factors [`crate::dropout()`] multiplies a tensor of `shape` by, computed on the host (f32):
/// 0 where an entry is dropped, [`Dropout::keep_scale`] where it is kept.
pub fn keep_mask<B: BurnBackend, const D: usize>(
    dropout: Dropout,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    let n: usize = shape.iter().product();
    let (threshold, scale) = (dropout.threshold(), dropout.keep_scale());
    let values: Vec<f32> = (0..n)
        .map(|e| {
            if draw(dropout.seed, e) >= threshold {
                scale
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Plain-Burn dropout with the host's mask: `x * keep_mask` in f32, returned in `x`'s dtype.
pub fn reference<B: BurnBackend, const D: usize>(
    x: Tensor<B, D>,
    dropout: Dropout,
) -> Tensor<B, D> {
    let dt = x.dtype();
    let mask = keep_mask::<B, D>(dropout, x.dims(), &x.device());
    (x.cast(FloatDType::F32) * mask).cast(dt)
}

/// Dropout on a backend ([`crate::dropout()`]). The default runs the reference; `CubeBackend`
/// overrides it with the kernel and `Autodiff` with the kernel and its backward.
pub trait DropoutOps: BurnBackend {
    fn fused_dropout(x: FloatTensor<Self>, dropout: Dropout) -> FloatTensor<Self> {
        let shape = burn::tensor::TensorMetadata::shape(&x);
        let n = shape.num_elements();
        let flat = Tensor::<Self, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
            Self::float_reshape(x, Shape::new([n])),
        ));
        Self::float_reshape(crate::primitive::prim(reference(flat, dropout)), shape)
    }
}

/// The dropout kernel's launch without autodiff, which the `Autodiff` implementation records for
/// the forward and again, on the output gradient, for the backward.
pub trait DropoutKernels: DropoutOps {
    fn dropout_apply(x: FloatTensor<Self>, dropout: Dropout) -> FloatTensor<Self>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keep rate is within 5 standard deviations of `1 - p` for several `p`, and neighbours at
    /// distances 1, 2, 8 and 4096 (and another seed) are kept together about `(1 - p)^2` of the
    /// time.
    #[test]
    fn masks_have_the_expected_statistics() {
        let n = 1 << 18;
        for p in [0.1, 0.2, 0.5, 0.9] {
            let d = Dropout::new(p, 0x5eed ^ (p * 1e4) as u64);
            let t = d.threshold();
            let kept: Vec<bool> = (0..n).map(|e| draw(d.seed, e) >= t).collect();
            let q = d.keep_probability();
            let hits = kept.iter().filter(|&&k| k).count() as f64;
            let sd = (n as f64 * q * (1.0 - q)).sqrt();
            assert!(
                (hits - n as f64 * q).abs() <= 5.0 * sd,
                "p {p}: {hits} kept of {n}"
            );
            let other: Vec<bool> = (0..n).map(|e| draw(d.seed + 1, e) >= t).collect();
            for (what, gap, b) in [
                ("next", 1, &kept),
                ("two on", 2, &kept),
                ("eight on", 8, &kept),
                ("4096 on", 4096, &kept),
                ("next seed", 0, &other),
            ] {
                let m = n - gap;
                let both = (0..m).filter(|&e| kept[e] && b[e + gap]).count() as f64;
                let (mean, var) = (m as f64 * q * q, m as f64 * q * q * (1.0 - q * q));
                assert!(
                    (both - mean).abs() <= 6.0 * var.sqrt(),
                    "p {p}, {what}: both kept {both} of {m}, expected {mean:.0}"
                );
            }
        }
    }

    #[test]
    fn threshold_and_scale_follow_p() {
        let d = Dropout::new(0.2, 7);
        assert_eq!(d.threshold(), 13107);
        assert!((d.keep_probability() - 0.8).abs() < 1e-5);
        assert!((d.keep_scale() as f64 * d.keep_probability() - 1.0).abs() < 1e-6);
        assert!(!Dropout::new(0.0, 7).is_active());
        assert!(!Dropout::new(1e-6, 7).is_active());
        assert_eq!(Dropout::new(0.9999999, 7).threshold(), 65535);
        for bad in [-0.1, 1.0, 1.5, f64::NAN] {
            assert!(Dropout::new(bad, 7).problem().is_some(), "{bad}");
        }
        assert!(Dropout::new(0.5, 7).problem().is_none());
    }
}
