//! Choosing where a run computes, and what that device's peak is (for MFU).

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Result};

use crate::config::DeviceKind;

/// Environment variable that turns the `train` binary into a CUDA probe (used by `auto`).
pub const CUDA_PROBE_ENV: &str = "BURNMIX_CUDA_PROBE";

/// The device a run uses.
#[derive(Debug, Clone)]
pub enum Selected {
    Cuda { index: usize, name: String },
    Wgpu,
}

impl Selected {
    pub fn describe(&self) -> String {
        match self {
            Selected::Cuda { index, name } => format!("CUDA device {index} ({name})"),
            Selected::Wgpu => "wgpu default device".to_string(),
        }
    }

    /// GPU name for the peak-FLOPs lookup.
    pub fn gpu_name(&self) -> Option<&str> {
        match self {
            Selected::Cuda { name, .. } => Some(name),
            Selected::Wgpu => None,
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
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate the running executable: {e}"))?;
    let mut child = Command::new(exe)
        .env(CUDA_PROBE_ENV, "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the CUDA probe: {e}"))?;
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
                return Err(if tail.is_empty() { format!("probe exited with {status}") } else { tail });
            }
            Ok(None) if start.elapsed() > Duration::from_secs(120) => {
                let _ = child.kill();
                return Err("the CUDA probe did not finish within 120 s".into());
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for the CUDA probe: {e}")),
        }
    }
}

/// Resolves `device` from the config. `auto` picks CUDA when an NVIDIA GPU answers and a CUDA
/// tensor can be made, and says why not otherwise.
pub fn select(kind: DeviceKind) -> Result<(Selected, Option<String>)> {
    match kind {
        DeviceKind::Wgpu => Ok((Selected::Wgpu, None)),
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
        DeviceKind::Auto => match nvidia_gpu_name() {
            None => Ok((Selected::Wgpu, Some("no NVIDIA GPU found (nvidia-smi), using wgpu".into()))),
            Some(name) => match probe_cuda() {
                Ok(()) => Ok((Selected::Cuda { index: 0, name }, None)),
                Err(e) => Ok((Selected::Wgpu, Some(format!("{name} found but CUDA is not usable ({e}); using wgpu")))),
            },
        },
    }
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
