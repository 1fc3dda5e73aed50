//! FP8 GEMM and quantizer benchmark.
//!
//! For each `m x n x k` it prints TFLOP/s (2mnk / time) of:
//! - `fp8 gemm`: the FP8 GEMM on operands already quantized (E4M3, 1x128 tiles for `a`, 128x128
//!   blocks for `b`; `--scaling` picks others: the wgrad GEMM's `tile-tile` and `block-tile`, or
//!   one scale per operand), bf16 output, on each path
//!   the device has: `Dequantize`, `CublasLt`
//!   (cuBLASLt's block-scaled FP8 GEMM, CUDA with cuBLASLt >= 12.9), and `TensorCores` (the opt-in
//!   `mma.sync` kernel) where E4M3 MMA exists;
//! - `fp8 q+gemm`: the same including quantizing both bf16 operands (what a linear layer pays);
//! - `bf16 GEMM`: `kernels::gemm` (cuBLASLt on CUDA: the bf16 recipe's GEMMs); `f32`: Burn's f32
//!   matmul;
//!
//! with ratios to cuBLAS on an H100 in docs/peers.md (FP8 per-tensor 1446, BF16 799 TFLOP/s), and
//! the quantizer's GB/s (bytes read + written), and each path's largest difference from the
//! dequantize path's output relative to that output's largest magnitude.
//!
//! Shapes: 4096^3, 8192^3 and GPT-2 small's projections at 16 x 1024 tokens (qkv 768 -> 2304,
//! proj 768 -> 768, fc 768 -> 3072, mlp proj 3072 -> 768).
//!
//! With `--quantizers`, it prints the quantizer alone instead: for GPT-2 small's activations,
//! output gradients and weights at 16 x 1024 tokens and the activations of a width-2048 model
//! (d_ff 8192) at the same tokens, every granularity, each as stored and
//! transposed (the wgrad operands) and both ([`kernels::fp8_quantize_pair`], what the FP8 linear
//! layer runs: the CUDA C++ kernel, the CubeCL kernel, or two passes), the time per call and GB/s of the bytes one read
//! of the input and the codes and scales written come to.
//!
//! `cargo run --release --bin fp8_bench -- [--device cuda|wgpu] [--scaling block|tile-tile|block-tile|tensor] [--shapes 4096x4096x4096,...] [--quantizers]`

use burn::backend::cuda::CudaDevice;
use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Cuda, Wgpu};
use burn::tensor::{Distribution, ElementConversion, FloatDType, Tensor};
use burnmix::bench::{DeviceArg, Triple};
use clap::Parser;
use kernels::{
    fp8_gemm_on, fp8_pair_path, fp8_pair_path_run, fp8_quantize, fp8_quantize_pair_on, Fp8Format,
    Fp8GemmPath, Fp8Granularity, Fp8PairPath, Gemm, QuantSpec,
};

const CUBLAS_FP8: f64 = 1446.0;
const CUBLAS_BF16: f64 = 799.0;

#[derive(Parser)]
#[command(about = "FP8 GEMM and quantizer throughput against bf16 / f32 matmul")]
struct Args {
    /// The backend.
    #[arg(long, value_enum, default_value = "cuda")]
    device: DeviceArg,
    /// FP8 scales: `block` (1x128 tiles for `a`, 128x128 blocks for `b`, as fprop and dgrad
    /// under `fp8.scaling = "tile"`), `tile-tile` and `block-tile` (the wgrad GEMM's operands
    /// under `fp8.wgrad_blocks = "none"` and `"input"`), or `tensor` (one per operand).
    #[arg(long, value_enum, default_value = "block")]
    scaling: Scaling,
    /// Comma-separated MxNxK shapes (default: 4096^3, 8192^3 and the GPT-2 small projections).
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<Triple>,
    /// Calls per timed batch.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Tensor-core cube shapes to compare, `wm,wn,mt,nt` separated by `;` (default: the
    /// kernel's default or `BURNMIX_FP8_MMA_SHAPE`).
    #[arg(long, value_parser = kernels::fp8::MmaShape::parse, value_delimiter = ';')]
    mma_shapes: Vec<kernels::fp8::MmaShape>,
    /// Time the quantizer alone (every granularity, as stored and transposed) instead of the GEMMs.
    #[arg(long)]
    quantizers: bool,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Scaling {
    /// `a` per 1x128 tile, `b` per 128x128 block: fprop and dgrad under `fp8.scaling = "tile"`
    /// (and wgrad with `fp8.wgrad_blocks = "grad_output"`).
    Block,
    /// Both per 1x128 tile: wgrad with `fp8.wgrad_blocks = "none"`.
    TileTile,
    /// `a` per 128x128 block, `b` per 1x128 tile: wgrad with `fp8.wgrad_blocks = "input"`
    /// (`a` is `x^T`).
    BlockTile,
    Tensor,
}

fn time<Bk: kernels::Backend>(dev: &Bk::Device, args: &Args, f: &mut dyn FnMut()) -> f64 {
    burnmix::bench::median_seconds::<Bk>(dev, 2, args.iters, args.reps, f)
}

fn run<Bk: kernels::Backend>(
    dev: &Bk::Device,
    args: &Args,
    shapes: &[(usize, usize, usize)],
    compute: FloatDType,
) {
    println!("| m x n x k | fp8 path | fp8 gemm | fp8 q+gemm | {compute:?} GEMM | f32 matmul | fp8 / {compute:?} | fp8 / cuBLAS FP8 | {compute:?} / cuBLAS BF16 | quantize GB/s | max err vs Dequantize |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &(m, n, k) in shapes {
        let flop = 2.0 * m as f64 * n as f64 * k as f64;
        let tf = |s: f64| flop / s / 1e12;
        let a = Tensor::<Bk, 2>::random([m, k], Distribution::Normal(0.0, 1.0), dev).cast(compute);
        let b = Tensor::<Bk, 2>::random([n, k], Distribution::Normal(0.0, 1.0), dev).cast(compute);
        let (ga, gb) = match args.scaling {
            Scaling::Block => (Fp8Granularity::Tile1x128, Fp8Granularity::Block128),
            Scaling::TileTile => (Fp8Granularity::Tile1x128, Fp8Granularity::Tile1x128),
            Scaling::BlockTile => (Fp8Granularity::Block128, Fp8Granularity::Tile1x128),
            Scaling::Tensor => (Fp8Granularity::Tensor, Fp8Granularity::Tensor),
        };
        let sa = QuantSpec::new(Fp8Format::E4M3, ga);
        let sb = QuantSpec::new(Fp8Format::E4M3, gb);
        let qa = fp8_quantize(a.clone(), sa);
        let qb = fp8_quantize(b.clone(), sb);
        let bt = b.clone().transpose();
        let t_c = time::<Bk>(dev, args, &mut || {
            let _ = kernels::gemm(a.clone(), b.clone(), false, true, Gemm::Auto);
        });
        let (a32, b32) = (
            a.clone().cast(FloatDType::F32),
            bt.clone().cast(FloatDType::F32),
        );
        let t_32 = time::<Bk>(dev, args, &mut || {
            let _ = a32.clone().matmul(b32.clone());
        });
        let t_q = time::<Bk>(dev, args, &mut || {
            let _ = fp8_quantize(a.clone(), sa);
        });
        let elem = if compute == FloatDType::F32 { 4.0 } else { 2.0 };
        let q_bytes = m as f64 * k as f64 * (elem + 1.0) + (m * k.div_ceil(128)) as f64 * 4.0;
        let shapes: Vec<Option<kernels::fp8::MmaShape>> = if args.mma_shapes.is_empty() {
            vec![None]
        } else {
            args.mma_shapes.iter().copied().map(Some).collect()
        };
        // Every path's output against the dequantize path's: max |diff| / max |reference|.
        let reference = fp8_gemm_on(&qa, &qb, compute, Fp8GemmPath::Dequantize)
            .map(|c| c.cast(FloatDType::F32));
        let ref_max = reference
            .as_ref()
            .map(|r| r.clone().abs().max().into_scalar().elem::<f64>());
        let mut runs = vec![
            (Fp8GemmPath::Dequantize, None),
            (Fp8GemmPath::CublasLt, None),
        ];
        runs.extend(shapes.into_iter().map(|s| (Fp8GemmPath::TensorCores, s)));
        for (path, shape) in runs {
            if let Some(shape) = shape {
                // The kernel reads the setting at each launch.
                kernels::settings::update(|s| s.fp8_mma_shape = Some(shape));
            }
            let Some(c) = fp8_gemm_on(&qa, &qb, compute, path) else {
                continue; // not available on this device
            };
            let err = match (&reference, ref_max) {
                (Some(r), Some(rm)) => {
                    (c.cast(FloatDType::F32) - r.clone())
                        .abs()
                        .max()
                        .into_scalar()
                        .elem::<f64>()
                        / rm
                }
                _ => f64::NAN,
            };
            let label = match (&path, &shape) {
                (Fp8GemmPath::TensorCores, Some(s)) => format!("TensorCores {s}"),
                _ => format!("{path:?}"),
            };
            let t_gemm = time::<Bk>(dev, args, &mut || {
                let _ = fp8_gemm_on(&qa, &qb, compute, path);
            });
            let t_qgemm = time::<Bk>(dev, args, &mut || {
                let qa = fp8_quantize(a.clone(), sa);
                let qb = fp8_quantize(b.clone(), sb);
                let _ = fp8_gemm_on(&qa, &qb, compute, path);
            });
            println!(
                "| {m}x{n}x{k} | {label} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.1} | {err:.1e} |",
                tf(t_gemm),
                tf(t_qgemm),
                tf(t_c),
                tf(t_32),
                t_c / t_gemm,
                tf(t_gemm) / CUBLAS_FP8,
                tf(t_c) / CUBLAS_BF16,
                q_bytes / t_q / 1e9
            );
        }
    }
}

/// The quantizer alone on GPT-2 small's operands: microseconds per call and GB/s of the bytes
/// it must move.
fn quantizers<Bk: kernels::Backend>(dev: &Bk::Device, args: &Args, compute: FloatDType) {
    println!("| tensor | [rows, cols] | granularity | transposed | us | GB/s |");
    println!("|---|---|---|---|---|---|");
    let elem = if compute == FloatDType::F32 { 4.0 } else { 2.0 };
    for (name, rows, cols) in [
        ("x (d_model)", 16384, 768),
        ("x (d_ff)", 16384, 3072),
        ("weight fc", 768, 3072),
        ("weight qkv", 768, 2304),
        ("x (width 2048)", 16384, 2048),
        ("x (width 2048, d_ff)", 16384, 8192),
    ] {
        let x = Tensor::<Bk, 2>::random([rows, cols], Distribution::Normal(0.0, 1.0), dev)
            .cast(compute);
        for granularity in [
            Fp8Granularity::Tile1x128,
            Fp8Granularity::Block128,
            Fp8Granularity::Tensor,
        ] {
            for transpose in [false, true] {
                let spec = QuantSpec {
                    transpose,
                    ..QuantSpec::new(Fp8Format::E4M3, granularity)
                };
                let t = time::<Bk>(dev, args, &mut || {
                    let _ = fp8_quantize(x.clone(), spec);
                });
                let (r, k) = if transpose {
                    (cols, rows)
                } else {
                    (rows, cols)
                };
                let scales = (spec.scale_rows(r) * spec.scale_cols(k)) as f64 * 4.0;
                let bytes = (rows * cols) as f64 * (elem + 1.0) + scales;
                println!(
                    "| {name} | [{rows}, {cols}] | {granularity:?} | {transpose} | {:.1} | {:.0} |",
                    t * 1e6,
                    bytes / t / 1e9
                );
            }
            // Both orientations (what the FP8 linear layer runs): one fused kernel, two passes.
            let spec = QuantSpec::new(Fp8Format::E4M3, granularity);
            let scales = (spec.scale_rows(rows) * spec.scale_cols(cols)
                + spec.scale_rows(cols) * spec.scale_cols(rows)) as f64
                * 4.0;
            let bytes = (rows * cols) as f64 * (elem + 2.0) + scales;
            for path in [
                Fp8PairPath::Native,
                Fp8PairPath::Fused,
                Fp8PairPath::Separate,
            ] {
                let runs = fp8_pair_path_run(&x, path);
                if runs != path {
                    println!(
                        "| {name} | [{rows}, {cols}] | {granularity:?} | both: {path:?} (not on this device: runs {runs:?}) | | |"
                    );
                    continue;
                }
                let t = time::<Bk>(dev, args, &mut || {
                    let _ = fp8_quantize_pair_on(x.clone(), spec, path);
                });
                let default = if fp8_pair_path(&spec) == path {
                    ", the default"
                } else {
                    ""
                };
                println!(
                    "| {name} | [{rows}, {cols}] | {granularity:?} | both: {path:?}{default} | {:.1} | {:.0} |",
                    t * 1e6,
                    bytes / t / 1e9
                );
            }
        }
    }
}

fn main() {
    let args = Args::parse();
    kernels::kernel_cache::cache_per_build();
    let shapes = if !args.shapes.is_empty() {
        args.shapes
            .iter()
            .map(|&Triple([m, n, k])| (m, n, k))
            .collect()
    } else {
        vec![
            (4096, 4096, 4096),
            (8192, 8192, 8192),
            (16384, 2304, 768),
            (16384, 768, 768),
            (16384, 3072, 768),
            (16384, 768, 3072),
        ]
    };
    if args.quantizers {
        match args.device {
            DeviceArg::Cuda => quantizers::<Cuda>(&CudaDevice::default(), &args, FloatDType::BF16),
            DeviceArg::Wgpu => {
                quantizers::<Wgpu>(&WgpuDevice::DefaultDevice, &args, FloatDType::F32)
            }
        }
        return;
    }
    match args.device {
        DeviceArg::Cuda => run::<Cuda>(&CudaDevice::default(), &args, &shapes, FloatDType::BF16),
        DeviceArg::Wgpu => run::<Wgpu>(&WgpuDevice::DefaultDevice, &args, &shapes, FloatDType::F32),
    }
}
