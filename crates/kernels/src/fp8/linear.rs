//! The FP8 linear layer and its health probes.

use burn::tensor::{Tensor, TensorPrimitive};

use super::*;
use crate::gemm::GemmOps;

/// Which GEMMs of an FP8 linear layer run in FP8, and how operands are scaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8LinearConfig {
    /// `y = x w`.
    pub fprop: bool,
    /// `dx = dy w^T`.
    pub dgrad: bool,
    /// `dw = x^T dy`.
    pub wgrad: bool,
    /// Format of `x` and `w`.
    pub forward_format: Fp8Format,
    /// Format of `dy` (E5M2 in the "hybrid" setting).
    pub grad_format: Fp8Format,
    /// Tiles (1x128 activations and gradients, 128x128 weights; see `wgrad_blocks`) or one scale
    /// per tensor.
    pub per_tensor: bool,
    /// Power-of-two scales.
    pub pow2: bool,
    /// Which wgrad operand (with 1x128 tiles) takes 128 x 128 block scales instead of 1x128 tiles
    /// along the tokens.
    pub wgrad_blocks: Fp8WgradBlocks,
}

/// The wgrad GEMM `dw = x^T dy` reads `x` and `dy` along the tokens. With 1x128 tiles both are
/// scaled per 128 tokens of each feature (cuBLASLt's "1D x 1D" block-scaled GEMM); one of them
/// may instead take one scale per 128 x 128 block ("1D x 2D", the kind fprop and dgrad run),
/// quantized in the same pass as the other orientation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Fp8WgradBlocks {
    /// Both per 1x128 tile.
    #[default]
    Neither,
    /// `x^T` per 128 x 128 block.
    Input,
    /// `dy^T` per 128 x 128 block.
    GradOutput,
}

/// Every GEMM in FP8, E4M3, 1x128 / 128x128 tiles with power-of-two scales, both wgrad operands
/// per tile ([`Fp8WgradBlocks::Neither`]; the trainer's `fp8.wgrad_blocks` defaults to `Input`).
impl Default for Fp8LinearConfig {
    fn default() -> Self {
        Self {
            fprop: true,
            dgrad: true,
            wgrad: true,
            forward_format: Fp8Format::E4M3,
            grad_format: Fp8Format::E4M3,
            per_tensor: false,
            pow2: true,
            wgrad_blocks: Fp8WgradBlocks::Neither,
        }
    }
}

impl Fp8LinearConfig {
    /// Spec of an activation (`x`) operand: as stored for fprop, transposed for wgrad.
    pub fn act_spec(&self, transpose: bool) -> QuantSpec {
        self.act_pair().oriented(transpose)
    }
    /// Spec of the weight operand.
    pub fn weight_spec(&self, transpose: bool) -> QuantSpec {
        self.spec(self.forward_format, Fp8Granularity::Block128, transpose)
    }
    /// Spec of an output-gradient (`dy`) operand: as stored for dgrad, transposed for wgrad.
    pub fn grad_spec(&self, transpose: bool) -> QuantSpec {
        self.grad_pair().oriented(transpose)
    }
    /// Both orientations of an activation, quantized in one pass.
    pub fn act_pair(&self) -> PairSpec {
        PairSpec {
            spec: self.spec(self.forward_format, Fp8Granularity::Tile1x128, false),
            transposed_blocks: self.wgrad_blocks == Fp8WgradBlocks::Input,
        }
    }
    /// Both orientations of an output gradient, quantized in one pass.
    pub fn grad_pair(&self) -> PairSpec {
        PairSpec {
            spec: self.spec(self.grad_format, Fp8Granularity::Tile1x128, false),
            transposed_blocks: self.wgrad_blocks == Fp8WgradBlocks::GradOutput,
        }
    }
    fn spec(&self, format: Fp8Format, tiles: Fp8Granularity, transpose: bool) -> QuantSpec {
        let granularity = if self.per_tensor {
            Fp8Granularity::Tensor
        } else {
            tiles
        };
        QuantSpec {
            format,
            granularity,
            pow2: self.pow2,
            transpose,
        }
    }
}

/// A layer's handle on a [`ProbeSink`](crate::probe::ProbeSink): [`fp8_linear_probed`] records
/// the FP8 health of its input as `{name}.input` and, under `Autodiff`, of its output gradient as
/// `{name}.grad_output`, each as the GEMM that consumes it quantizes it (under delayed scaling,
/// by the amax its site's history gives): a [`PendingHealth`] that stays on the device until
/// [`PendingHealth::resolve`] reads it (take them with `kernels::probe::take::<PendingHealth>`).
#[derive(Clone, Debug)]
pub struct Fp8Probe {
    pub name: String,
    pub sink: crate::probe::ProbeSink,
}

impl Fp8Probe {
    /// Records the health of `x`, the operand `what` (`"input"`, `"grad_output"`), quantized as
    /// `spec` says, from `site`'s history where it is given and `spec` is per tensor.
    pub(crate) fn record<B: Fp8Ops + GemmOps>(
        &self,
        what: &str,
        x: Tensor<B, 2>,
        spec: QuantSpec,
        site: Option<&Fp8ScaleSite>,
    ) {
        let elements = x.shape().num_elements();
        let sample = crate::probe::Sample {
            name: format!("{}.{what}", self.name),
            value: Box::new(fp8_health_pending_at(x, spec, site.map(|s| (s, what)))),
            elements,
        };
        crate::probe::record(&self.sink, sample);
    }

    /// Records the health of a projection's input `x` as its fprop GEMM quantizes it (`site`:
    /// the projection's delayed-scaling site, which only per-tensor scaling uses). The FP8 linear
    /// ops call it on the backend that runs the quantizers, where a site's histories live.
    pub(crate) fn record_input<B: Fp8Ops + GemmOps>(
        &self,
        x: Tensor<B, 2>,
        cfg: &Fp8LinearConfig,
        site: Option<&Fp8ScaleSite>,
    ) {
        self.record(role::INPUT, x, cfg.act_spec(false), site);
    }
}

/// `x [t, in] w [in, out] -> [t, out]` with the GEMMs `cfg` selects in FP8 (output in `x`'s dtype;
/// `x` and `w` must share a dtype). Under `Autodiff` the backward runs dgrad and wgrad as
/// configured.
pub fn fp8_linear<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
) -> Tensor<B, 2> {
    fp8_linear_probed(x, w, cfg, None)
}

/// [`fp8_linear`], recording the FP8 health of the input (and, under `Autodiff`, of the output
/// gradient) into `probe` when given. Each sample costs a quantization and a few reductions.
pub fn fp8_linear_probed<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    probe: Option<&Fp8Probe>,
) -> Tensor<B, 2> {
    fp8_linear_scaled(x, w, cfg, probe, None)
}

/// [`fp8_linear_probed`]; with `cfg.per_tensor` and a `site`, every operand is scaled from the
/// site's amax history (delayed scaling, see [`Fp8AmaxHistory`]) instead of its own amax. The
/// forward records the input's and weight's amaxes and the backward the output gradient's, where
/// the layer is tracked by `Autodiff` (training); an untracked forward (evaluation) records
/// nothing.
pub fn fp8_linear_scaled<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    cfg: &Fp8LinearConfig,
    probe: Option<&Fp8Probe>,
    site: Option<&Fp8ScaleSite>,
) -> Tensor<B, 2> {
    let [t, d_in] = x.dims();
    let [w_in, _] = w.dims();
    if d_in != w_in {
        panic!(
            "kernels::fp8_linear: x is [{t}, {d_in}] but w is {:?}; w must be [{d_in}, out]",
            w.dims()
        );
    }
    if x.dtype() != w.dtype() {
        panic!(
            "kernels::fp8_linear: x is {:?} but w is {:?}; cast one first",
            x.dtype(),
            w.dtype()
        );
    }
    Tensor::from_primitive(TensorPrimitive::Float(B::fp8_linear(
        x.into_primitive().tensor(),
        w.into_primitive().tensor(),
        cfg,
        probe.cloned(),
        site.filter(|_| cfg.per_tensor).cloned(),
    )))
}
