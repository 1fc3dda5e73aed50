//! Shared helpers for the integration tests. They run on wgpu: Mesa's lavapipe on a CPU-only
//! machine.
#![allow(dead_code)]

use std::path::PathBuf;

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Wgpu};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use model::Gpt;
use trainer::Config;

pub type B = Autodiff<Wgpu>;
pub type Inner = Wgpu;

pub fn device() -> WgpuDevice {
    WgpuDevice::DefaultDevice
}

/// Burn's backend RNG (initialisation, dropout) is global per device, so tests that depend on it
/// for reproducibility take this lock to keep other tests from drawing numbers in between.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A model and run small enough for a test: 1-2 seconds of lavapipe per few steps.
pub fn tiny_config(steps: usize) -> Config {
    let mut cfg = Config {
        device: trainer::config::DeviceKind::Wgpu,
        ..Config::default()
    };
    // Explicit rather than "auto": these tests exercise the trainer, not the kernels.
    cfg.precision = trainer::config::PrecisionKind::Fp32;
    cfg.model.kernels = model::KernelsKind::Reference;
    cfg.model.attention = model::AttentionKind::Plain;
    cfg.model.n_layer = 2;
    cfg.model.n_head = 2;
    cfg.model.d_model = 32;
    cfg.model.context = 16;
    cfg.data.embedded_chars = 40_000;
    cfg.optimizer.lr = 3e-3;
    cfg.schedule.warmup_steps = 2;
    cfg.schedule.min_lr = 3e-4;
    cfg.training.steps = steps;
    cfg.training.batch_size = 8;
    cfg.training.eval_interval = 0;
    cfg.training.eval_batches = 2;
    cfg.training.log_interval = 1000;
    cfg.training.checkpoint_interval = 0;
    cfg
}

/// A fresh, empty directory under the target dir for one test's run.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

pub fn opts(dir: PathBuf, resume: bool) -> trainer::RunOptions {
    trainer::RunOptions {
        run_dir: dir,
        resume,
        device_name: "wgpu (test)".into(),
        peak_tflops: None,
        verbose: false,
        stop_at: None,
        poison_steps: Vec::new(),
    }
}

/// Reads metrics.jsonl.
pub fn read_metrics(dir: &std::path::Path) -> Vec<trainer::metrics::StepRecord> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

/// Parameter path -> dtype, for every float parameter of a model.
pub fn param_dtypes<AB: AutodiffBackend>(m: &Gpt<AB>) -> Vec<(String, DType)> {
    struct V {
        path: Vec<String>,
        out: Vec<(String, DType)>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for V {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            self.out.push((self.path.join("."), p.val().dtype()));
        }
    }
    let mut v = V {
        path: Vec::new(),
        out: Vec::new(),
    };
    m.visit(&mut v);
    v.out
}
