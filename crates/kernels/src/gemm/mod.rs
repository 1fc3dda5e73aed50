//! GEMMs: `op(a) op(b)` with transpose flags, on cuBLASLt where the tensors live on CUDA and on
//! Burn's matmul everywhere else.
//!
//! A linear layer `y = x W` (`x` [rows, K], `W` [K, N]) needs three products, and each is one call
//! with flags, never a transposed copy:
//! - fprop `y = x W`: `gemm(x, w, false, false)`;
//! - dgrad `dx = dy W^T`: `gemm(dy, w, false, true)`;
//! - wgrad `dW = x^T dy`: `gemm(x, dy, true, false)`.
//!
//! [`gemm`] is differentiable: under `Autodiff` its backward runs these products through the same
//! engine. [`linear`] applies it to the last dimension of a tensor of any rank.
//!
//! Engines ([`Gemm`]):
//! - `Burn`: Burn's matmul (the portable path, and the reference: [`reference`]).
//! - `CublasLt`: NVIDIA's cuBLASLt on the device pointers of CubeCL's CUDA buffers. Half types
//!   accumulate in f32; f32 is true f32 (no TF32), as PyTorch's default. Each operand's
//!   real leading dimension is passed (CUDA pitches rows that are not a multiple of 512 bytes);
//!   transposed views are read as the other layout; other strides are copied once. The algorithm is
//!   cuBLASLt's heuristic choice, cached per shape, layout and alignment; with
//!   `BURNMIX_GEMM_ALGO=timed` the fastest of the heuristic's first results, timed at the
//!   problem's first call ([`timed_gemms`] lists them). The call
//!   runs on CubeCL's own CUDA stream, between CubeCL's earlier and later work (CubeCL 0.10 has no
//!   accessor for its `CUstream`: it is read once per stream from the server's description; see
//!   `cuda_stream.rs`). With `BURNMIX_GEMM_ORDER=stream` (and where that stream cannot be found) it
//!   runs on a stream of its own, ordered on the GPU through flags and one-thread waiting kernels;
//!   with `BURNMIX_GEMM_ORDER=host`, by synchronising CubeCL's stream before it and the GEMM's own
//!   stream after it.
//! - `Auto`: `CublasLt` for CUDA tensors when the library loads, `Burn` otherwise.
//!
//! A shape cuBLASLt refuses (no algorithm for its alignment) runs on Burn's matmul with a one-line
//! warning per shape, never silently. An explicit `CublasLt` on a backend that is not CUDA, or
//! without the library, is an error: check with [`cublaslt_status`] first.

pub(crate) mod backward;
pub(crate) mod cublaslt;
pub(crate) mod forward;

pub use cublaslt::TimedGemm;

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;

use crate::check::{check_float, check_same_dtype, fail};

/// Which engine runs the GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Gemm {
    /// cuBLASLt on CUDA when the library loads, Burn's matmul elsewhere.
    #[default]
    Auto,
    /// cuBLASLt; CUDA tensors only.
    CublasLt,
    /// Burn's matmul.
    Burn,
}

/// The engine a GEMM actually ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPath {
    /// Burn's matmul.
    Burn,
    /// cuBLASLt, ordered with CubeCL's stream by host synchronisation
    /// (`BURNMIX_GEMM_ORDER=host`).
    CublasLtHostSync,
    /// cuBLASLt, ordered with CubeCL's stream on the GPU (flags and one-thread spinning kernels;
    /// `BURNMIX_GEMM_ORDER=stream`, or where CubeCL's stream could not be found).
    CublasLtStreamOrdered,
    /// cuBLASLt on CubeCL's own stream; the default.
    CublasLtSameStream,
}

impl std::fmt::Display for GemmPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GemmPath::Burn => "Burn matmul",
            GemmPath::CublasLtHostSync => "cuBLASLt (host-synchronised with CubeCL's stream)",
            GemmPath::CublasLtStreamOrdered => "cuBLASLt (ordered with CubeCL's stream on the GPU)",
            GemmPath::CublasLtSameStream => "cuBLASLt (on CubeCL's stream)",
        })
    }
}

/// `op(a) op(b)` for 2-D `a`, `b` of one float dtype, where `op` transposes when its flag is set:
/// `[m, k] x [k, n] -> [m, n]` in the inputs' dtype (f32 accumulation). Differentiable.
///
/// ```no_run
/// use burn::backend::{Autodiff, Wgpu};
/// use burn::tensor::{Distribution, Tensor};
/// use kernels::Gemm;
///
/// type B = Autodiff<Wgpu>;
/// let dev = Default::default();
/// let x = Tensor::<B, 2>::random([32, 64], Distribution::Normal(0.0, 1.0), &dev).require_grad();
/// let w = Tensor::<B, 2>::random([48, 64], Distribution::Normal(0.0, 1.0), &dev).require_grad();
/// let y = kernels::gemm(x.clone(), w.clone(), false, true, Gemm::Auto); // x w^T: [32, 48]
/// let grads = y.sum().backward();
/// ```
pub fn gemm<B: GemmOps>(
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    trans_a: bool,
    trans_b: bool,
    engine: Gemm,
) -> Tensor<B, 2> {
    check_operands("gemm", &a, &b, trans_a, trans_b);
    crate::primitive::tensor(B::gemm(
        crate::primitive::prim(a),
        crate::primitive::prim(b),
        trans_a,
        trans_b,
        engine,
    ))
}

/// `op(a) op(b)` written in f32, plus `acc` (f32 `[m, n]`) when given: a weight gradient
/// accumulated in f32 straight from the GEMM (over micro-batches or chunks of rows) instead of a
/// low-precision product and a cast. `a` and `b` share one float dtype (f32 accumulation). Not
/// differentiable: the result carries no autodiff history.
///
/// On CUDA with cuBLASLt the product is added in place into `acc`'s memory (beta = 1) when
/// nothing else holds `acc`; otherwise, and on every other backend, `acc + op(a) op(b)` with the
/// operands cast to f32 and Burn's matmul.
pub fn gemm_f32<B: GemmOps>(
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    trans_a: bool,
    trans_b: bool,
    acc: Option<Tensor<B, 2>>,
    engine: Gemm,
) -> Tensor<B, 2> {
    check_operands("gemm_f32", &a, &b, trans_a, trans_b);
    if let Some(c) = &acc {
        let ([m, _, n], _) = dims(a.dims(), b.dims(), trans_a, trans_b);
        if c.dims() != [m, n] || c.dtype() != DType::F32 {
            fail(
                "gemm_f32",
                format!(
                    "acc is {:?} {:?}; op(a) op(b) is [{m}, {n}], so acc must be F32 [{m}, {n}]",
                    c.dtype(),
                    c.dims()
                ),
            );
        }
    }
    crate::primitive::tensor(B::gemm_f32(
        crate::primitive::prim(a),
        crate::primitive::prim(b),
        trans_a,
        trans_b,
        acc.map(crate::primitive::prim),
        engine,
    ))
}

/// The plain-Burn [`gemm_f32`]: f32 casts, Burn's matmul, an add.
pub fn reference_f32<B: BurnBackend>(
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    trans_a: bool,
    trans_b: bool,
    acc: Option<Tensor<B, 2>>,
) -> Tensor<B, 2> {
    let p = reference(
        a.cast(burn::tensor::FloatDType::F32),
        b.cast(burn::tensor::FloatDType::F32),
        trans_a,
        trans_b,
    );
    match acc {
        Some(c) => c + p,
        None => p,
    }
}

/// `x W` over the last dimension: `x` [.., k], `w` [k, n] -> [.., n], through [`gemm`].
pub fn linear<B: GemmOps, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    engine: Gemm,
) -> Tensor<B, D> {
    let dims = x.dims();
    let k = dims[D - 1];
    let [wk, n] = w.dims();
    if wk != k {
        fail(
            "linear",
            format!(
                "x is {dims:?} and w is [{wk}, {n}]; w must be [{k}, n] (x's last dimension first)"
            ),
        );
    }
    let rows = dims[..D - 1].iter().product::<usize>();
    let y = gemm(x.reshape([rows, k]), w, false, false, engine);
    let mut out = dims;
    out[D - 1] = n;
    y.reshape(out)
}

/// `[m, k, n]` of `op(a) op(b)`.
pub(crate) fn dims(
    a: [usize; 2],
    b: [usize; 2],
    trans_a: bool,
    trans_b: bool,
) -> ([usize; 3], usize) {
    let (m, k) = if trans_a { (a[1], a[0]) } else { (a[0], a[1]) };
    let (kb, n) = if trans_b { (b[1], b[0]) } else { (b[0], b[1]) };
    ([m, k, n], kb)
}

#[track_caller]
fn check_operands<B: BurnBackend>(
    op: &str,
    a: &Tensor<B, 2>,
    b: &Tensor<B, 2>,
    trans_a: bool,
    trans_b: bool,
) {
    check_float(op, "a", a.dtype());
    check_same_dtype(op, "a", a.dtype(), "b", b.dtype());
    let ([_, k, _], kb) = dims(a.dims(), b.dims(), trans_a, trans_b);
    if k != kb {
        fail(
            op,
            format!(
                "op(a) is {:?}{} and op(b) is {:?}{}: their inner dimensions {k} and {kb} differ",
                a.dims(),
                if trans_a { "^T" } else { "" },
                b.dims(),
                if trans_b { "^T" } else { "" }
            ),
        );
    }
}

/// The plain-Burn GEMM: transposed views and Burn's matmul.
pub fn reference<B: BurnBackend>(
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    trans_a: bool,
    trans_b: bool,
) -> Tensor<B, 2> {
    let a = if trans_a { a.transpose() } else { a };
    let b = if trans_b { b.transpose() } else { b };
    a.matmul(b)
}

/// Whether cuBLASLt can run here: `Ok(version)` when the library loads (e.g. 130000 for 13.0),
/// otherwise the reason in one line.
pub fn cublaslt_status() -> Result<usize, String> {
    cublaslt::library()
}

/// How many GEMMs (BF16/FP16/F32 and FP8) were sent to cuBLASLt on the calling thread and ran on
/// another path instead, each with its one-line warning: 0 means every cuBLASLt GEMM this thread
/// asked for ran on cuBLASLt. Burn's backward pass runs on the thread that calls `backward`.
pub fn cublaslt_fallbacks_on_this_thread() -> usize {
    cublaslt::fallbacks_on_this_thread()
}

/// The GEMM problems whose cuBLASLt algorithm was chosen by timing (`BURNMIX_GEMM_ALGO=timed`)
/// so far in this process, in the order they were timed.
pub fn timed_gemms() -> Vec<TimedGemm> {
    cublaslt::timed_gemms()
}

/// The cuBLASLt algorithms chosen by timing in this process (`BURNMIX_GEMM_ALGO=timed`), and any
/// read with [`read_gemm_algorithms`] and used, as text for [`read_gemm_algorithms`] in a later
/// process; `None` when there are none. A training run keeps it in its directory, so that the run
/// resumed from there computes with the same algorithms (and rounds the same way).
pub fn gemm_algorithms_record() -> Option<String> {
    cublaslt::record()
}

/// Reads a record of [`gemm_algorithms_record`]: with `BURNMIX_GEMM_ALGO=timed`, a problem it
/// names (on a GPU of the same name) takes the recorded algorithm, if cuBLASLt's check passes,
/// instead of being timed. Returns how many algorithms it holds. Refused whole, with the reason,
/// when it was written with another cuBLASLt release or is not such a record.
pub fn read_gemm_algorithms(record: &str) -> Result<usize, String> {
    cublaslt::read_record(record)
}

/// How many GEMM problems in this process took an algorithm read with [`read_gemm_algorithms`]
/// instead of timing it.
pub fn gemm_algorithms_read_and_used() -> usize {
    cublaslt::record_used()
}

/// Forgets every cuBLASLt problem's plan and every algorithm timed or read, so that the next calls
/// plan (and time) again as in a new process: for tests of [`read_gemm_algorithms`].
#[doc(hidden)]
pub fn forget_gemm_algorithms() {
    cublaslt::forget_algorithms()
}

/// Diagnostic of the GPU hand-over (see `cublaslt::diagnose_wait`): how long a read behind
/// CubeCL's waiting kernel took when the flag was written after `delay`.
#[doc(hidden)]
pub fn diagnose_wait(
    probe: &CubeTensor<cubecl::cuda::CudaRuntime>,
    delay: std::time::Duration,
) -> Result<std::time::Duration, String> {
    cublaslt::diagnose_wait(probe, delay)
}

/// The engine `engine` resolves to for tensors like `a`.
pub fn gemm_path<B: GemmOps>(a: &Tensor<B, 2>, engine: Gemm) -> GemmPath {
    B::gemm_path(&a.clone().into_primitive().tensor(), engine)
}

/// What the Burn-only backends do with `engine`: `Burn`, or an error for an explicit `CublasLt`.
#[track_caller]
pub(crate) fn burn_only(engine: Gemm, dtype: DType) -> GemmPath {
    if engine == Gemm::CublasLt {
        fail(
            "gemm",
            format!("Gemm::CublasLt needs CUDA tensors (Burn's Cuda backend), but this {dtype:?} tensor is on another backend; use Gemm::Auto or Gemm::Burn"),
        );
    }
    GemmPath::Burn
}

/// GEMMs on a backend ([`gemm()`], [`linear`]). The defaults run Burn's matmul; `CubeBackend`
/// overrides them with cuBLASLt on CUDA and `Autodiff` records their backward GEMMs.
pub trait GemmOps: BurnBackend {
    /// `op(a) op(b)` of [`gemm()`]; Burn's matmul by default.
    fn gemm(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        burn_only(engine, a.dtype());
        crate::primitive::prim(reference::<Self>(
            crate::primitive::tensor(a),
            crate::primitive::tensor(b),
            trans_a,
            trans_b,
        ))
    }

    /// [`gemm_f32`]; the f32 reference by default.
    fn gemm_f32(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        trans_a: bool,
        trans_b: bool,
        acc: Option<FloatTensor<Self>>,
        engine: Gemm,
    ) -> FloatTensor<Self> {
        burn_only(engine, a.dtype());
        crate::primitive::prim(reference_f32::<Self>(
            crate::primitive::tensor(a),
            crate::primitive::tensor(b),
            trans_a,
            trans_b,
            acc.map(crate::primitive::tensor),
        ))
    }

    /// The engine a GEMM on tensors like `a` runs on with `engine`.
    fn gemm_path(a: &FloatTensor<Self>, engine: Gemm) -> GemmPath {
        burn_only(engine, a.dtype())
    }
}
