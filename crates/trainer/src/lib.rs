//! The training engine: TOML configs, data and tokenizers, AdamW, the training loop, metrics,
//! checkpoints and device selection. The `train` binary is a thin command line over [`run`].

pub mod checkpoint;
pub mod compare;
pub mod config;
pub mod corpus;
pub mod data;
pub mod device;
pub mod fp8_policy;
pub mod fsutil;
pub mod host_copy;
pub mod interop;
pub mod memory_plan;
pub mod metrics;
pub mod numerics;
pub mod optim;
pub mod parallel;
pub mod parquet;
pub mod precision;
pub mod prepare;
pub mod resume;
pub mod rng;
pub mod sample;
pub mod schedule;
mod step;
pub mod stop;
pub mod tokenizer;
pub mod tokens;
pub mod train;

use anyhow::Result;
use burn::backend::cuda::CudaDevice;
use burn::backend::ndarray::NdArrayDevice;
use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Cuda, NdArray, Wgpu};

pub use config::Config;

/// Waits for the device's queue when dropped. Declared before a function's tensors it drops after
/// them, so their frees reach the device before the function returns, on every path: on CUDA,
/// frees still queued when the process exits meet a driver that is shutting down, and CubeCL's
/// device thread panics on them.
pub(crate) struct DrainOnDrop<B: burn::tensor::backend::Backend>(pub B::Device);

impl<B: burn::tensor::backend::Backend> Drop for DrainOnDrop<B> {
    fn drop(&mut self) {
        let _ = B::sync(&self.0);
    }
}
pub use train::{HopperAttention, RunOptions, Summary};

/// Training backend on NVIDIA GPUs: f32 by default, kernels compiled at run time by NVRTC.
pub type CudaBackend = Autodiff<Cuda>;

/// What the trainer needs of a backend: autodiff, and the fused kernels (or their references) on
/// it and on its inner backend (where the optimizer runs).
pub trait TrainBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend: kernels::Backend + parallel::Collective>
    + kernels::Backend
    + parallel::overlap::GradHook
    + parallel::fsdp::RowGather
{
}

impl<B> TrainBackend for B
where
    B: burn::tensor::backend::AutodiffBackend
        + kernels::Backend
        + parallel::overlap::GradHook
        + parallel::fsdp::RowGather,
    B::InnerBackend: kernels::Backend + parallel::Collective,
{
}
/// Training backend on everything else (Vulkan, Metal, DX12; lavapipe on a CPU-only machine).
pub type WgpuBackend = Autodiff<Wgpu>;

/// Training backend on the CPU without any GPU driver: Burn's ndarray, plain-Burn ops.
pub type CpuBackend = Autodiff<NdArray>;

/// Trains on the selected device.
pub fn run(cfg: &Config, device: &device::Selected, opts: &RunOptions) -> Result<Summary> {
    // The kernels' tuning and diagnostic switches (BURNMIX_* variables): a bad value stops here,
    // named, rather than at the first kernel.
    kernels::settings::init_from_env().map_err(|e| anyhow::anyhow!("{e}"))?;
    let run = cfg.resolve(device)?;
    // `fp8.attention`: the kernels' FP8 attention forward for this run (Hopper GPUs; elsewhere
    // the kernels say once that it does not apply and attention runs in the compute dtype), held
    // until the run returns.
    let fp8_attention = (run.config.precision == precision::PrecisionKind::Fp8
        && run.config.fp8.attention)
        .then(|| kernels::settings::scoped(|s| s.flash_fp8 = true));
    if fp8_attention.is_some() && !matches!(device, device::Selected::Cuda { .. }) {
        eprintln!(
            "note: fp8.attention = true runs the attention forward in FP8 on Hopper GPUs only; on {} it stays in the compute dtype",
            device.describe()
        );
    }
    let (world, processes) = match &opts.place {
        Some(place) => (place.world_size, true),
        None => (run.ranks.len().max(1), false),
    };
    run.config
        .check_zero(world, processes)
        .map_err(|e| anyhow::anyhow!(e))?;
    if let Some(place) = &opts.place {
        if !matches!(device, device::Selected::Cuda { .. }) {
            anyhow::bail!(
                "this process is rank {} of a run of {} processes (WORLD_SIZE is set), which exchange gradients through NCCL, \
                 but it trains on {}; runs of several processes need CUDA GPUs (device = \"cuda\")",
                place.rank,
                place.world_size,
                device.describe()
            );
        }
    }
    match device {
        device::Selected::Cuda { index, .. } => {
            if let Err(why) = kernels::gemm::cublaslt_status() {
                match run.config.model.gemm {
                    model::GemmKind::Cublaslt => anyhow::bail!("model.gemm = \"cublaslt\" but {why}. Use model.gemm = \"auto\" or \"burn\" to run on Burn's matmul"),
                    model::GemmKind::Auto => eprintln!("note: model.gemm = \"auto\": {why}; the GEMMs run on Burn's matmul (slower; see docs/gemm.md)"),
                    model::GemmKind::Burn => {}
                }
            }
            if let Some(place) = &opts.place {
                return train_process(&run, place, opts);
            }
            let devices = if run.ranks.is_empty() {
                vec![(CudaDevice::new(*index), *index)]
            } else {
                run.ranks.iter().map(|&i| (CudaDevice::new(i), i)).collect()
            };
            train::train_on::<CudaBackend>(&run, devices, opts)
        }
        device::Selected::Wgpu => {
            train::train::<WgpuBackend>(&run, WgpuDevice::DefaultDevice, opts)
        }
        device::Selected::Cpu => train::train::<CpuBackend>(&run, NdArrayDevice::Cpu, opts),
    }
}

/// One rank of a run of one process per GPU, on GPU `LOCAL_RANK` of its node: joins the others
/// (rendezvous, NCCL) and trains.
fn train_process(
    run: &config::Resolved,
    place: &parallel::place::Place,
    opts: &RunOptions,
) -> Result<Summary> {
    if !run.ranks.is_empty() {
        anyhow::bail!(
            "training.devices = {} asks this process for several GPUs, but it is rank {} of a run of {} processes, one GPU \
             each (WORLD_SIZE is set): leave training.devices at 1 and start one process per GPU (train --nproc-per-node N)",
            run.config.training.devices,
            place.rank,
            place.world_size
        );
    }
    kernels::collective::library().map_err(|e| {
        anyhow::anyhow!(
            "a run of {} processes exchanges gradients through NCCL, but {e}",
            place.world_size
        )
    })?;
    let gpus = parallel::cuda_device_count()?;
    let gpu = place.local_rank;
    if gpu >= gpus {
        anyhow::bail!(
            "LOCAL_RANK = {gpu} asks for CUDA GPU {gpu}, but this node has {gpus} visible (CUDA_VISIBLE_DEVICES); \
             start at most {gpus} processes per node"
        );
    }
    let device = CudaDevice::new(gpu);
    // Every rank must train the same run: the resolved config's hash is checked at the rendezvous.
    let fingerprint = crc32fast::hash(run.config.to_toml().as_bytes()) as u64;
    let membership = parallel::process::join::<Cuda>(place, fingerprint, &device)?;
    train::train_process::<CudaBackend>(run, (device, gpu), membership, opts)
}

/// The `main` of the command-line tools: answers a device probe (the child process that
/// [`device::select`] starts to try a backend) or runs `body`, whose error is printed as one line
/// with exit code 1.
pub fn cli_main(body: impl FnOnce() -> Result<()>) -> std::process::ExitCode {
    use std::process::ExitCode;
    // Before any CubeCL work: this build's kernels in a cache directory of its own.
    kernels::kernel_cache::cache_per_build();
    if std::env::var_os(device::CUDA_PROBE_ENV).is_some() {
        return ExitCode::from(cuda_probe() as u8);
    }
    if std::env::var_os(device::WGPU_PROBE_ENV).is_some() {
        return ExitCode::from(wgpu_probe() as u8);
    }
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Body of the wgpu probe child process: make a tensor on the default wgpu device and read it back.
pub fn wgpu_probe() -> i32 {
    use burn::tensor::Tensor;
    let t = Tensor::<Wgpu, 1>::from_floats([1.0, 2.0, 3.0], &WgpuDevice::DefaultDevice);
    let s: f32 = (t.clone() * t).sum().into_scalar();
    if (s - 14.0).abs() < 1e-4 {
        0
    } else {
        eprintln!("wgpu probe computed {s} instead of 14");
        1
    }
}

/// Body of the CUDA probe child process: make a tensor on CUDA and read it back.
pub fn cuda_probe() -> i32 {
    use burn::tensor::Tensor;
    let device = CudaDevice::new(0);
    let t = Tensor::<Cuda, 1>::from_floats([1.0, 2.0, 3.0], &device);
    let s: f32 = (t.clone() * t).sum().into_scalar();
    if (s - 14.0).abs() < 1e-4 {
        0
    } else {
        eprintln!("CUDA probe computed {s} instead of 14");
        1
    }
}
