//! GEMM benchmark: `kernels::gemm` on cuBLASLt beside Burn's matmul, on the same buffers.
//!
//! For each `M, K, N` and dtype it prints TFLOP/s (2MKN / time) of the three GEMMs of a linear
//! layer `y [M, N] = x [M, K] W [K, N]`:
//! - `fprop`: `x W` (no transposes);
//! - `dgrad`: `dy W^T` (`[M, N] x [K, N]^T`);
//! - `wgrad`: `x^T dy` (`[M, K]^T x [M, N]`);
//!
//! on the engine `Gemm::Auto` resolves to (cuBLASLt on CUDA) and on Burn's matmul, with their
//! ratio, the ratio to cuBLASLt called directly on Burn's buffers (bf16 fprop figures measured on
//! an H100 on 2026-11-23, docs/peers.md), and the largest difference between the two engines'
//! outputs relative to the largest output magnitude.
//!
//! `cargo run --release --bin gemm_bench -- [--device cuda|wgpu] [--dtypes bf16,f16,f32] [--shapes MxKxN,...]`

use burn::backend::cuda::CudaDevice;
use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Cuda, Wgpu};
use burn::tensor::{Distribution, ElementConversion, FloatDType, Tensor};
use burnmix::bench::{DTypeArg, DeviceArg, Triple};
use clap::Parser;
use kernels::Gemm;

/// cuBLASLt bf16 TFLOP/s on an H100 by `[M, K, N]` (fprop), called directly on Burn's buffers
/// without synchronisation (docs/peers.md).
const CUBLASLT_BF16: [([usize; 3], f64); 8] = [
    ([8192, 8192, 8192], 786.0),
    ([4096, 4096, 4096], 781.0),
    ([16384, 768, 2304], 645.0),
    ([16384, 768, 768], 582.0),
    ([16384, 768, 3072], 642.0),
    ([16384, 3072, 768], 744.0),
    ([16384, 768, 50304], 669.0),
    ([768, 16384, 2304], 675.0),
];

#[derive(Parser)]
#[command(about = "kernels::gemm (cuBLASLt on CUDA) against Burn's matmul")]
struct Args {
    /// The backend.
    #[arg(long, value_enum, default_value = "cuda")]
    device: DeviceArg,
    /// Comma-separated dtypes.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "bf16,f16")]
    dtypes: Vec<DTypeArg>,
    /// Comma-separated MxKxN shapes (default: 4096^3, 8192^3 and GPT-2 small's GEMMs at
    /// 16 x 1024 tokens).
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<Triple>,
    /// Calls per timed batch.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 7)]
    reps: usize,
}

fn run<Bk: kernels::Backend>(
    dev: &Bk::Device,
    args: &Args,
    shapes: &[[usize; 3]],
    dtypes: &[FloatDType],
) {
    println!("| M, K, N | dtype | GEMM | engine | engine TFLOP/s | Burn TFLOP/s | engine / Burn | engine / cuBLASLt (bf16 fprop) | max diff / max |out| |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &dtype in dtypes {
        for &[m, k, n] in shapes {
            let flop = 2.0 * m as f64 * k as f64 * n as f64;
            let x =
                Tensor::<Bk, 2>::random([m, k], Distribution::Normal(0.0, 1.0), dev).cast(dtype);
            let w =
                Tensor::<Bk, 2>::random([k, n], Distribution::Normal(0.0, 1.0), dev).cast(dtype);
            let dy =
                Tensor::<Bk, 2>::random([m, n], Distribution::Normal(0.0, 1.0), dev).cast(dtype);
            let peer = CUBLASLT_BF16
                .iter()
                .find(|(s, _)| *s == [m, k, n])
                .map(|&(_, t)| t);
            let gemms: [(&str, &Tensor<Bk, 2>, &Tensor<Bk, 2>, bool, bool); 3] = [
                ("fprop", &x, &w, false, false),
                ("dgrad", &dy, &w, false, true),
                ("wgrad", &x, &dy, true, false),
            ];
            for (name, a, b, ta, tb) in gemms {
                let path = kernels::gemm::gemm_path(a, Gemm::Auto);
                let ours =
                    kernels::gemm(a.clone(), b.clone(), ta, tb, Gemm::Auto).cast(FloatDType::F32);
                let burn =
                    kernels::gemm(a.clone(), b.clone(), ta, tb, Gemm::Burn).cast(FloatDType::F32);
                let max = burn.clone().abs().max().into_scalar().elem::<f64>();
                let diff = (ours - burn).abs().max().into_scalar().elem::<f64>() / max;
                let t_ours = burnmix::bench::median_seconds::<Bk>(
                    dev,
                    2,
                    args.iters,
                    args.reps,
                    &mut || {
                        let _ = kernels::gemm(a.clone(), b.clone(), ta, tb, Gemm::Auto);
                    },
                );
                let t_burn = burnmix::bench::median_seconds::<Bk>(
                    dev,
                    2,
                    args.iters,
                    args.reps,
                    &mut || {
                        let _ = kernels::gemm(a.clone(), b.clone(), ta, tb, Gemm::Burn);
                    },
                );
                let (tf_ours, tf_burn) = (flop / t_ours / 1e12, flop / t_burn / 1e12);
                let vs_peer = match (peer, name, dtype) {
                    (Some(p), "fprop", FloatDType::BF16) => format!("{:.2}", tf_ours / p),
                    _ => "-".into(),
                };
                println!(
                    "| {m}, {k}, {n} | {dtype:?} | {name} | {path} | {tf_ours:.1} | {tf_burn:.1} | {:.2} | {vs_peer} | {diff:.1e} |",
                    tf_ours / tf_burn
                );
            }
        }
    }
}

fn main() {
    let args = Args::parse();
    kernels::kernel_cache::cache_per_build();
    let shapes: Vec<[usize; 3]> = if args.shapes.is_empty() {
        CUBLASLT_BF16.iter().map(|(s, _)| *s).collect()
    } else {
        args.shapes.iter().map(|t| t.0).collect()
    };
    let dtypes: Vec<FloatDType> = args.dtypes.iter().map(|&d| d.into()).collect();
    match args.device {
        DeviceArg::Cuda => run::<Cuda>(&CudaDevice::default(), &args, &shapes, &dtypes),
        DeviceArg::Wgpu => run::<Wgpu>(&WgpuDevice::DefaultDevice, &args, &shapes, &dtypes),
    }
}
