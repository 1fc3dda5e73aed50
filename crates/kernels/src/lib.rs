//! Fused CubeCL kernels for transformer training on Burn, each with its backward pass and a
//! plain-Burn reference.
//!
//! | op | function | reference |
//! |---|---|---|
//! | RMSNorm | [`rms_norm`] | [`rms_norm::reference`] |
//! | residual add + RMSNorm | [`add_rms_norm`] | [`rms_norm::add_reference`] |
//! | SwiGLU (two tensors / packed) | [`swiglu`], [`swiglu_packed`] | [`activation::swiglu_reference`], [`activation::swiglu_packed_reference`] |
//! | exact GELU | [`gelu`] | [`activation::gelu_reference`] |
//! | GELU, tanh approximation | [`gelu_tanh`] | [`activation::gelu_tanh_reference`] |
//! | rotary embedding | [`rope`] (tables: [`rope::tables`]) | [`rope::reference`] |
//! | softmax cross-entropy + z-loss | [`cross_entropy`] | [`cross_entropy::reference`] |
//! | token embedding (atomic scatter backward on CUDA) | [`embedding()`] | [`embedding::reference`] |
//! | AdamW step writing the compute copy | [`adamw_step`] | [`adamw::reference`] |
//! | gradient accumulation in f32 | [`add_as_f32`] | [`reduce::add_as_f32_reference`] |
//! | scale by a device scalar and cast, in one pass | [`scale`] | [`reduce::scale_reference`] |
//! | sum of many tensors in f32, fixed order | [`sum_f32`] | [`reduce::sum_f32_reference`] |
//! | how values fit a format (amax, subnormal, non-finite counts) in one read | [`format_stats()`] | [`format_stats::reference`] |
//! | FlashAttention (forward + backward) | [`flash_attention`] | [`attention::reference`] |
//! | dropout with an in-kernel mask (drawn again in the backward) | [`dropout()`] | [`dropout::reference`] |
//! | RoPE + FlashAttention of a packed qkv projection (gradient written packed) | [`flash_attention_qkv`] | [`attention::reference_qkv`] |
//! | FlashAttention with dropout on the probabilities (Philox mask, drawn again in the backward) | [`flash_attention_dropout`] | [`attention::reference_dropout`] |
//! | FP8 quantizer (1x128, 128x128, per tensor) | [`fp8_quantize`] | [`fp8::reference`] |
//! | FP8 quantizer of both orientations in one read | [`fp8_quantize_pair`] | [`fp8_quantize`] twice |
//! | FP8 health (amax, underflow, saturation) of a quantized tensor | [`fp8_health`], [`fp8_health_pending`], [`fp8_health_pending_at`] (delayed scaling) | [`fp8::reference::health`] |
//! | GEMM with transpose flags, linear layer (cuBLASLt on CUDA) | [`gemm()`], [`linear`] | [`gemm::reference`] (Burn's matmul) |
//! | RMSNorm (+ residual add) or activation, then a linear layer, the norm's or activation's output recomputed in the backward | [`recompute::rms_norm_linear`], [`recompute::add_rms_norm_linear`], [`recompute::activation_linear`] | the composition of the ops |
//! | FP8 GEMM and linear layer (experimental) | [`fp8_gemm`], [`fp8_linear`] | dequantize, then matmul |
//! | FP8 MLP, the activation (GELU, packed SwiGLU) quantized where it is computed | [`fp8_mlp_scaled`], [`fp8_gelu_mlp`] | [`fp8_linear`], the activation, [`fp8_linear`] |
//! | GELU (tanh) MLP without biases, the GELU and its derivative in cuBLASLt's GEMM epilogues | [`gelu_tanh_mlp`] | [`mlp::reference`]; equals [`mlp::composed`] |
//!
//! Beside the ops, [`collective`] joins processes (one GPU each) in an NCCL communicator and runs
//! all-reduce, reduce-scatter and all-gather on CubeCL's CUDA stream, for data parallelism across
//! processes and hosts.
//!
//! The functions take ordinary Burn tensors of any backend that implements [`Backend`]:
//! - `CubeBackend` (Burn's `Cuda` and `Wgpu` without the `fusion` feature) runs the kernels;
//! - `Autodiff` over it records their backward kernels, so `loss.backward()` uses them;
//! - Burn's `NdArray` (CPU) and `Autodiff<NdArray>` run the references;
//! - any other backend can opt in with [`reference_backend!`]`(MyBackend)`, which runs the
//!   references.
//!
//! All kernels compute in f32 and store in the input's dtype (f32, f16 or bf16; bf16 needs CUDA).
//! Inputs of any shape and strides are accepted (non-contiguous ones are copied first, except where
//! an op says it reads strides); vector loads are used when the row length allows. Bad arguments
//! panic with a message naming the op, the argument, what was given and what is supported.
//!
//! ```no_run
//! use burn::backend::{Autodiff, Wgpu};
//! use burn::tensor::{Distribution, Tensor};
//!
//! type B = Autodiff<Wgpu>;
//! let dev = Default::default();
//! let x = Tensor::<B, 3>::random([2, 16, 64], Distribution::Normal(0.0, 1.0), &dev).require_grad();
//! let w = Tensor::<B, 1>::ones([64], &dev).require_grad();
//! let y = kernels::rms_norm(x.clone(), w.clone(), 1e-5);
//! let grads = y.sum().backward();
//! let (dx, dw) = (x.grad(&grads).unwrap(), w.grad(&grads).unwrap());
//! ```

pub mod activation;
pub mod adamw;
pub mod attention;
mod check;
pub mod collective;
pub mod cross_entropy;
mod cuda_context;
pub mod cuda_profiler;
mod cuda_source;
mod cuda_stream;
mod device_thread;
pub mod dropout;
pub mod embedding;
pub mod format_stats;
pub mod fp8;
pub mod gemm;
pub mod kernel_cache;
mod launch;
pub mod memory;
pub mod mlp;
pub mod philox;
mod pipeline;
mod primitive;
pub mod probe;
pub mod read_back;
pub mod recompute;
pub mod reduce;
pub mod rms_norm;
pub mod rope;
pub mod settings;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::{FloatDType, Int, Tensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use primitive::{prim, tensor};

/// Declares the aggregates of the op list (see its one use below). `$d` is a literal `$`, so that
/// the `reference_backend!` macro it writes can have metavariables of its own.
macro_rules! ops {
    ($d:tt $($module:ident :: $ops:ident $(/ $kernels:ident)?),* $(,)?) => {
        /// A Burn backend that the fused ops are available on: every op's trait, each with a
        /// default that runs the op's plain-Burn reference. Implemented for every backend that
        /// implements those traits.
        ///
        /// `CubeBackend` overrides them with the kernels, `Autodiff` with the kernels and their
        /// backward passes, and Burn's `NdArray` keeps the references. Another backend opts in
        /// with an empty impl of each op trait, which [`reference_backend!`] writes. Call the
        /// free functions ([`rms_norm`], ...) rather than the traits' methods.
        pub trait Backend: $($module::$ops +)* {}

        impl<B> Backend for B where B: $($module::$ops +)* {}

        /// The kernels' forward and backward launches without autodiff, which the `Autodiff`
        /// implementation of every op trait records: implemented by `CubeBackend`.
        pub trait KernelOps: Backend $($(+ $module::$kernels)?)* {}

        /// Makes a backend a [`Backend`] that runs every op's plain-Burn reference: one empty
        /// impl of each op trait. `reference_backend!(MyBackend);`, or with generics
        /// `reference_backend!(impl<C: Bound> for MyBackend<C>);`.
        #[macro_export]
        macro_rules! reference_backend {
            (impl<$d($d g:ident $d(: $d bound:path)?),*> for $d ty:ty) => {
                $(impl<$d($d g $d(: $d bound)?),*> $d crate::$module::$ops for $d ty {})*
            };
            ($d ty:ty) => {
                $(impl $d crate::$module::$ops for $d ty {})*
            };
        }
    };
}

pub use activation::{ActivationKernels, ActivationOps};
pub use adamw::{AdamWOps, AdamWOutput, AdamWStep};
pub use attention::{AttentionKernels, AttentionOps, FlashPath};
pub use cross_entropy::{CrossEntropyKernels, CrossEntropyOps};
pub use dropout::{Dropout, DropoutKernels, DropoutOps};
pub use embedding::{EmbeddingKernels, EmbeddingOps};
pub use format_stats::{FormatProbe, FormatStats, FormatStatsOps};
pub use fp8::{
    fp8_act_quantize_pair, fp8_gelu_mlp, fp8_gelu_mlp_scaled, fp8_gemm, fp8_gemm_on, fp8_gemm_path,
    fp8_health, fp8_health_pending, fp8_health_pending_at, fp8_linear, fp8_linear_probed,
    fp8_linear_scaled, fp8_mlp_scaled, fp8_pair_path, fp8_pair_path_run, fp8_quantize,
    fp8_quantize_pair, fp8_quantize_pair_on, Fp8AmaxHistory, Fp8AmaxHistoryState, Fp8Format,
    Fp8GemmPath, Fp8Granularity, Fp8Health, Fp8LinearConfig, Fp8MlpActivation, Fp8Ops, Fp8PairPath,
    Fp8Probe, Fp8Record, Fp8ScaleSite, Fp8Tensor, Fp8WgradBlocks, PairSpec, PendingHealth,
    QuantSpec,
};
pub use gemm::{gemm, linear, Gemm, GemmOps, GemmPath};
pub use memory::{MemoryOps, MemoryUse};
pub use mlp::{gelu_tanh_mlp, MlpOps};
pub use primitive::float_dtype;
pub use probe::{probe_sink, ProbeSink};
pub use read_back::{ReadBackOps, StartedRead};
pub use recompute::RecomputeOps;
pub use reduce::{ReduceOps, SumSquares};
pub use rms_norm::{RmsNormKernels, RmsNormOps};
pub use rope::{RopeKernels, RopeOps};

/// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * weight`, f32 inside, output in
/// `x`'s dtype; `weight` is `[x.dims()[D - 1]]` in any float dtype.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    tensor(B::fused_rms_norm(prim(x), prim(weight), eps))
}

/// Residual add fused with RMSNorm: returns `(s, rms_norm(s))` with `s = x + residual` (in `x`'s
/// dtype, the new residual stream), reading `x` and `residual` once.
pub fn add_rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let (s, y) = B::fused_add_rms_norm(prim(x), prim(residual), prim(weight), eps);
    (tensor(s), tensor(y))
}

/// `silu(gate) * up` for two tensors of the same shape and dtype.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_swiglu(prim(gate), prim(up)))
}

/// `silu(gate) * up` with gate and up packed in one `[.., 2 * F]` tensor (gate half first, as a
/// single fused projection produces them) -> `[.., F]`. The gradient is one packed tensor too.
pub fn swiglu_packed<B: Backend, const D: usize>(gate_up: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_swiglu_packed(prim(gate_up)))
}

/// Dropout of `x` with its mask drawn inside the kernel from `dropout.seed` (see [`dropout`]):
/// each entry is zeroed with probability `p` (in steps of 1/65536) and the others are scaled by
/// `1 / (1 - p)`, in f32, stored in `x`'s dtype. The backward draws the same mask again, so only
/// the seed is kept for it; one seed gives one mask, so give every call its own. Unlike Burn's
/// `Dropout` module this always drops: call it only when training. `p = 0` returns `x`.
pub fn dropout<B: Backend, const D: usize>(x: Tensor<B, D>, dropout: Dropout) -> Tensor<B, D> {
    dropout::check("dropout", Some(dropout));
    if !dropout.is_active() {
        return x;
    }
    tensor(B::fused_dropout(prim(x), dropout))
}

/// Exact (erf) GELU, computed in f32 (safe in f16, unlike a GELU whose backward cubes `x` in f16).
pub fn gelu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_gelu(prim(x), activation::GeluForm::Exact))
}

/// GELU's tanh approximation, `x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2` (GPT-2's, and
/// PyTorch's `gelu(approximate="tanh")`), computed in f32.
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_gelu(prim(x), activation::GeluForm::Tanh))
}

/// Rotary embedding of `x` [batch, heads, seq, head_dim] with tables `cos`, `sin`
/// [positions >= seq, head_dim / 2] (see [`rope::tables`]); "rotate half" pairing.
pub fn rope<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 2>, sin: Tensor<B, 2>) -> Tensor<B, 4> {
    tensor(B::fused_rope(prim(x), prim(cos), prim(sin)))
}

/// Token embedding `weight[ids]`: `[vocab, d]` and `[batch, seq]` -> `[batch, seq, d]`; its
/// backward scatters the gradient with f32 atomic adds on CUDA (see [`embedding`](mod@embedding)).
pub fn embedding<B: Backend>(weight: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    tensor(B::fused_embedding(prim(weight), ids.into_primitive()))
}

/// Per-row softmax cross-entropy (f32 [rows]) of `logits` [rows, classes] against class indices
/// `targets` [rows], plus `z_loss * lse^2` when `z_loss > 0`; negative targets are ignored (0);
/// targets >= classes give NaN.
/// Take `.mean()` (or a masked mean) for the usual scalar loss.
pub fn cross_entropy<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    z_loss: f64,
) -> Tensor<B, 1> {
    tensor(B::fused_cross_entropy(
        prim(logits),
        targets.into_primitive(),
        z_loss,
    ))
}

/// Mean softmax cross-entropy (`[1]` f32) of the logits `x w^T` against `targets` [rows], without
/// holding the logits: `x` [rows, d], `w` [classes, d] (an LM head's weight, or a tied embedding;
/// cast to `x`'s dtype for the GEMMs), computed a chunk of rows at a time (see
/// [`cross_entropy::linear`]). The mean is over all rows; negative targets count as 0, as in
/// [`cross_entropy`]. Differentiable in `x` and `w`.
///
/// ```no_run
/// use burn::backend::{Autodiff, Wgpu};
/// use burn::tensor::{Distribution, Int, Tensor};
/// use kernels::cross_entropy::LinearCrossEntropy;
///
/// type B = Autodiff<Wgpu>;
/// let dev = Default::default();
/// let x = Tensor::<B, 2>::random([64, 32], Distribution::Normal(0.0, 1.0), &dev).require_grad();
/// let w = Tensor::<B, 2>::random([100, 32], Distribution::Normal(0.0, 1.0), &dev).require_grad();
/// let targets = Tensor::<B, 1, Int>::arange(0..64, &dev);
/// let loss = kernels::linear_cross_entropy(x, w, targets, LinearCrossEntropy::default());
/// let grads = loss.backward();
/// ```
pub fn linear_cross_entropy<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    opts: cross_entropy::LinearCrossEntropy,
) -> Tensor<B, 1> {
    let op = "linear_cross_entropy";
    check::check_float(op, "x", x.dtype());
    check::check_float(op, "w", w.dtype());
    let ([rows, d], [classes, wd]) = (x.dims(), w.dims());
    if wd != d || classes == 0 {
        check::fail(
            op,
            format!("x is [{rows}, {d}] and w is [{classes}, {wd}]; w must be [classes, {d}] with classes >= 1"),
        );
    }
    if rows == 0 {
        check::fail(
            op,
            "x has no rows; the mean of no losses is undefined".into(),
        );
    }
    if targets.dims() != [rows] {
        check::fail(
            op,
            format!(
                "targets have shape {:?}; expected [{rows}], one class index per row of x",
                targets.dims()
            ),
        );
    }
    if opts.chunk_rows == Some(0) {
        check::fail(
            op,
            "chunk_rows is Some(0); it must be at least 1 (or None)".into(),
        );
    }
    tensor(B::fused_linear_cross_entropy(
        prim(x),
        prim(w),
        targets.into_primitive(),
        opts,
    ))
}

/// One fused AdamW step (see [`adamw`]): f32 `param`, `m`, `v`; `grad` in any float dtype;
/// `factor` a one-element device tensor multiplying the gradient; `copy_dtype` asks for the new
/// weight in that dtype too. Works on non-autodiff tensors (the optimizer's side).
pub fn adamw_step<B: Backend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    m: Tensor<B, D>,
    v: Tensor<B, D>,
    factor: Tensor<B, 1>,
    hp: &AdamWStep,
    copy_dtype: Option<FloatDType>,
) -> AdamWOutput<B, D> {
    let (p, m, v, c) = B::fused_adamw_step(
        prim(param),
        prim(grad),
        prim(m),
        prim(v),
        prim(factor),
        hp,
        copy_dtype,
    );
    AdamWOutput {
        param: tensor(p),
        m: tensor(m),
        v: tensor(v),
        copy: c.map(tensor),
    }
}

/// `f32(a) + f32(b)`, element by element, for tensors of one shape in any float dtypes (f32, f16,
/// bf16): gradient accumulation over micro-batches, where a bf16 or f16 gradient is added to an
/// f32 sum (or two such gradients start one) without a cast pass of its own. On `CubeBackend` one
/// kernel reads each input once; elsewhere [`reduce::add_as_f32_reference`]. Works on non-autodiff
/// tensors (the optimizer's side).
pub fn add_as_f32<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    if a.dims() != b.dims() {
        check::fail(
            "add_as_f32",
            format!(
                "b has shape {:?} but a has {:?}; they must match",
                b.dims(),
                a.dims()
            ),
        );
    }
    tensor(B::add_as_f32(prim(a), prim(b)))
}

/// `x * factor[0]` computed in f32 and stored in `dtype` (f32, f16 or bf16), where `factor` is a
/// one-element device tensor: a gradient scaled and cast in one pass (on `CubeBackend` one kernel
/// reads `x` once; elsewhere [`reduce::scale_reference`]). Works on non-autodiff tensors.
pub fn scale<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    factor: Tensor<B, 1>,
    dtype: FloatDType,
) -> Tensor<B, D> {
    tensor(B::scale_cast(prim(x), prim(factor), dtype))
}

/// The sum of every element of `tensors` (any shapes, float dtypes and layouts), in f32, as a
/// one-element device tensor (0 when they hold none). On `CubeBackend` each tensor is read once
/// into per-cube partial sums and one cube adds those in a fixed order (the same values give the
/// same bits), where a backend's own full-tensor sum may reduce a long vector in one unit;
/// elsewhere [`reduce::sum_f32_reference`]. Works on non-autodiff tensors.
pub fn sum_f32<B: Backend, const D: usize>(
    tensors: Vec<Tensor<B, D>>,
    device: &B::Device,
) -> Tensor<B, 1> {
    tensor(B::sum_f32(tensors.into_iter().map(prim).collect(), device))
}

/// How `x`'s values (any rank, float dtype and layout) fit a format whose smallest normal number
/// is `min_normal` (see [`format_stats`](mod@format_stats)): partial rows `[rows, 4]` of `[largest
/// finite |x|, nonzero finite values below min_normal, nonzero finite values, non-finite values]`
/// in f32, still on the device. Concatenate the rows of many tensors, read them back once, and
/// combine each tensor's with [`FormatStats::from_rows`]. On `CubeBackend` one kernel reads `x`
/// once. Works on non-autodiff tensors. `min_normal` must be finite and not negative.
///
/// ```no_run
/// use burn::backend::Wgpu;
/// use burn::tensor::Tensor;
///
/// let dev = Default::default();
/// let g = Tensor::<Wgpu, 2>::ones([3, 4], &dev).mul_scalar(1e-6);
/// let rows = kernels::format_stats(g, 2f64.powi(-14)); // f16's smallest normal
/// let s = kernels::FormatStats::from_rows(&rows.into_data().to_vec::<f32>().unwrap(), 12);
/// assert_eq!(s.underflow(), 1.0);
/// ```
pub fn format_stats<B: Backend, const D: usize>(x: Tensor<B, D>, min_normal: f64) -> Tensor<B, 2> {
    if !(min_normal.is_finite() && min_normal >= 0.0) {
        check::fail(
            "format_stats",
            format!("min_normal is {min_normal}; it must be finite and not negative"),
        );
    }
    tensor(B::format_stats(prim(x), min_normal))
}

/// `x` unchanged, with a probe on its gradient: under `Autodiff` over the kernels' backends
/// (`CubeBackend`), the backward takes [`format_stats()`] of the gradient flowing through `x`
/// (against `probe.min_normal`) into `probe.sink` and passes the gradient on, so that a
/// gradient can be measured without being kept ([`format_stats::take_records`] gives the records
/// back). Elsewhere nothing is recorded: [`FormatStatsOps::format_probe_records`] says whether a
/// backend records.
pub fn format_probe<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    probe: &FormatProbe,
) -> Tensor<B, D> {
    if !(probe.min_normal.is_finite() && probe.min_normal >= 0.0) {
        check::fail(
            "format_probe",
            format!(
                "min_normal is {}; it must be finite and not negative",
                probe.min_normal
            ),
        );
    }
    tensor(B::format_probe(prim(x), probe))
}

/// FlashAttention (see [`attention`]): `softmax(scale * q k^T + mask) v` for `q` [batch, heads,
/// seq_q, head_dim] and `k`, `v` [batch, kv_heads, seq_k, head_dim] of one float dtype, without
/// materialising the scores. `kv_heads` is `heads` or a divisor of it (grouped-query attention:
/// query head `h` attends with k/v head `h / (heads / kv_heads)`, without repeating k and v in
/// memory; their gradients are summed over each group). `causal` lets query `i` see keys `j <= i`;
/// `scale` defaults to
/// `1 / sqrt(head_dim)` and must be positive and finite. Under `Autodiff` the backward
/// recomputes the probabilities from the saved log-sum-exp. The output is laid out as
/// `[batch, seq_q, heads, head_dim]` in memory, so
/// `.swap_dims(1, 2).reshape([batch, seq_q, heads * head_dim])` needs no copy.
///
/// ```no_run
/// use burn::backend::{Autodiff, Wgpu};
/// use burn::tensor::{Distribution, Tensor};
///
/// type B = Autodiff<Wgpu>;
/// let dev = Default::default();
/// let q = Tensor::<B, 4>::random([2, 4, 100, 64], Distribution::Normal(0.0, 1.0), &dev).require_grad();
/// let k = Tensor::<B, 4>::random([2, 4, 100, 64], Distribution::Normal(0.0, 1.0), &dev);
/// let v = Tensor::<B, 4>::random([2, 4, 100, 64], Distribution::Normal(0.0, 1.0), &dev);
/// let o = kernels::flash_attention(q.clone(), k, v, true, None);
/// let dq = q.grad(&o.sum().backward()).unwrap();
/// ```
pub fn flash_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
) -> Tensor<B, 4> {
    attend(q, k, v, causal, scale, None)
}

/// [`flash_attention`] with dropout on the attention probabilities inside the kernels:
/// `(softmax(scale * q k^T + mask) * Z) v`, where `Z` is 0 for a dropped probability and
/// `1 / (1 - p)` for a kept one. The mask is a function of `dropout.seed` and the position (see
/// [`attention::dropout`]): the backward draws it again instead of storing it, and one seed gives
/// one mask, so give every layer and step its own seed. The log-sum-exp, and so the softmax,
/// counts every probability. `p` in [0, 1) acts in steps of 1/65536; at 0 this is
/// [`flash_attention`].
pub fn flash_attention_dropout<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
    dropout: Dropout,
) -> Tensor<B, 4> {
    attend(q, k, v, causal, scale, Some(dropout))
}

/// [`flash_attention`], with dropout when given (its `p` checked first).
fn attend<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
    dropout: Option<Dropout>,
) -> Tensor<B, 4> {
    dropout::check("flash_attention", dropout);
    let scale = scale.unwrap_or_else(|| attention::default_scale(q.dims()[3]));
    check::check_scale("flash_attention", scale);
    tensor(B::fused_flash_attention(
        prim(q),
        prim(k),
        prim(v),
        causal,
        scale,
        dropout,
    ))
}

/// Causal or full attention of a packed qkv projection with rotary embeddings: `qkv` is
/// `[batch, seq, (heads + 2 x kv_heads) x head_dim]` (q's `heads` heads, then k's `kv_heads`, then
/// v's, as one linear layer writes them; `kv_heads` = `heads` without grouping, else a divisor of
/// it, see [`flash_attention`]), q and k are rotated by `cos`, `sin` ([`rope`]'s tables), then
/// [`flash_attention`] (or
/// [`flash_attention_dropout`] with `dropout`); returns `[batch, seq, heads x head_dim]`. The same
/// result as slicing q, k, v, rotating and attending, at a lower cost under autodiff: q and k are
/// rotated inside the projection (in its own buffer when nothing else holds it), only that is
/// kept for the backward, and the projection's gradient is written packed in one pass, where
/// Burn's slice backward zero-fills and sums a whole-projection gradient per slice. `scale` defaults to `1 / sqrt(head_dim)`. The tables are constants: they
/// get no gradient.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_qkv<B: Backend>(
    qkv: Tensor<B, 3>,
    heads: usize,
    kv_heads: usize,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    causal: bool,
    scale: Option<f64>,
    dropout: Option<Dropout>,
) -> Tensor<B, 3> {
    let op = "flash_attention_qkv";
    dropout::check(op, dropout);
    let [_, _, width] = qkv.dims();
    let all = heads + 2 * kv_heads;
    if heads == 0 || !width.is_multiple_of(all) {
        check::fail(
            op,
            format!("qkv has {width} columns, not ({heads} + 2 x {kv_heads}) heads x head_dim"),
        );
    }
    attention::kv_group(op, heads, kv_heads);
    let scale = scale.unwrap_or_else(|| attention::default_scale(width / all));
    check::check_scale(op, scale);
    tensor(B::fused_flash_attention_qkv(
        prim(qkv),
        heads,
        kv_heads,
        prim(cos),
        prim(sin),
        causal,
        scale,
        dropout,
    ))
}

/// The forward of [`flash_attention`] on a backend without autodiff, also returning the f32
/// log-sum-exp of the scaled, masked scores per query row, `[batch, heads, seq_q]`.
pub fn flash_attention_with_lse<B: KernelOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let scale = scale.unwrap_or_else(|| attention::default_scale(q.dims()[3]));
    check::check_scale("flash_attention", scale);
    let (o, lse) =
        B::flash_attention_forward(prim(q), prim(k), prim(v), causal, scale as f32, None);
    (tensor(o), tensor(lse))
}

/// Which FlashAttention kernels `q` would run on (tensor cores or the portable kernels).
pub fn flash_attention_path<B: Backend>(q: &Tensor<B, 4>) -> Option<FlashPath> {
    B::flash_path(&q.clone().into_primitive().tensor())
}

// The crate's ops, listed once: `module::OpsTrait`, with `/ KernelsTrait` for an op whose
// kernels `Autodiff` records (its forward and backward launches). The aggregates [`Backend`] and
// [`KernelOps`] and the [`reference_backend!`] macro are made from this list, so adding an op
// adds one line here.
ops! {$
    rms_norm::RmsNormOps / RmsNormKernels,
    activation::ActivationOps / ActivationKernels,
    rope::RopeOps / RopeKernels,
    cross_entropy::CrossEntropyOps / CrossEntropyKernels,
    embedding::EmbeddingOps / EmbeddingKernels,
    attention::AttentionOps / AttentionKernels,
    dropout::DropoutOps / DropoutKernels,
    gemm::GemmOps,
    recompute::RecomputeOps,
    mlp::MlpOps,
    fp8::Fp8Ops,
    adamw::AdamWOps,
    reduce::ReduceOps,
    format_stats::FormatStatsOps,
    memory::MemoryOps,
    read_back::ReadBackOps,
}

impl<R, F, I, BT> KernelOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
}

/// The autodiff version of [`Backend`].
pub trait AutodiffBackend: Backend + burn::tensor::backend::AutodiffBackend {}
impl<R, F, I, BT, C> AutodiffBackend for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
}
impl<C: CheckpointStrategy> AutodiffBackend for Autodiff<burn::backend::NdArray, C> {}

// Burn's pure-Rust CPU backend: the plain-Burn reference of every op, with and without autodiff.
reference_backend!(burn::backend::NdArray);
reference_backend!(impl<C: CheckpointStrategy> for Autodiff<burn::backend::NdArray, C>);
