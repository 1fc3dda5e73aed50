//! The record of the GEMM algorithms chosen by timing (`BURNMIX_GEMM_ALGO=timed`), read back as a
//! new process of the run would: part of `kernels::cuda_gemm_timed_algorithms`, which times the
//! problems first.

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::FloatDType;

use crate::kernel_cases;
use crate::kernels::no_fallbacks;

type B = Autodiff<Cuda>;

/// After `timed` problems were timed on `dev`: their record, read back once every plan and
/// algorithm is forgotten, gives the same products the recorded algorithms instead of timing them
/// again, with the same results; another cuBLASLt release's record is refused whole.
pub fn reads_back(timed: usize, dev: &CudaDevice) {
    let record = kernels::gemm::gemm_algorithms_record().expect("a record of the timed problems");
    let entries = record.lines().skip(2).count();
    assert!(
        entries >= timed,
        "{entries} entries for {timed} timed problems:\n{record}"
    );
    kernels::gemm::forget_gemm_algorithms();
    assert_eq!(kernels::gemm::gemm_algorithms_record(), None);
    assert_eq!(kernels::gemm::read_gemm_algorithms(&record), Ok(entries));
    let used_before = kernels::gemm::gemm_algorithms_read_and_used();
    kernel_cases::gemm_rounding::<B>(
        FloatDType::BF16,
        dev,
        kernels::Gemm::CublasLt,
        &[[64, 32, 301], [16, 4096, 24], [512, 768, 384]],
    );
    kernel_cases::gelu_tanh_mlp::<B>(
        FloatDType::BF16,
        dev,
        kernels::Gemm::CublasLt,
        &[[512, 256, 1024, 256]],
    );
    no_fallbacks("GEMMs on recorded algorithms");
    let used = kernels::gemm::gemm_algorithms_read_and_used() - used_before;
    let timed_again = kernels::gemm::timed_gemms().len() - timed;
    assert!(
        used >= 1,
        "no problem took a recorded algorithm ({timed_again} timed again):\n{record}"
    );
    let version = kernels::gemm::cublaslt_status().expect("cuBLASLt loads");
    let other = record.replacen(&format!("cublaslt {version}"), "cublaslt 1", 1);
    let refused = kernels::gemm::read_gemm_algorithms(&other).unwrap_err();
    assert!(refused.contains("cuBLASLt 1,"), "{refused}");
}
