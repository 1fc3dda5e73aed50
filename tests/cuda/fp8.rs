//! The FP8 kernels on CUDA: the quantizers bit for bit against the CPU reference, the GEMM paths
//! (dequantize, `mma.sync`, cuBLASLt, a queued cuBLASLt call that fails) against the dequantized
//! operands, the FP8 linear layer, and the exactness that ZeRO-3's FP8 wire rests on.

use crate::fp8_cases;
use crate::kernels::{gemms_in_order, no_fallbacks};

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::FloatDType;

type B = Autodiff<Cuda>;

/// FP8 quantizer payload and scales bit-identical to the CPU reference (inputs f32, f16, bf16).
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_quantizer() {
    let shapes = [(1, 1), (37, 300), (130, 128), (257, 129), (1000, 768)];
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        fp8_cases::quantizer_bit_identical::<Cuda>(dtype, &CudaDevice::default(), &shapes);
    }
}

/// What ZeRO-3's FP8 wire rests on, with CUDA's quantizer and dequantizer (f32 and bf16 weights,
/// one to four ranks): row shards of a multiple of 128 rows quantize with 128 x 128 blocks to the
/// whole weight's codes and scales, and the dequantized codes quantize again to the same values.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_weight_shards_gather_exactly() {
    let shapes = [(300, 200), (256, 384), (1000, 130), (2048, 768)];
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        fp8_cases::wire::weight_shards_gather_exactly::<Cuda>(
            dtype,
            &CudaDevice::default(),
            &shapes,
            &[1, 2, 3, 4],
        );
    }
}

/// Shapes for the two-orientation quantizers: some take the native kernel's 8-wide loads
/// ([130, 128], [1000, 768], [136, 2056]), the others its element-wise reads (odd widths; the
/// transposed views are read element by element too).
const PAIR_SHAPES: [(usize, usize); 6] = [
    (1, 1),
    (37, 300),
    (130, 128),
    (257, 129),
    (1000, 768),
    (136, 2056),
];

/// The CubeCL two-orientation FP8 quantizer bit-identical to the CPU reference (f32, f16, bf16).
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_quantize_pair() {
    let dev = CudaDevice::default();
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        fp8_cases::quantize_pair_bit_identical::<Cuda>(
            dtype,
            &dev,
            &PAIR_SHAPES,
            kernels::Fp8PairPath::Fused,
        );
    }
}

/// The CUDA C++ two-orientation FP8 quantizer (the GPU's FP8 conversions) bit-identical to the
/// CPU reference (f32, f16, bf16); fails on a GPU where it would not run.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_quantize_pair_native() {
    use burn::tensor::Tensor;
    use kernels::{fp8_pair_path_run, Fp8PairPath};
    let dev = CudaDevice::default();
    let probe = Tensor::<Cuda, 2>::zeros([8, 8], &dev);
    assert_eq!(
        fp8_pair_path_run(&probe, Fp8PairPath::Native),
        Fp8PairPath::Native,
        "the native FP8 quantizer does not run on this GPU (compute capability 8.9+ needed)"
    );
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        fp8_cases::quantize_pair_bit_identical::<Cuda>(
            dtype,
            &dev,
            &PAIR_SHAPES,
            Fp8PairPath::Native,
        );
    }
}

/// GELU and packed SwiGLU, and their gradients, quantized inside the CUDA C++ pair kernel (the
/// FP8 MLP's producer) against the activation kernels' outputs quantized apart (f32, f16, bf16;
/// every path of the kernel: 8-wide and element-wise reads, value-by-value tiles); fails on a GPU
/// where it would not run. With `BURNMIX_FP8_PAIR=fused` the two run apart: exactly the
/// composition.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_act_quantize_pair() {
    use burn::tensor::Tensor;
    use kernels::{fp8_pair_path_run, Fp8PairPath};
    let dev = CudaDevice::default();
    let probe = Tensor::<Cuda, 2>::zeros([8, 8], &dev);
    assert_eq!(
        fp8_pair_path_run(&probe, Fp8PairPath::Native),
        Fp8PairPath::Native,
        "the CUDA C++ FP8 quantizer does not run on this GPU (compute capability 8.9+ needed)"
    );
    use fp8_cases::mlp::act_quantize_pair_matches;
    use kernels::Fp8MlpActivation::{Gelu, SwigluPacked};
    let producer = kernels::settings::scoped(|s| s.fp8_swiglu_producer = true);
    for act in [Gelu, SwigluPacked] {
        for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
            act_quantize_pair_matches::<Cuda>(act, dtype, &dev, &PAIR_SHAPES, false);
        }
    }
    drop(producer);
    let _settings = kernels::settings::scoped(|s| s.fp8_pair = Some(Fp8PairPath::Fused));
    for act in [Gelu, SwigluPacked] {
        act_quantize_pair_matches::<Cuda>(act, FloatDType::BF16, &dev, &PAIR_SHAPES, true);
    }
}

/// The FP8 MLP as one op (the activation's output and gradient quantized in its kernels; GELU
/// and packed SwiGLU) against its composition of separate ops and against the MLP in f32, on the
/// default GEMM path (cuBLASLt on Hopper; the dequantize path for the shapes it refuses).
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_mlp() {
    use kernels::Fp8MlpActivation::{Gelu, SwigluPacked};
    let _producer = kernels::settings::scoped(|s| s.fp8_swiglu_producer = true);
    let gelu = [
        (64, 256, 512, 96),
        (100, 130, 200, 72),
        (512, 768, 3072, 768),
    ];
    // Llama's shapes scaled down (SwiGLU's ff of 8/3 the width, rounded), and an ff that is not
    // a multiple of 8 (the producer's element-wise reads).
    let swiglu = [
        (64, 256, 384, 96),
        (100, 130, 100, 72),
        (512, 768, 2048, 768),
    ];
    for (act, shapes) in [(Gelu, &gelu), (SwigluPacked, &swiglu)] {
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            fp8_cases::mlp::mlp_matches_composition::<B>(
                act,
                dtype,
                &CudaDevice::default(),
                shapes,
                false,
            );
        }
    }
    no_fallbacks("the FP8 MLP on its default path");
}

/// Delayed per-tensor FP8 scaling (amax histories) on the CUDA C++ pair kernel, which records
/// the amax from its own read, and on the single quantizer, bit for bit against the CPU reference
/// (f32 with NaN and infinities, f16, bf16).
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_delayed_scaling() {
    let dev = CudaDevice::default();
    let shapes = [(3, 5), (37, 300), (257, 129), (1000, 768)];
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        fp8_cases::delayed_scaling::<Cuda>(dtype, &dev, &shapes);
    }
}

/// FP8 health (one kernel over values and codes) against the CPU reference (f32, f16, bf16).
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_health() {
    let shapes = [(1, 1), (37, 300), (257, 129), (1000, 768)];
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        fp8_cases::health_matches_reference::<Cuda>(dtype, &CudaDevice::default(), &shapes);
    }
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_gemm() {
    let shapes = [(1, 1, 1), (33, 17, 300), (130, 70, 256), (256, 384, 768)];
    for out in [FloatDType::F32, FloatDType::BF16] {
        fp8_cases::gemm_against_dequantized::<Cuda>(
            &CudaDevice::default(),
            out,
            &shapes,
            kernels::Fp8GemmPath::Dequantize,
        );
    }
}

/// The FP8 tensor-core GEMM (opt-in in `fp8_gemm`, forced here) against the dequantized operands.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_gemm_mma() {
    let shapes = [
        (1, 1, 1),
        (33, 17, 300),
        (130, 70, 256),
        (256, 384, 768),
        (200, 1000, 129),
    ];
    for out in [FloatDType::F32, FloatDType::BF16] {
        fp8_cases::gemm_against_dequantized::<Cuda>(
            &CudaDevice::default(),
            out,
            &shapes,
            kernels::Fp8GemmPath::TensorCores,
        );
    }
}

/// The FP8 GEMM on cuBLASLt (1x128 x 128x128 block scales, E5M2 x E4M3, per-tensor scales)
/// against the dequantized operands; k not a multiple of 128 included; m or n not a multiple of 8
/// must be refused (the dequantize path takes those).
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_gemm_cublaslt() {
    let shapes = [
        (7, 16, 128),
        (32, 64, 300),
        (128, 256, 256),
        (96, 1000, 129),
        (256, 384, 768),
    ];
    for out in [FloatDType::F32, FloatDType::BF16] {
        fp8_cases::gemm_against_dequantized::<Cuda>(
            &CudaDevice::default(),
            out,
            &shapes,
            kernels::Fp8GemmPath::CublasLt,
        );
    }
    // The shapes that must run on cuBLASLt do.
    let dev = CudaDevice::default();
    let a = burn::tensor::Tensor::<Cuda, 2>::random(
        [128, 256],
        burn::tensor::Distribution::Default,
        &dev,
    );
    let spec = |g| kernels::QuantSpec::new(kernels::Fp8Format::E4M3, g);
    let qa = kernels::fp8_quantize(a.clone(), spec(kernels::Fp8Granularity::Tile1x128));
    let qb = kernels::fp8_quantize(a, spec(kernels::Fp8Granularity::Block128));
    assert!(
        kernels::fp8_gemm_on(&qa, &qb, FloatDType::BF16, kernels::Fp8GemmPath::CublasLt).is_some(),
        "cuBLASLt refused a 128 x 256 x 128 E4M3 GEMM"
    );
}

/// The FP8 linear layer with every GEMM on cuBLASLt (`BURNMIX_FP8_GEMM=cublaslt`): wiring,
/// quality and the passes switched off, as `cuda_fp8_linear`.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_linear_cublaslt() {
    let _settings = kernels::settings::scoped(|s| {
        s.fp8_gemm = kernels::settings::Fp8GemmChoice::Path(kernels::Fp8GemmPath::CublasLt)
    });
    let shapes = [(64, 256, 96), (128, 768, 2304)];
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        fp8_cases::linear::<B>(dtype, &CudaDevice::default(), &shapes);
    }
    no_fallbacks("the FP8 linear layer on cuBLASLt");
}

/// The FP8 linear layer on the dequantize path (`BURNMIX_FP8_GEMM=dequantize`), the reference the
/// default path (cuBLASLt on Hopper) replaces.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_linear_dequantize() {
    let _settings = kernels::settings::scoped(|s| {
        s.fp8_gemm = kernels::settings::Fp8GemmChoice::Path(kernels::Fp8GemmPath::Dequantize)
    });
    let shapes = [(64, 256, 96), (100, 130, 200)];
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        fp8_cases::linear::<B>(dtype, &CudaDevice::default(), &shapes);
    }
}

/// The FP8 linear layer on the default path: cuBLASLt's block-scaled GEMM on Hopper (where the
/// CUDA suite runs), with the shapes cuBLASLt refuses (m or n not a multiple of 8) on the
/// dequantize path.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_linear() {
    let shapes = [(64, 256, 96), (100, 130, 200), (512, 768, 2304)];
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        fp8_cases::linear::<B>(dtype, &CudaDevice::default(), &shapes);
    }
    no_fallbacks("the FP8 linear layer on its default path");
}

/// A queued FP8 GEMM (a problem that has run on cuBLASLt before, sent to the device thread
/// without the caller waiting) that fails there is computed on that thread from the dequantized
/// operands, into the output the caller already holds, and counted as a fallback. The failure is
/// forced with a test hook; both results must match the product of the operands' values.
#[test]
#[ignore = "needs CUDA"]
fn cuda_fp8_gemm_queued_fallback() {
    use burn::tensor::{Distribution, Tensor};
    use kernels::{Fp8Format, Fp8GemmPath, Fp8Granularity, QuantSpec};
    drop(gemms_in_order(kernels::settings::GemmOrder::Same));
    let dev = CudaDevice::default();
    // Integers in -2..=2: their codes and power-of-two scales are exact, so the product is known.
    let ints = |shape: [usize; 2]| {
        Tensor::<Cuda, 2>::random(shape, Distribution::Uniform(-2.0, 3.0), &dev).floor()
    };
    let (m, n, k) = (256, 384, 640);
    let (a, b) = (ints([m, k]), ints([n, k]));
    let expected = a
        .clone()
        .matmul(b.clone().transpose())
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let qa = kernels::fp8_quantize(
        a,
        QuantSpec::new(Fp8Format::E4M3, Fp8Granularity::Tile1x128),
    );
    let qb = kernels::fp8_quantize(b, QuantSpec::new(Fp8Format::E4M3, Fp8Granularity::Block128));
    let run = || {
        kernels::fp8_gemm_on(&qa, &qb, FloatDType::F32, Fp8GemmPath::CublasLt)
            .expect("cuBLASLt takes a 256 x 384 x 640 E4M3 GEMM")
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let check = |who: &str, got: &[f32]| {
        let wrong = got
            .iter()
            .zip(&expected)
            .filter(|(g, e)| (*g - *e).abs() > 1e-3 * e.abs().max(1.0))
            .count();
        assert_eq!(
            wrong,
            0,
            "{who}: {wrong} of {} values differ from the product",
            got.len()
        );
    };
    assert!(
        expected.iter().any(|&v| v != 0.0),
        "the product is all zeros"
    );
    // The first call waits for cuBLASLt (a new problem); the second is queued.
    check("cuBLASLt", &run());
    let before = kernels::gemm::cublaslt_fallbacks_on_this_thread();
    let refused = {
        let _refuse = kernels::settings::scoped(|s| s.gemm_refuse_queued = true);
        run()
    };
    assert_eq!(
        kernels::gemm::cublaslt_fallbacks_on_this_thread(),
        before + 1,
        "the queued FP8 GEMM should have been refused and fallen back once"
    );
    check("the queued GEMM's fallback", &refused);
}
