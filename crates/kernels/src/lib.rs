//! Fused CubeCL kernels for transformer training on Burn, each with its backward pass and a
//! plain-Burn reference.
//!
//! | op | function | reference |
//! |---|---|---|
//! | RMSNorm | [`rms_norm`] | [`rms_norm::reference`] |
//! | residual add + RMSNorm | [`add_rms_norm`] | [`rms_norm::add_reference`] |
//! | SwiGLU (two tensors / packed) | [`swiglu`], [`swiglu_packed`] | [`activation::swiglu_reference`], [`activation::swiglu_packed_reference`] |
//! | exact GELU | [`gelu`] | [`activation::gelu_reference`] |
//! | rotary embedding | [`rope`] (tables: [`rope::tables`]) | [`rope::reference`] |
//! | softmax cross-entropy + z-loss | [`cross_entropy`] | [`cross_entropy::reference`] |
//! | AdamW step writing the compute copy | [`adamw_step`] | [`adamw::reference`] |
//! | FlashAttention (forward + backward) | [`flash_attention`] | [`attention::reference`] |
//! | FP8 quantizer (1x128, 128x128, per tensor) | [`fp8_quantize`] | [`fp8::reference`] |
//! | GEMM with transpose flags, linear layer (cuBLASLt on CUDA) | [`gemm()`], [`linear`] | [`gemm::reference`] (Burn's matmul) |
//! | FP8 GEMM and linear layer (experimental) | [`fp8_gemm`], [`fp8_linear`] | dequantize, then matmul |
//!
//! The functions take ordinary Burn tensors of any backend that implements [`Backend`]:
//! - `CubeBackend` (Burn's `Cuda` and `Wgpu` without the `fusion` feature) runs the kernels;
//! - `Autodiff` over it records their backward kernels, so `loss.backward()` uses them;
//! - Burn's `NdArray` (CPU) and `Autodiff<NdArray>` run the references;
//! - any other backend can opt in with an empty `impl kernels::Backend for MyBackend {}`, which
//!   runs the references.
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
pub mod cross_entropy;
pub mod fp8;
pub mod gemm;
mod launch;
mod pipeline;
pub mod rms_norm;
pub mod rope;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{
    DType, FloatDType, Int, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive,
};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

pub use adamw::{AdamWOutput, AdamWStep};
pub use attention::FlashPath;
pub use fp8::{
    fp8_gemm, fp8_gemm_on, fp8_gemm_path, fp8_health, fp8_linear, fp8_linear_probed, fp8_quantize,
    Fp8Format, Fp8GemmPath, Fp8Granularity, Fp8Health, Fp8LinearConfig, Fp8Probe, Fp8Tensor,
    QuantSpec,
};
pub use gemm::{gemm, linear, Gemm, GemmPath};

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

/// Exact (erf) GELU, computed in f32 (safe in f16, unlike a GELU whose backward cubes `x` in f16).
pub fn gelu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::fused_gelu(prim(x)))
}

/// Rotary embedding of `x` [batch, heads, seq, head_dim] with tables `cos`, `sin`
/// [positions >= seq, head_dim / 2] (see [`rope::tables`]); "rotate half" pairing.
pub fn rope<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 2>, sin: Tensor<B, 2>) -> Tensor<B, 4> {
    tensor(B::fused_rope(prim(x), prim(cos), prim(sin)))
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

/// FlashAttention (see [`attention`]): `softmax(scale * q k^T + mask) v` for `q` [batch, heads,
/// seq_q, head_dim] and `k`, `v` [batch, heads, seq_k, head_dim] of one float dtype, without
/// materialising the scores; `causal` lets query `i` see keys `j <= i`; `scale` defaults to
/// `1 / sqrt(head_dim)`. Under `Autodiff` the backward recomputes the probabilities from the saved
/// log-sum-exp. The output is laid out as `[batch, seq_q, heads, head_dim]` in memory, so
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
    let scale = scale.unwrap_or_else(|| attention::default_scale(q.dims()[3]));
    tensor(B::fused_flash_attention(
        prim(q),
        prim(k),
        prim(v),
        causal,
        scale,
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
    let (o, lse) = B::flash_attention_forward(prim(q), prim(k), prim(v), causal, scale as f32);
    (tensor(o), tensor(lse))
}

/// Which FlashAttention kernels `q` would run on (tensor cores or the portable kernels).
pub fn flash_attention_path<B: Backend>(q: &Tensor<B, 4>) -> Option<FlashPath> {
    B::flash_path(&q.clone().into_primitive().tensor())
}

fn prim<B: BurnBackend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: BurnBackend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// A rank-erased primitive as a 2-D tensor [rows, last dim], with its original shape.
fn as_2d<B: BurnBackend>(p: FloatTensor<B>) -> (Tensor<B, 2>, Shape) {
    let shape = p.shape();
    let cols = *shape.as_slice().last().unwrap_or(&1);
    let rows = shape.num_elements().checked_div(cols).unwrap_or(0);
    (
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::float_reshape(
            p,
            Shape::new([rows, cols]),
        ))),
        shape,
    )
}

fn from_2d<B: BurnBackend>(t: Tensor<B, 2>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(prim(t), shape)
}

/// A Burn backend that the fused ops are available on.
///
/// Every method has a default that runs the plain-Burn reference, so any backend can implement
/// this trait with an empty `impl`; `CubeBackend` overrides them with the kernels and `Autodiff`
/// with the kernels and their backward passes. Call the free functions ([`rms_norm`], ...) rather
/// than these methods.
pub trait Backend: BurnBackend {
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let (x, shape) = as_2d::<Self>(x);
        from_2d(rms_norm::reference(x, tensor(weight), eps), shape)
    }

    fn fused_add_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, shape) = as_2d::<Self>(x);
        let (r, _) = as_2d::<Self>(residual);
        let (s, y) = rms_norm::add_reference(x, r, tensor(weight), eps);
        (from_2d(s, shape.clone()), from_2d(y, shape))
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (g, shape) = as_2d::<Self>(gate);
        let (u, _) = as_2d::<Self>(up);
        from_2d(activation::swiglu_reference(g, u), shape)
    }

    fn fused_swiglu_packed(gate_up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (gu, shape) = as_2d::<Self>(gate_up);
        let mut dims = shape.as_slice().to_vec();
        if let Some(last) = dims.last_mut() {
            *last /= 2;
        }
        from_2d(activation::swiglu_packed_reference(gu), Shape::from(dims))
    }

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, shape) = as_2d::<Self>(x);
        from_2d(activation::gelu_reference(x), shape)
    }

    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        prim(rope::reference::<Self>(tensor(x), tensor(cos), tensor(sin)))
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        prim(cross_entropy::reference::<Self>(
            tensor(logits),
            Tensor::from_primitive(targets),
            z_loss,
        ))
    }

    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> FloatTensor<Self> {
        prim(attention::reference::<Self>(
            tensor(q),
            tensor(k),
            tensor(v),
            causal,
            Some(scale),
        ))
    }

    /// `op(a) op(b)` of [`gemm()`]; Burn's matmul by default.
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        gemm::burn_only(engine, a.dtype());
        prim(gemm::reference::<Self>(
            tensor(a),
            tensor(b),
            trans_a,
            trans_b,
        ))
    }

    /// The engine a GEMM on tensors like `a` runs on with `engine`.
    fn gemm_path(a: &FloatTensor<Self>, engine: Gemm) -> GemmPath {
        gemm::burn_only(engine, a.dtype())
    }

    /// The FlashAttention kernels `q` would run on; `None` where the reference runs.
    fn flash_path(_q: &FloatTensor<Self>) -> Option<FlashPath> {
        None
    }

    /// `(payload, scales)` of [`fp8_quantize`] for a 2-D `x` (the CPU reference by default).
    fn fp8_quantize(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let t = Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(x));
        let [r, c] = t.dims();
        let device = t.device();
        let data = t
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .expect("f32 data");
        let (words, scales) = fp8::reference::quantize(&data, r, c, spec);
        let (rows, k) = if spec.transpose { (c, r) } else { (r, c) };
        let width = k.div_ceil(fp8::TILE) * fp8::TILE / 4;
        let words: Vec<i32> = words.into_iter().map(|w| w as i32).collect();
        let payload =
            Tensor::<Self, 2, Int>::from_data(TensorData::new(words, [rows, width]), &device);
        let shape = [spec.scale_rows(rows), spec.scale_cols(k)];
        let scales =
            Tensor::<Self, 2>::from_data(TensorData::new(scales, shape), (&device, DType::F32));
        (payload.into_primitive(), prim(scales))
    }

    /// `[rows, k_out]` values of an FP8 payload in `dtype` (the CPU reference by default).
    fn fp8_dequantize(
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: usize,
        k_out: usize,
        spec: &QuantSpec,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let payload = Tensor::<Self, 2, Int>::from_primitive(payload);
        let device = payload.device();
        let width = payload.dims()[1];
        let words = fp8::words_of(payload.into_data());
        let scales = tensor::<Self, 2>(scales)
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .expect("f32 scales");
        let full = fp8::reference::dequantize(&words, &scales, rows, width * 4, spec);
        let values: Vec<f32> = full
            .chunks(width * 4)
            .flat_map(|row| row[..k_out].iter().copied())
            .collect();
        prim(
            Tensor::<Self, 2>::from_data(
                TensorData::new(values, [rows, k_out]),
                (&device, DType::F32),
            )
            .cast(dtype),
        )
    }

    /// Whether the device has the FP8 tensor-core GEMM.
    fn fp8_mma_supported(_payload: &IntTensor<Self>) -> bool {
        false
    }

    /// Bytes the device's memory pools hold now (allocated by the backend, in use or cached for
    /// reuse, as PyTorch's `memory_reserved`), or `None` where the backend does not say.
    fn memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// The FP8 tensor-core GEMM `[m, k] x [n, k]^T`, or `None` where it does not apply.
    #[allow(clippy::too_many_arguments)]
    fn fp8_gemm_mma(
        _a: IntTensor<Self>,
        _sa: FloatTensor<Self>,
        _a_spec: &QuantSpec,
        _b: IntTensor<Self>,
        _sb: FloatTensor<Self>,
        _b_spec: &QuantSpec,
        _m: usize,
        _n: usize,
        _out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// Whether the device has cuBLASLt's block-scaled FP8 GEMM (CUDA, Hopper, cuBLASLt 12.9+).
    fn fp8_cublaslt_supported(_payload: &IntTensor<Self>) -> bool {
        false
    }

    /// The FP8 GEMM `[m, k] x [n, k]^T` on cuBLASLt, or `None` where it does not apply.
    #[allow(clippy::too_many_arguments)]
    fn fp8_gemm_cublaslt(
        _a: IntTensor<Self>,
        _sa: FloatTensor<Self>,
        _a_spec: &QuantSpec,
        _b: IntTensor<Self>,
        _sb: FloatTensor<Self>,
        _b_spec: &QuantSpec,
        _m: usize,
        _n: usize,
        _out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// [`fp8_linear`]; by default its forward only (backends without autodiff). Under `Autodiff`,
    /// `probe` receives the output gradient's health in the backward.
    fn fp8_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        cfg: &Fp8LinearConfig,
        _probe: Option<fp8::Fp8Probe>,
    ) -> FloatTensor<Self> {
        prim(fp8::linear::fprop::<Self>(tensor(x), tensor(w), cfg))
    }

    #[allow(clippy::type_complexity)]
    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        hp: &AdamWStep,
        copy_dtype: Option<FloatDType>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let (p, shape) = as_2d::<Self>(param);
        let (g, _) = as_2d::<Self>(grad);
        let (m, _) = as_2d::<Self>(m);
        let (v, _) = as_2d::<Self>(v);
        let out = adamw::reference(p, g, m, v, tensor(factor), hp, copy_dtype);
        (
            from_2d(out.param, shape.clone()),
            from_2d(out.m, shape.clone()),
            from_2d(out.v, shape.clone()),
            out.copy.map(|c| from_2d(c, shape)),
        )
    }
}

/// The kernels' forward and backward launches, without autodiff: implemented by `CubeBackend`
/// and used by the `Autodiff` implementation of [`Backend`].
pub trait KernelOps: Backend {
    /// `(x + residual if given, y, 1 / rms per row in f32)`
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (
        Option<FloatTensor<Self>>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
    /// `(dx, dweight)` from the normalised input, the gain, the saved `1 / rms` and `dy`.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// SwiGLU of `gate` and `up`, or of the packed `gate` when `up` is `None`.
    fn swiglu_forward(gate: FloatTensor<Self>, up: Option<FloatTensor<Self>>) -> FloatTensor<Self>;
    /// Gradients of [`KernelOps::swiglu_forward`], packed `[.., 2 * F]` (gate half, up half).
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    fn gelu_erf_forward(x: FloatTensor<Self>) -> FloatTensor<Self>;
    fn gelu_erf_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Rotary embedding, or its inverse (the backward).
    fn rope_rotate(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self>;
    /// `(per-row loss, per-row log-sum-exp)`, both f32.
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self>;
    /// `(out, lse)` of FlashAttention (lse f32 `[batch, heads, seq_q]`).
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `(dq, dk, dv)` of FlashAttention from the forward's output and log-sum-exp.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The autodiff version of [`Backend`].
pub trait AutodiffBackend: Backend + burn::tensor::backend::AutodiffBackend {}

impl<R, F, I, BT> KernelOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (
        Option<FloatTensor<Self>>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        rms_norm::forward::forward(x, residual, weight, eps)
    }
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::forward::backward(x, weight, rstd, dy)
    }
    fn swiglu_forward(gate: FloatTensor<Self>, up: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        activation::forward::swiglu_forward(gate_up(gate, up))
    }
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        activation::forward::swiglu_backward(gate_up(gate, up), dy)
    }
    fn gelu_erf_forward(x: FloatTensor<Self>) -> FloatTensor<Self> {
        activation::forward::gelu_forward(x)
    }
    fn gelu_erf_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        activation::forward::gelu_backward(x, dy)
    }
    fn rope_rotate(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
    ) -> FloatTensor<Self> {
        rope::forward::rope(x, cos, sin, inverse)
    }
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cross_entropy::forward::forward(logits, targets, z_loss)
    }
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        cross_entropy::forward::backward(logits, targets, lse, dloss, z_loss)
    }
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::forward::forward(q, k, v, causal, scale)
    }
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        attention::forward::backward(q, k, v, out, lse, grad, causal, scale)
    }
}

fn gate_up<R: CubeRuntime>(
    gate: burn_cubecl::tensor::CubeTensor<R>,
    up: Option<burn_cubecl::tensor::CubeTensor<R>>,
) -> activation::forward::GateUp<R> {
    match up {
        Some(up) => activation::forward::GateUp::Split { gate, up },
        None => activation::forward::GateUp::Packed(gate),
    }
}

impl<R, F, I, BT> Backend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        Self::rms_norm_forward(x, None, weight, eps).1
    }
    fn fused_add_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (s, y, _) = Self::rms_norm_forward(x, Some(residual), weight, eps);
        (s.expect("the fused forward returns the sum"), y)
    }
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::swiglu_forward(gate, Some(up))
    }
    fn fused_swiglu_packed(gate_up: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::swiglu_forward(gate_up, None)
    }
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::gelu_erf_forward(x)
    }
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::rope_rotate(x, cos, sin, false)
    }
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        Self::cross_entropy_forward(logits, targets, z_loss).0
    }
    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> FloatTensor<Self> {
        Self::flash_attention_forward(q, k, v, causal, scale as f32).0
    }
    fn flash_path(q: &FloatTensor<Self>) -> Option<FlashPath> {
        Some(attention::forward::path(q))
    }
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        gemm::cube::<R, F, I, BT>(a, b, trans_a, trans_b, engine)
    }
    fn gemm_path(a: &FloatTensor<Self>, engine: Gemm) -> GemmPath {
        gemm::cube_path(a, engine)
    }
    fn fp8_quantize(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        fp8::forward::quantize(x, spec)
    }
    fn fp8_dequantize(
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: usize,
        k_out: usize,
        spec: &QuantSpec,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        fp8::forward::dequantize(payload, scales, rows, k_out, spec, dtype)
    }
    fn fp8_mma_supported(payload: &IntTensor<Self>) -> bool {
        fp8::forward::mma_supported(payload)
    }
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|u| u.bytes_reserved)
    }
    fn fp8_gemm_mma(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        fp8::forward::gemm_mma(a, sa, a_spec, b, sb, b_spec, m, n, out)
    }
    fn fp8_cublaslt_supported(payload: &IntTensor<Self>) -> bool {
        crate::gemm::cublaslt::as_cuda(payload)
            .is_some_and(crate::gemm::cublaslt::fp8_block_scaling_supported)
    }
    fn fp8_gemm_cublaslt(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        fp8::forward::gemm_cublaslt::<R, F, I, BT>(a, sa, a_spec, b, sb, b_spec, m, n, out)
    }
    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        hp: &AdamWStep,
        copy_dtype: Option<FloatDType>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        adamw::forward::step(param, grad, m, v, factor, hp, copy_dtype.map(Into::into))
    }
}

impl<B: KernelOps, C: CheckpointStrategy> Backend for Autodiff<B, C> {
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        rms_norm::backward::rms_norm::<B, C>(x, weight, eps)
    }
    fn fused_add_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm::backward::add_rms_norm::<B, C>(x, residual, weight, eps)
    }
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        activation::backward::swiglu::<B, C>(gate, up)
    }
    fn fused_swiglu_packed(gate_up: FloatTensor<Self>) -> FloatTensor<Self> {
        activation::backward::swiglu_packed::<B, C>(gate_up)
    }
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        activation::backward::gelu::<B, C>(x)
    }
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope::backward::rope::<B, C>(x, cos, sin)
    }
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        z_loss: f64,
    ) -> FloatTensor<Self> {
        cross_entropy::backward::cross_entropy::<B, C>(logits, targets, z_loss)
    }
    fn fused_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
        scale: f64,
    ) -> FloatTensor<Self> {
        attention::backward::flash_attention::<B, C>(q, k, v, causal, scale as f32)
    }
    fn flash_path(q: &FloatTensor<Self>) -> Option<FlashPath> {
        B::flash_path(&q.primitive)
    }
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        gemm::backward::gemm::<B, C>(a, b, trans_a, trans_b, engine)
    }
    fn gemm_path(a: &FloatTensor<Self>, engine: Gemm) -> GemmPath {
        B::gemm_path(&a.primitive, engine)
    }
    fn fp8_quantize(
        x: FloatTensor<Self>,
        spec: &QuantSpec,
    ) -> (IntTensor<Self>, FloatTensor<Self>) {
        let (payload, scales) = B::fp8_quantize(x.primitive, spec);
        (
            payload,
            <Self as burn::tensor::backend::AutodiffBackend>::from_inner(scales),
        )
    }
    fn fp8_dequantize(
        payload: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: usize,
        k_out: usize,
        spec: &QuantSpec,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let out = B::fp8_dequantize(payload, scales.primitive, rows, k_out, spec, dtype);
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(out)
    }
    fn fp8_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        cfg: &Fp8LinearConfig,
        probe: Option<fp8::Fp8Probe>,
    ) -> FloatTensor<Self> {
        fp8::linear::fp8_linear::<B, C>(x, w, cfg, probe)
    }
    fn fp8_mma_supported(payload: &IntTensor<Self>) -> bool {
        B::fp8_mma_supported(payload)
    }
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }
    fn fp8_cublaslt_supported(payload: &IntTensor<Self>) -> bool {
        B::fp8_cublaslt_supported(payload)
    }
    fn fp8_gemm_mma(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        B::fp8_gemm_mma(a, sa.primitive, a_spec, b, sb.primitive, b_spec, m, n, out)
            .map(<Self as burn::tensor::backend::AutodiffBackend>::from_inner)
    }
    fn fp8_gemm_cublaslt(
        a: IntTensor<Self>,
        sa: FloatTensor<Self>,
        a_spec: &QuantSpec,
        b: IntTensor<Self>,
        sb: FloatTensor<Self>,
        b_spec: &QuantSpec,
        m: usize,
        n: usize,
        out: FloatDType,
    ) -> Option<FloatTensor<Self>> {
        B::fp8_gemm_cublaslt(a, sa.primitive, a_spec, b, sb.primitive, b_spec, m, n, out)
            .map(<Self as burn::tensor::backend::AutodiffBackend>::from_inner)
    }
}
impl<B: KernelOps, C: CheckpointStrategy> AutodiffBackend for Autodiff<B, C> {}

// Burn's pure-Rust CPU backend: the plain-Burn reference of every op, with and without autodiff.
impl Backend for burn::backend::NdArray {}
impl<C: CheckpointStrategy> Backend for Autodiff<burn::backend::NdArray, C> {}
impl<C: CheckpointStrategy> AutodiffBackend for Autodiff<burn::backend::NdArray, C> {}
