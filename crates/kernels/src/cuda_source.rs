//! Kernels written in CUDA C++ for this project, compiled at run time by NVRTC through CubeCL's
//! CUDA server and launched on CubeCL's stream with CubeCL's buffers: the route for instructions
//! CubeCL 0.10 cannot express (the FP8 conversion instructions, warpgroup MMA). Each such kernel
//! has a CubeCL counterpart that stays the portable path and its reference.
//!
//! A kernel's parameters are its buffers in the order given to [`launch`], then one
//! `const __grid_constant__` struct holding the 64-bit words given as `info` (CubeCL passes
//! launch metadata by value on the GPUs it supports grid constants on, compute capability 7.0+;
//! callers use this route on newer GPUs only). Its shared memory is static (`__shared__`, at most
//! 48 KB), or dynamic (`extern __shared__`) where it is built [`CudaSource::with_shared`]: CubeCL's
//! server raises the kernel's limit and gives each launch that many bytes.
//!
//! CubeCL caches the compiled kernel in memory and its PTX on disk under the kernel's id, which
//! holds the variant's `#define` lines and a hash of the kernel text, so a changed source is compiled
//! anew.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::ir::{ElemType, StorageType, UIntKind};
use cubecl::prelude::*;
use cubecl::server::{Binding, KernelArguments, MetadataBindingInfo};
use cubecl::{CompilationError, Compiler, CubeTask};

/// A CUDA C++ kernel: its source (a few `#define` lines that pick a variant, then the kernel
/// text), its entry point (an `extern "C" __global__` function) and its block size.
pub(crate) struct CudaSource {
    entry: &'static str,
    defines: String,
    body: &'static str,
    cube_dim: CubeDim,
    shared_bytes: usize,
    id: KernelId,
}

impl CudaSource {
    /// The kernel `entry` of `defines` followed by `body`, launched with blocks of `cube_dim`
    /// threads. Cheap to call per launch: `body` is hashed once per process.
    pub(crate) fn new(
        entry: &'static str,
        defines: String,
        body: &'static str,
        cube_dim: CubeDim,
    ) -> Self {
        let id = kernel_id(entry, &defines, body, cube_dim, 0);
        Self {
            entry,
            defines,
            body,
            cube_dim,
            shared_bytes: 0,
            id,
        }
    }

    /// The same kernel with `bytes` of dynamic shared memory a block (its `extern __shared__`
    /// array; more than 48 KB where the device allows it).
    pub(crate) fn with_shared(mut self, bytes: usize) -> Self {
        self.shared_bytes = bytes;
        self.id = kernel_id(self.entry, &self.defines, self.body, self.cube_dim, bytes);
        self
    }
}

/// The id CubeCL caches a kernel under (in memory, and its PTX on disk): everything that changes
/// the compiled kernel or its launch.
fn kernel_id(
    entry: &'static str,
    defines: &str,
    body: &'static str,
    cube_dim: CubeDim,
    shared_bytes: usize,
) -> KernelId {
    KernelId::new::<CudaSource>().cube_dim(cube_dim).info((
        entry,
        defines.to_string(),
        body_hash(body),
        shared_bytes,
    ))
}

/// The [`fnv1a`] hash of a kernel text, computed on its first use in the process.
fn body_hash(body: &'static str) -> u64 {
    static HASHES: Mutex<BTreeMap<usize, u64>> = Mutex::new(BTreeMap::new());
    let mut hashes = HASHES.lock().unwrap_or_else(|e| e.into_inner());
    *hashes
        .entry(body.as_ptr() as usize)
        .or_insert_with(|| fnv1a(body.as_bytes()))
}

/// FNV-1a, 64 bits: a hash that is the same in every process (the disk cache's key outlives one).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl KernelMetadata for CudaSource {
    fn name(&self) -> &'static str {
        self.entry
    }

    fn id(&self) -> KernelId {
        self.id.clone()
    }

    fn address_type(&self) -> StorageType {
        StorageType::Scalar(ElemType::UInt(UIntKind::U64))
    }
}

impl CubeTask<CudaCompiler> for CudaSource {
    fn compile(
        &self,
        compiler: &mut CudaCompiler,
        options: &<CudaCompiler as Compiler>::CompilationOptions,
        mode: ExecutionMode,
        address_type: StorageType,
    ) -> Result<CompiledKernel<CudaCompiler>, CompilationError> {
        // CubeCL reads the dynamic shared memory to reserve from a compiled representation: that
        // of an empty kernel, which reserves none. NVRTC compiles `source` itself.
        let empty = KernelDefinition {
            buffers: Vec::new(),
            tensor_maps: Vec::new(),
            scalars: Vec::new(),
            cube_dim: self.cube_dim,
            body: Scope::root(false),
            options: KernelOptions {
                kernel_name: self.entry.to_string(),
                debug_symbols: false,
                cluster_dim: None,
            },
        };
        let mut repr = compiler.compile(empty, options, mode, address_type)?;
        // The server gives a launch the end of the last shared memory listed here as dynamic
        // shared memory (and records it with the PTX in its disk cache).
        if self.shared_bytes > 0 {
            use cubecl_cpp::shared::{Elem, Item, SharedMemory};
            repr.body.shared_memories.push(SharedMemory::Array {
                index: 0,
                item: Item::new(Elem::U8, 1, false),
                length: self.shared_bytes,
                align: 16,
                offset: 0,
            });
        }
        Ok(CompiledKernel {
            entrypoint_name: self.entry.to_string(),
            debug_name: Some(self.entry),
            source: format!("{}{}", self.defines, self.body),
            repr: Some(repr),
            cube_dim: self.cube_dim,
            debug_info: None,
        })
    }
}

/// Queues `kernel` on `client`'s stream over a grid of `cubes` blocks, with `buffers` as its
/// pointer parameters (in order) and `info` as its trailing by-value struct of 64-bit words.
pub(crate) fn launch(
    client: &ComputeClient<CudaRuntime>,
    kernel: CudaSource,
    cubes: (u32, u32, u32),
    buffers: Vec<Binding>,
    info: Vec<u64>,
) {
    let words = info.len();
    let mut args = KernelArguments::new();
    for b in buffers {
        args = args.with_buffer(b);
    }
    // No dynamically sized part: CubeCL would pass it as one more buffer.
    args.info = MetadataBindingInfo::new(info, words);
    client.launch(
        Box::new(kernel),
        CubeCount::Static(cubes.0, cubes.1, cubes.2),
        args,
    );
}

/// What the driver says of a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceFacts {
    /// `(major, minor)`.
    pub(crate) compute_capability: (i32, i32),
    pub(crate) multiprocessors: u32,
    pub(crate) l2_bytes: u64,
}

/// The facts of the GPU that holds `t`, or `None` where the driver does not say. Read once per
/// device.
pub(crate) fn device_facts(
    t: &burn_cubecl::tensor::CubeTensor<CudaRuntime>,
) -> Option<DeviceFacts> {
    use cudarc::driver::{result as drv, sys::CUdevice_attribute as A};
    static KNOWN: Mutex<BTreeMap<usize, Option<DeviceFacts>>> = Mutex::new(BTreeMap::new());
    let index = t.device.index;
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    *known.entry(index).or_insert_with(|| {
        // SAFETY: the driver was initialised by CubeCL's client (the tensor exists); the
        // attribute queries read the device's fixed properties.
        unsafe {
            let dev = drv::device::get(index as i32).ok()?;
            let get = |a| drv::device::get_attribute(dev, a).ok();
            Some(DeviceFacts {
                compute_capability: (
                    get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                    get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                ),
                multiprocessors: get(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
                l2_bytes: get(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64,
            })
        }
    })
}
