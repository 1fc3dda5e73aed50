//! How a tensor's values fit a floating-point format, in one read of the tensor: the largest
//! finite magnitude, how many nonzero finite values lie below the format's smallest normal number
//! (held as subnormals, with fewer significant bits, or flushed to zero), how many are nonzero and
//! how many are not finite (inf or NaN).
//!
//! [`crate::format_stats`] leaves per-cube partial rows on the device, so that the statistics of
//! many tensors come back in one transfer; [`FormatStats::from_rows`] combines one tensor's rows on
//! the host.
//!
//! [`crate::format_probe`] measures a gradient as the backward produces it: the identity in the
//! forward, whose backward node takes the statistics of the gradient flowing through it into a
//! [`ProbeSink`](crate::probe::ProbeSink) and passes the gradient on unchanged, so nothing is kept for later.

mod backward;
pub(crate) mod forward;
pub(crate) mod kernel;

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};

/// Columns of a partial row: `[amax, below normal, nonzero, not finite]`.
pub const COLUMNS: usize = 4;

/// A tensor's statistics against a format, combined from its partial rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FormatStats {
    /// Largest finite `|x|` (0 when there is none).
    pub amax: f64,
    /// Nonzero finite values with `|x| < min_normal`.
    pub below_normal: u64,
    /// Nonzero finite values.
    pub nonzero: u64,
    /// Infinite or NaN values.
    pub not_finite: u64,
    /// Elements of the tensor.
    pub elements: u64,
}

impl FormatStats {
    /// Combines the partial rows (`COLUMNS` values each, as [`crate::format_stats`] returns them)
    /// of a tensor of `elements` elements.
    pub fn from_rows(rows: &[f32], elements: usize) -> Self {
        let mut s = FormatStats {
            amax: 0.0,
            below_normal: 0,
            nonzero: 0,
            not_finite: 0,
            elements: elements as u64,
        };
        for r in rows.chunks_exact(COLUMNS) {
            s.amax = s.amax.max(r[0] as f64);
            s.below_normal += r[1] as u64;
            s.nonzero += r[2] as u64;
            s.not_finite += r[3] as u64;
        }
        s
    }

    /// Share of the nonzero finite values below the smallest normal number.
    pub fn underflow(&self) -> f64 {
        self.below_normal as f64 / self.nonzero.max(1) as f64
    }

    /// Share of all values that are not finite.
    pub fn not_finite_share(&self) -> f64 {
        self.not_finite as f64 / self.elements.max(1) as f64
    }
}

/// Plain-Burn statistics of `x` (any float dtype) as one partial row `[1, COLUMNS]` in f32.
pub fn reference<B: BurnBackend>(x: Tensor<B, 2>, min_normal: f64) -> Tensor<B, 2> {
    let x = x.cast(FloatDType::F32);
    let finite = x.clone().is_finite();
    let abs = x.abs().mask_fill(finite.clone().bool_not(), 0.0);
    let amax = if abs.shape().num_elements() == 0 {
        Tensor::zeros([1], (&abs.device(), burn::tensor::DType::F32))
    } else {
        abs.clone().max()
    };
    let nonzero = abs.clone().greater_elem(0.0);
    let below = nonzero.clone().bool_and(abs.lower_elem(min_normal));
    let count = |b: Tensor<B, 2, burn::tensor::Bool>| b.int().sum().float().cast(FloatDType::F32);
    Tensor::cat(
        vec![amax, count(below), count(nonzero), count(finite.bool_not())],
        0,
    )
    .reshape([1, COLUMNS as i32])
}

/// A probe on a tensor's gradient: its name in the records, the smallest normal number of the
/// format it is judged against, and the sink.
#[derive(Clone, Debug)]
pub struct FormatProbe {
    pub name: String,
    pub min_normal: f64,
    pub sink: crate::probe::ProbeSink,
}

/// Takes the gradient records of [`crate::format_probe`] out of `sink` (those of backend `B`, the
/// backend without autodiff) as `(name, partial rows, elements)`, in the order the backward made
/// them; other samples stay.
pub fn take_records<B: BurnBackend>(
    sink: &crate::probe::ProbeSink,
) -> Vec<(String, Tensor<B, 2>, usize)> {
    crate::probe::take::<Tensor<B, 2>>(sink)
}

/// Format statistics on a backend ([`crate::format_stats`]). The default runs [`reference`];
/// `CubeBackend` overrides it with one kernel launch. It works on plain tensors (gradients
/// already computed), so `Autodiff` keeps the default.
pub trait FormatStatsOps: BurnBackend {
    /// Partial rows `[rows, COLUMNS]` (f32) of `x`'s statistics against `min_normal`.
    fn format_stats(x: FloatTensor<Self>, min_normal: f64) -> FloatTensor<Self> {
        let (x, _) = crate::primitive::as_2d::<Self>(x);
        crate::primitive::prim(reference(x, min_normal))
    }

    /// `x` unchanged ([`crate::format_probe`]). `Autodiff` over the kernels' backends records the
    /// statistics of `x`'s gradient in its backward; the default, for a backend without autodiff
    /// (nothing flows back) or `Autodiff` over a reference backend, records nothing.
    fn format_probe(x: FloatTensor<Self>, _probe: &FormatProbe) -> FloatTensor<Self> {
        x
    }

    /// Whether [`FormatStatsOps::format_probe`] records on this backend.
    fn format_probe_records() -> bool {
        false
    }
}
