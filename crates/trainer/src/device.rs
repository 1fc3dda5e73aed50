//! Choosing where a run computes, and what that device's peak is (for MFU).

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Where the run computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// CUDA when an NVIDIA GPU and driver are usable, otherwise wgpu when it finds an adapter,
    /// otherwise the CPU.
    Auto,
    /// NVIDIA GPU through CUDA (kernels compiled at run time by NVRTC).
    Cuda,
    /// Any Vulkan/Metal/DX12 device through wgpu (Mesa's lavapipe on a machine without a GPU).
    Wgpu,
    /// The CPU through Burn's pure-Rust `ndarray` backend (the plain-Burn reference of every op;
    /// fp32 only). Slow, but needs no driver.
    Cpu,
}

/// Environment variable that turns the `train` binary into a CUDA probe (used by `auto`).
pub const CUDA_PROBE_ENV: &str = "BURNMIX_CUDA_PROBE";

/// Environment variable that turns the `train` binary into a wgpu probe (used by `auto`, `wgpu`).
pub const WGPU_PROBE_ENV: &str = "BURNMIX_WGPU_PROBE";

/// The device a run uses.
#[derive(Debug, Clone)]
pub enum Selected {
    Cuda { index: usize, name: String },
    Wgpu,
    Cpu,
}

impl Selected {
    pub fn describe(&self) -> String {
        match self {
            Selected::Cuda { index, name } => format!("CUDA device {index} ({name})"),
            Selected::Wgpu => "wgpu default device".to_string(),
            Selected::Cpu => "CPU (Burn's ndarray backend, plain-Burn ops)".to_string(),
        }
    }

    /// GPU name for the peak-FLOPs lookup.
    pub fn gpu_name(&self) -> Option<&str> {
        match self {
            Selected::Cuda { name, .. } => Some(name),
            Selected::Wgpu | Selected::Cpu => None,
        }
    }
}

/// Name of NVIDIA GPU 0 from `nvidia-smi`, if there is one.
pub fn nvidia_gpu_name() -> Option<String> {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader", "-i", "0"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!name.is_empty()).then_some(name)
}

/// Runs this executable as a child that creates a tensor on CUDA and reads it back: creating a CUDA
/// client panics inside the runtime when the driver, device or headers are missing, and a child
/// process keeps that from touching the run. Returns the child's error output on failure.
fn probe_cuda() -> std::result::Result<(), String> {
    probe(CUDA_PROBE_ENV, "CUDA")
}

/// As [`probe_cuda`] for wgpu: cubecl-wgpu panics when no adapter (Vulkan, Metal, DX12 driver)
/// exists.
fn probe_wgpu() -> std::result::Result<(), String> {
    probe(WGPU_PROBE_ENV, "wgpu")
}

fn probe(env: &str, what: &str) -> std::result::Result<(), String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot locate the running executable: {e}"))?;
    let mut child = Command::new(exe)
        .env(env, "1")
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the {what} probe: {e}"))?;
    let start = std::time::Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                if status.success() {
                    return Ok(());
                }
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                let last: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
                let tail = last[last.len().saturating_sub(4)..].join("\n");
                return Err(if tail.is_empty() {
                    format!("probe exited with {status}")
                } else {
                    tail
                });
            }
            Ok(None) if start.elapsed() > Duration::from_secs(120) => {
                let _ = child.kill();
                return Err(format!("the {what} probe did not finish within 120 s"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for the {what} probe: {e}")),
        }
    }
}

/// Resolves `device` from the config. `auto` picks CUDA when an NVIDIA GPU answers and a CUDA
/// tensor can be made, and says why not otherwise.
pub fn select(kind: DeviceKind) -> Result<(Selected, Option<String>)> {
    match kind {
        DeviceKind::Cpu => Ok((Selected::Cpu, None)),
        DeviceKind::Wgpu => match probe_wgpu() {
            Ok(()) => Ok((Selected::Wgpu, None)),
            Err(e) => bail!(
                "device = \"wgpu\" but wgpu found no usable adapter ({}). Install a Vulkan driver (on Debian or Ubuntu \
                 without a GPU: apt install mesa-vulkan-drivers), or use device = \"cpu\" or \"auto\"",
                one_line(&e)
            ),
        },
        DeviceKind::Cuda => {
            let name = nvidia_gpu_name().unwrap_or_else(|| "unknown NVIDIA GPU".into());
            if let Err(e) = probe_cuda() {
                bail!(
                    "device = \"cuda\" but CUDA is not usable here: {e}\n\
                     CUDA needs an NVIDIA driver (libcuda), NVRTC and the CUDA headers (CUDA_PATH or /usr/local/cuda). \
                     Use device = \"wgpu\" or \"auto\" to run without it."
                );
            }
            Ok((Selected::Cuda { index: 0, name }, None))
        }
        DeviceKind::Auto => {
            let why_not_cuda = match nvidia_gpu_name() {
                None => "no NVIDIA GPU found (nvidia-smi)".to_string(),
                Some(name) => match probe_cuda() {
                    Ok(()) => return Ok((Selected::Cuda { index: 0, name }, None)),
                    Err(e) => format!("{name} found but CUDA is not usable ({})", one_line(&e)),
                },
            };
            match probe_wgpu() {
                Ok(()) => Ok((Selected::Wgpu, Some(format!("{why_not_cuda}; using wgpu")))),
                Err(e) => Ok((
                    Selected::Cpu,
                    Some(format!(
                        "{why_not_cuda}, and wgpu found no adapter ({}); using the CPU (slow; a Vulkan driver such as \
                         Debian's mesa-vulkan-drivers makes wgpu usable)",
                        one_line(&e)
                    )),
                )),
            }
        }
    }
}

/// The last line of a probe's error output that says something (the panic message, not the
/// backtrace note).
fn one_line(e: &str) -> String {
    let line = e
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("note:") && !l.starts_with("stack backtrace"))
        .find(|l| {
            l.contains("panicked")
                || l.contains("error")
                || l.contains("Error")
                || l.contains("No ")
        })
        .or_else(|| e.lines().map(str::trim).find(|l| !l.is_empty()))
        .unwrap_or("no detail");
    // wgpu appends its internal state (". Falling back ...: NotFound { ... }"): keep the sentence.
    let line = line.split(". Falling back").next().unwrap_or(line);
    line.split(": NotFound {")
        .next()
        .unwrap_or(line)
        .trim_end_matches('.')
        .to_string()
}

/// Peak dense BF16 tensor-core TFLOP/s by GPU name (datasheet figures), for MFU.
pub fn peak_bf16_tflops(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    let table: &[(&str, f64)] = &[
        ("GH200", 989.0),
        ("H200", 989.0),
        ("H100 PCIE", 756.0),
        ("H100 NVL", 835.0),
        ("H100", 989.0),
        ("H800", 989.0),
        ("B200", 2250.0),
        ("A100", 312.0),
        ("A800", 312.0),
        ("L40S", 362.0),
        ("L4", 121.0),
        ("A10G", 70.0),
        ("A10", 125.0),
        ("RTX 4090", 165.0),
        ("RTX 3090", 71.0),
        ("V100", 125.0),
    ];
    table.iter().find(|(k, _)| n.contains(k)).map(|&(_, v)| v)
}
