//! Shared helpers for the integration tests. They choose their device as `train` does: wgpu
//! where an adapter exists (Mesa's lavapipe on a CPU-only machine), else Burn's ndarray CPU
//! backend for every test that needs no GPU kernel. A test that needs one ([`needs_wgpu`]) says in
//! one line that it was skipped and why; with `BURNMIX_REQUIRE_WGPU=1` (set by CI) a missing
//! adapter fails it instead.
#![allow(dead_code, unused_macros, unused_imports)]

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

/// The variable that turns a missing wgpu adapter into a test failure instead of a skip.
pub const REQUIRE_WGPU_ENV: &str = "BURNMIX_REQUIRE_WGPU";

/// Whether wgpu finds an adapter here, asked once per test binary: a tensor is made on the default
/// device and read back. cubecl-wgpu panics when there is no adapter (no Vulkan driver); that
/// panic is caught here.
pub fn wgpu_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::panic::catch_unwind(|| {
            let t = Tensor::<Wgpu, 1>::from_floats([1.0, 2.0], &WgpuDevice::DefaultDevice);
            t.into_data().to_vec::<f32>().ok() == Some(vec![1.0, 2.0])
        })
        .unwrap_or(false)
    })
}

/// For a test that needs a GPU kernel (wgpu): `true` when wgpu has an adapter. Otherwise the test
/// prints one line saying it was skipped and why (to the terminal, past the test harness's
/// capture) and gets `false`, unless `BURNMIX_REQUIRE_WGPU=1`, where it fails.
pub fn needs_wgpu() -> bool {
    if wgpu_available() {
        return true;
    }
    let current = std::thread::current();
    let test = current.name().unwrap_or("a test");
    if std::env::var(REQUIRE_WGPU_ENV).is_ok_and(|v| v == "1") {
        panic!("{test} needs a wgpu adapter and none was found ({REQUIRE_WGPU_ENV}=1)");
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "skipped {test}: it needs a GPU kernel on wgpu and wgpu found no adapter (install a \
         Vulkan driver, e.g. Debian's mesa-vulkan-drivers; {REQUIRE_WGPU_ENV}=1 fails instead)"
    );
    false
}

/// The device a training test runs on: wgpu where it has an adapter, else the CPU.
pub fn selected() -> trainer::device::Selected {
    if wgpu_available() {
        trainer::device::Selected::Wgpu
    } else {
        trainer::device::Selected::Cpu
    }
}

/// The config's `device` for [`selected`].
pub fn device_kind() -> trainer::config::DeviceKind {
    if wgpu_available() {
        trainer::config::DeviceKind::Wgpu
    } else {
        trainer::config::DeviceKind::Cpu
    }
}

/// Runs `$body` as a function generic over `$b`, a Burn backend without autodiff on which the
/// model and the kernels' references run, with `$dev` its device: wgpu where it has an adapter,
/// else Burn's ndarray CPU backend.
macro_rules! on_test_backend {
    (|$b:ident, $dev:ident| $body:block) => {{
        fn case<$b: kernels::Backend>($dev: burn::tensor::Device<$b>) $body
        if common::wgpu_available() {
            case::<burn::backend::Wgpu>(burn::backend::wgpu::WgpuDevice::DefaultDevice)
        } else {
            case::<burn::backend::NdArray>(burn::backend::ndarray::NdArrayDevice::Cpu)
        }
    }};
}
pub(crate) use on_test_backend;

/// Burn's backend RNG (initialisation, dropout) is global per device, so tests that depend on it
/// for reproducibility take this lock to keep other tests from drawing numbers in between.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A model and run small enough for a test: 1-2 seconds of lavapipe per few steps.
pub fn tiny_config(steps: usize) -> Config {
    tiny_config_on(device_kind(), steps)
}

/// [`tiny_config`] on `device` (without probing wgpu, whose probe prints a panic's message
/// where there is no Vulkan driver).
pub fn tiny_config_on(device: trainer::config::DeviceKind, steps: usize) -> Config {
    let mut cfg = Config {
        device,
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
        device_name: format!("{} (test)", selected().describe()),
        peak_tflops: None,
        verbose: false,
        stop_at: None,
        poison_steps: Vec::new(),
        place: None,
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

/// Runs `f`, which must panic with a message containing `expected` (the kernels refuse bad
/// arguments with a panic naming the op and the argument).
pub fn assert_panics_with(expected: &str, f: impl FnOnce()) {
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .expect_err("no panic, but one was expected");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        msg.contains(expected),
        "panicked with {msg:?}, expected a message containing {expected:?}"
    );
}

/// Per-step losses of two runs that must agree (e.g. two GPUs against one with the doubled
/// batch): every step within `tol` of `a`, relative; prints the largest difference.
pub fn assert_losses_agree(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: runs of different lengths");
    let worst = a
        .iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs() / a.abs())
        .fold(0f64, f64::max);
    println!(
        "{what}: largest relative loss difference over {} steps {worst:.2e}",
        a.len()
    );
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * x.abs(),
            "{what} step {}: {x} against {y}",
            step + 1
        );
    }
}

/// The master weights of a checkpoint's values (each parameter's AdamW moments follow its value).
pub fn master_weights(h: &trainer::checkpoint::Header, values: &[f32]) -> Vec<f32> {
    let mut out = Vec::new();
    let mut at = 0;
    for p in &h.params {
        let n: usize = p.shape.iter().product();
        out.extend_from_slice(&values[at..at + n]);
        at += if p.has_moments { 3 * n } else { n };
    }
    assert_eq!(at, values.len());
    out
}

/// The ids of a module's parameters, in module order (any backend).
pub fn param_ids<Bk: burn::tensor::backend::Backend, M: Module<Bk>>(
    module: &M,
) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl<Bk: burn::tensor::backend::Backend> ModuleVisitor<Bk> for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
            self.0.push(p.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// `prepare`'s settings for the token-shard tests: split every 5th document, chunks of 20 kB.
pub fn prepare_plan(inputs: Vec<String>, out: &std::path::Path) -> trainer::prepare::Plan {
    trainer::prepare::Plan {
        inputs,
        out: out.to_path_buf(),
        field: "text".into(),
        val_every: 5,
        chunk_bytes: 20_000,
        eot: "<|endoftext|>".into(),
        progress: false,
    }
}

/// A byte-level BPE of 300 tokens trained on `text`, with `<|endoftext|>` added.
pub fn bpe_with_eot(text: &str) -> tokenizers::Tokenizer {
    let mut tok = trainer::tokenizer::train_bpe(text, 300).unwrap();
    tok.add_special_tokens(vec![tokenizers::AddedToken::from("<|endoftext|>", true)])
        .unwrap();
    tok
}

/// Every token of the shard `files`, as one stream.
pub fn shard_tokens(files: &[PathBuf]) -> Vec<i64> {
    let set = trainer::tokens::ShardSet::open(files).unwrap();
    let n = set.len();
    let mut out = Vec::new();
    trainer::tokens::Tokens::Mapped(set).extend_window(0, n, &mut out);
    out
}

/// The shards of `split` in `dir`.
pub fn shard_files(dir: &std::path::Path, split: &str) -> Vec<PathBuf> {
    trainer::tokens::resolve(dir.to_str().unwrap(), split, "test").unwrap()
}
