//! A problem's cuBLASLt descriptors and the heuristic's algorithms for it.

use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys};

use super::problem::{Epilogue, Problem};
use super::WORKSPACE_BYTES;

/// The descriptors of one call, destroyed on drop.
pub(super) struct Call {
    pub(super) desc: sys::cublasLtMatmulDesc_t,
    /// B's buffer (cuBLASLt's A), A's buffer (cuBLASLt's B), and C.
    pub(super) first: sys::cublasLtMatrixLayout_t,
    pub(super) second: sys::cublasLtMatrixLayout_t,
    pub(super) out: sys::cublasLtMatrixLayout_t,
}

impl Call {
    /// `sm_target`: the number of SMs cuBLASLt plans the GEMM for (`SM_COUNT_TARGET`), when
    /// others are busy.
    ///
    /// # Safety
    /// Plain descriptor creation; the caller destroys `Call` before the handle. With
    /// `p.scale_modes`, the scale pointers are set per call ([`Call::set_scales`]).
    pub(super) unsafe fn new(p: &Problem, sm_target: Option<i32>) -> Result<Self, lt::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t::*;
        let desc = lt::create_matmul_desc(p.compute, sys::cudaDataType::CUDA_R_32F)?;
        let mut call = Self {
            desc,
            first: std::ptr::null_mut(),
            second: std::ptr::null_mut(),
            out: std::ptr::null_mut(),
        };
        let set = |attr, value: *const c_void, size: usize| {
            lt::set_matmul_desc_attribute(desc, attr, value, size)
        };
        // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (an int32).
        let (op_a, op_b) = (p.b.trans as i32, p.a.trans as i32);
        set(
            CUBLASLT_MATMUL_DESC_TRANSA,
            &op_a as *const i32 as *const c_void,
            4,
        )?;
        set(
            CUBLASLT_MATMUL_DESC_TRANSB,
            &op_b as *const i32 as *const c_void,
            4,
        )?;
        if let Some(sms) = sm_target {
            set(
                CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                &sms as *const i32 as *const c_void,
                4,
            )?;
        }
        if let Some(epilogue) = p.epilogue.cublaslt() {
            let code = epilogue as u32;
            set(
                CUBLASLT_MATMUL_DESC_EPILOGUE,
                &code as *const u32 as *const c_void,
                4,
            )?;
        }
        if matches!(p.epilogue, Epilogue::GeluAux | Epilogue::DGelu) {
            // The auxiliary matrix (the pre-activation) has the output's layout: cuBLASLt's
            // column-major [n, m] with leading dimension n. Its address is set per call
            // ([`Call::set_aux`]).
            let ld = p.n as i64;
            set(
                CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                &ld as *const i64 as *const c_void,
                8,
            )?;
        }
        if let Some([mode_a, mode_b]) = p.scale_modes {
            // Per-tensor scales are the default mode (and older cuBLASLt has no mode attribute).
            let scalar = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
            if (mode_a, mode_b) != (scalar, scalar) {
                let (mode_a, mode_b) = (mode_a as i32, mode_b as i32);
                set(
                    CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                    &mode_a as *const i32 as *const c_void,
                    4,
                )?;
                set(
                    CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                    &mode_b as *const i32 as *const c_void,
                    4,
                )?;
            }
            // f32 accumulation promoted as cuBLASLt's block scaling requires (no fast
            // accumulation).
            let fast: i8 = 0;
            set(
                CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                &fast as *const i8 as *const c_void,
                1,
            )?;
        }
        let [ta, tb, td] = p.types;
        // A row-major [rows, cols] matrix with leading dimension ld is column-major [cols, rows].
        call.first = lt::create_matrix_layout(ta, p.b.cols as u64, p.b.rows as u64, p.b.ld as i64)?;
        call.second =
            lt::create_matrix_layout(tb, p.a.cols as u64, p.a.rows as u64, p.a.ld as i64)?;
        call.out = lt::create_matrix_layout(td, p.n as u64, p.m as u64, p.n as i64)?;
        Ok(call)
    }

    /// Sets the device addresses of cuBLASLt's A and B scales (FP8) for the next call.
    ///
    /// # Safety
    /// The addresses must stay valid until the call queued with them has run.
    pub(super) unsafe fn set_scales(&self, sa: u64, sb: u64) -> Result<(), lt::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t::*;
        for (attr, ptr) in [
            (CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa as *const c_void),
            (CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb as *const c_void),
        ] {
            lt::set_matmul_desc_attribute(
                self.desc,
                attr,
                &ptr as *const *const c_void as *const c_void,
                std::mem::size_of::<*const c_void>(),
            )?;
        }
        Ok(())
    }

    /// Sets the device address of the epilogue's auxiliary matrix for the next call (and for the
    /// heuristic, which reads its alignment from it).
    ///
    /// # Safety
    /// The address must stay valid until the call queued with it has run.
    pub(super) unsafe fn set_aux(&self, aux: u64) -> Result<(), lt::CublasError> {
        let ptr = aux as *const c_void;
        lt::set_matmul_desc_attribute(
            self.desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &ptr as *const *const c_void as *const c_void,
            std::mem::size_of::<*const c_void>(),
        )
    }

    /// cuBLASLt's heuristic's results for this problem within the workspace and alignments, at
    /// most `count`, its first choice first; empty where it has none.
    pub(super) unsafe fn heuristics(
        &self,
        handle: sys::cublasLtHandle_t,
        p: &Problem,
        count: usize,
    ) -> Result<Vec<sys::cublasLtMatmulAlgo_t>, lt::CublasError> {
        let pref = lt::create_matmul_pref()?;
        let result = (|| {
            use sys::cublasLtMatmulPreferenceAttributes_t::*;
            let ws = WORKSPACE_BYTES as u64;
            lt::set_matmul_pref_attribute(
                pref,
                CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )?;
            // cuBLASLt's A is B's buffer and its B is A's.
            for (attr, align) in [
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align[1]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align[0]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.align[2]),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align[2]),
            ] {
                lt::set_matmul_pref_attribute(
                    pref,
                    attr,
                    &align as *const u32 as *const c_void,
                    4,
                )?;
            }
            // Split-K partial sums only in f32. Otherwise cuBLASLt may add a low-precision
            // output's partial sums in that precision (the in-place and output-type reduction
            // schemes): on an H200 it split a bf16 [64, 32] x [32, 301] product 88 ways with
            // bf16 partial sums and a fifth of the entries came out wrong by up to 180 units of
            // the bound in `kernel_cases::gemm_rounding`. The heuristic's choices at GPT-2's
            // shapes already reduce in f32, so they are unchanged.
            if p.types[2] != sys::cudaDataType::CUDA_R_32F {
                use sys::cublasLtReductionScheme_t::*;
                let mask = CUBLASLT_REDUCTION_SCHEME_NONE as u32
                    | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
                lt::set_matmul_pref_attribute(
                    pref,
                    CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    &mask as *const u32 as *const c_void,
                    4,
                )?;
            }
            let mut results = Vec::<sys::cublasLtMatmulHeuristicResult_t>::with_capacity(count);
            let mut found = 0i32;
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                self.desc,
                self.first,
                self.second,
                self.out,
                self.out,
                pref,
                count as i32,
                results.as_mut_ptr(),
                &mut found,
            )
            .result()?;
            // cuBLASLt wrote the first `found` results.
            results.set_len((found.max(0) as usize).min(count));
            Ok(results
                .into_iter()
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo)
                .collect())
        })();
        let _ = lt::destroy_matmul_pref(pref);
        result
    }

    /// Whether `algo` can run this problem within the workspace (`cublasLtMatmulAlgoCheck`):
    /// for an algorithm that did not come from this process's heuristic.
    pub(super) unsafe fn check(
        &self,
        handle: sys::cublasLtHandle_t,
        algo: &sys::cublasLtMatmulAlgo_t,
    ) -> Result<(), String> {
        let mut result = std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::zeroed();
        sys::cublasLtMatmulAlgoCheck(
            handle,
            self.desc,
            self.first,
            self.second,
            self.out,
            self.out,
            algo,
            result.as_mut_ptr(),
        )
        .result()
        .map_err(|e| format!("cublasLtMatmulAlgoCheck: {e:?}"))?;
        // cuBLASLt filled the result in.
        let needs = result.assume_init().workspaceSize;
        if needs > WORKSPACE_BYTES {
            return Err(format!(
                "needs {needs} bytes of workspace, more than the {WORKSPACE_BYTES} given"
            ));
        }
        Ok(())
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Call::new` and is destroyed once.
        unsafe {
            for l in [self.first, self.second, self.out] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}
