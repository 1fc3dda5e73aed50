//! What one cuBLASLt call is: the operands' layouts, the problem that selects an algorithm
//! (types, shape, layouts, alignments) and its one-line description for messages.

use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cublaslt::sys;

/// A row-major matrix as cuBLASLt reads it: `rows x cols` with leading dimension `ld`, transposed
/// by the GEMM when `trans`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Layout {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) ld: usize,
    pub(super) trans: bool,
}

/// The layout of a 2-D tensor with the GEMM's flag, if its strides are a row-major or a
/// column-major (transposed view) matrix; `None` if it needs a copy first.
pub(super) fn layout(shape: [usize; 2], strides: [usize; 2], trans: bool) -> Option<Layout> {
    let [r, c] = shape;
    let [s0, s1] = strides;
    // One row or one column: the stride along the length-1 axis is never used.
    if r == 1 && (s1 == 1 || c == 1) {
        return Some(Layout {
            rows: 1,
            cols: c,
            ld: c,
            trans,
        });
    }
    if c == 1 && r > 1 && s0 >= 1 {
        return Some(Layout {
            rows: r,
            cols: 1,
            ld: s0,
            trans,
        });
    }
    if s1 == 1 && s0 >= c {
        return Some(Layout {
            rows: r,
            cols: c,
            ld: s0,
            trans,
        });
    }
    // A transposed view: the storage is row-major [c, r], read with the opposite flag.
    if s0 == 1 && s1 >= r {
        return Some(Layout {
            rows: c,
            cols: r,
            ld: s1,
            trans: !trans,
        });
    }
    None
}

pub(super) fn dims2(t: &CubeTensor<CudaRuntime>) -> ([usize; 2], [usize; 2]) {
    let (s, st) = (t.meta.shape(), t.meta.strides());
    ([s[0], s[1]], [st[0], st[1]])
}

/// The operand's layout, copying it to contiguous rows first if its strides are neither layout.
pub(super) fn operand(
    t: CubeTensor<CudaRuntime>,
    trans: bool,
) -> (CubeTensor<CudaRuntime>, Layout) {
    let (shape, strides) = dims2(&t);
    if let Some(l) = layout(shape, strides, trans) {
        return (t, l);
    }
    let t = into_contiguous(t);
    let (shape, strides) = dims2(&t);
    let l = layout(shape, strides, trans).expect("a contiguous matrix is row-major");
    (t, l)
}

/// Everything that selects an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Problem {
    /// cuBLASLt's data types of its A (our `b`), its B (our `a`) and C/D.
    pub(super) types: [sys::cudaDataType; 3],
    pub(super) compute: sys::cublasComputeType_t,
    /// Scale modes of cuBLASLt's A and B (FP8).
    pub(super) scale_modes: Option<[sys::cublasLtMatmulMatrixScale_t; 2]>,
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) a: Layout,
    pub(super) b: Layout,
    /// Largest power of two (<= 256 bytes) dividing each of the pointers of A, B and C (C's
    /// entry also divides the epilogue's auxiliary matrix's, where it has one).
    pub(super) align: [u32; 3],
    /// What the call does to the product before writing it.
    pub(super) epilogue: Epilogue,
}

/// What a call does to the product before writing it (cuBLASLt's epilogue). The GELU is
/// cuBLASLt's, the tanh approximation: `x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`,
/// computed from the f32 accumulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// The product as it is.
    None,
    /// `gelu(p)`: `CUBLASLT_EPILOGUE_GELU`.
    Gelu,
    /// `gelu(p)` into the output and `p` itself into the auxiliary matrix (the pre-activation,
    /// which the backward reads): `CUBLASLT_EPILOGUE_GELU_AUX`.
    GeluAux,
    /// `p * gelu'(h)` with `h` read from the auxiliary matrix (the pre-activation a
    /// [`Epilogue::GeluAux`] call wrote): `CUBLASLT_EPILOGUE_DGELU`.
    DGelu,
}

impl Epilogue {
    /// cuBLASLt's epilogue, or `None` for its default.
    pub(super) fn cublaslt(self) -> Option<sys::cublasLtEpilogue_t> {
        use sys::cublasLtEpilogue_t::*;
        match self {
            Epilogue::None => None,
            Epilogue::Gelu => Some(CUBLASLT_EPILOGUE_GELU),
            Epilogue::GeluAux => Some(CUBLASLT_EPILOGUE_GELU_AUX),
            Epilogue::DGelu => Some(CUBLASLT_EPILOGUE_DGELU),
        }
    }
}

pub(super) fn data_type(dtype: DType) -> Option<(sys::cudaDataType, sys::cublasComputeType_t)> {
    use sys::cublasComputeType_t::*;
    use sys::cudaDataType::*;
    match dtype {
        DType::BF16 => Some((CUDA_R_16BF, CUBLAS_COMPUTE_32F)),
        DType::F16 => Some((CUDA_R_16F, CUBLAS_COMPUTE_32F)),
        // True f32 (PyTorch's default for f32 matmuls): the fp32 recipe is the accurate
        // reference the other recipes are compared with, so its GEMMs take no TF32 shortcut.
        DType::F32 => Some((CUDA_R_32F, CUBLAS_COMPUTE_32F)),
        _ => None,
    }
}

pub(super) fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        (1u64 << ptr.trailing_zeros().min(8)) as u32
    }
}

/// A cuBLASLt data type's short name.
fn type_name(t: sys::cudaDataType) -> &'static str {
    use sys::cudaDataType::*;
    match t {
        CUDA_R_16BF => "bf16",
        CUDA_R_16F => "f16",
        CUDA_R_32F => "f32",
        CUDA_R_8F_E4M3 => "e4m3",
        CUDA_R_8F_E5M2 => "e5m2",
        _ => "?",
    }
}

/// A problem in one line, for messages.
pub(super) fn describe(p: &Problem) -> String {
    let [tb, ta, tc] = p.types;
    let epilogue = match p.epilogue {
        Epilogue::None => "",
        Epilogue::Gelu => " with GELU in the epilogue",
        Epilogue::GeluAux => " with GELU (and its input) in the epilogue",
        Epilogue::DGelu => " with GELU's derivative in the epilogue",
    };
    let call = match p.scale_modes {
        None => format!(
            "{}{} [m, k, n] = [{}, {}, {}] (leading dimensions {}, {})",
            type_name(ta),
            if tc == ta {
                String::new()
            } else {
                format!(" into {}", type_name(tc))
            },
            p.m,
            p.k,
            p.n,
            p.a.ld,
            p.b.ld
        ),
        Some([sb, sa]) => format!(
            "FP8 {} x {} [m, k, n] = [{}, {}, {}] (scales {sa:?} x {sb:?}, out {})",
            type_name(ta),
            type_name(tb),
            p.m,
            p.k,
            p.n,
            type_name(tc)
        ),
    };
    call + epilogue
}
