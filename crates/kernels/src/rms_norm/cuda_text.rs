//! The CUDA C++ that CubeCL 0.10's CUDA backend writes for the RMSNorm kernels, written without a
//! GPU: the kernel's definition is built as its `launch` builds it, then handed to CubeCL's CUDA
//! compiler with the options an H100's or H200's server uses. `tools/kernel-compile --text DIR`
//! compiles the files with NVRTC and ptxas 13.0 and reports registers and spills, so that a change
//! to a CubeCL kernel's registers can be read on any machine; how fast it runs is still the GPU's
//! business.
//!
//! `BURNMIX_CUDA_TEXT_DIR=DIR cargo test -p kernels --lib cuda_text -- --ignored` writes one
//! `.cu` file per kernel and launch into DIR (default: the system's temporary directory).

use burn::tensor::DType;
use cubecl::prelude::*;
use cubecl::Compiler;
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures};

use super::forward::{BWD_ROW_PLANE_UNITS, ROW_PLANE_UNITS};
use super::kernel::{rms_norm_bwd, rms_norm_fwd};

// The launch `gpt2_small` makes at width 768 with bf16 activations and an f32 gain on CUDA, as
// `forward::plan` chooses it there: vectors of 4, a row to a plane of 32 lanes, 6 vectors a lane,
// as many rows a cube as its units have planes (the weight-gradient sums' shared memory allows
// more at this width). A change to `plan` needs the same change here.
const COLS: usize = 768;
const VECTOR: usize = 4;
const LANES: u32 = 32;
const PER_UNIT: usize = (COLS / VECTOR).div_ceil(LANES as usize);

/// What the CUDA server of a compute capability 9.0 GPU with CUDA 13 gives the compiler.
fn hopper_options() -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            grid_constants: true,
            clusters: true,
            fast_math: true,
            fast_tanh: true,
            elect_sync: true,
        },
    }
}

/// `settings` for a cube of `LANES x rows_per_cube` units, as `launch` makes them.
fn settings(name: &str, rows_per_cube: u32) -> KernelSettings {
    KernelSettings::default()
        .cube_dim(CubeDim::new_2d(LANES, rows_per_cube))
        .address_type(AddressType::U32)
        .kernel_name(name)
}

/// The definition's CUDA text, checked launch (as `launch` compiles it).
fn cuda_text(definition: KernelDefinition) -> String {
    cubecl::cuda::CudaCompiler::default()
        .compile(
            definition,
            &hopper_options(),
            ExecutionMode::Checked,
            AddressType::U32.unsigned_type(),
        )
        .expect("CubeCL compiles the definition")
        .to_string()
}

/// A builder with the dtypes and vector size registered, as each kernel's `define` does.
fn builder<Fe: 'static, We: 'static, Ne: 'static>(dtypes: [StorageType; 2]) -> KernelBuilder {
    let mut b = KernelBuilder::default();
    b.runtime_properties(cubecl::cuda::CudaRuntime::target_properties());
    b.scope.register_type::<We>(dtypes[1]);
    b.scope.register_type::<Fe>(dtypes[0]);
    b.scope.register_size::<Ne>(VECTOR);
    AddressType::U32.register(&mut b.scope);
    b
}

fn backward_text(dtypes: [StorageType; 2], add_res: bool) -> String {
    use rms_norm_bwd::{F, N, W};
    let rows_per_cube = BWD_ROW_PLANE_UNITS / LANES as usize;
    let mut b = builder::<F, W, N>(dtypes);
    let arg = ArrayCompilationArg { inplace: None };
    let x = <Array<Vector<F, N>> as LaunchArg>::expand(&arg, &mut b);
    let w = <Array<Vector<W, N>> as LaunchArg>::expand(&arg, &mut b);
    let rstd = <Array<f32> as LaunchArg>::expand(&arg, &mut b);
    let dy = <Array<Vector<F, N>> as LaunchArg>::expand(&arg, &mut b);
    let dres = <Array<Vector<F, N>> as LaunchArg>::expand(&arg, &mut b);
    let dx = <Array<Vector<F, N>> as LaunchArg>::expand_output(&arg, &mut b);
    let dw_part = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&arg, &mut b);
    let rows = <usize as LaunchArg>::expand(&(), &mut b);
    let row_vecs = <usize as LaunchArg>::expand(&(), &mut b);
    rms_norm_bwd::expand::<F, W, N>(
        &mut b.scope,
        VECTOR,
        x,
        w,
        rstd,
        dy,
        dres,
        dx,
        dw_part,
        rows,
        row_vecs,
        PER_UNIT,
        crate::launch::reduce_slots(LANES as usize, true),
        true,
        true,
        rows_per_cube * PER_UNIT * LANES as usize,
        add_res,
        dtypes,
    );
    cuda_text(b.build(settings("rms_norm_bwd", rows_per_cube as u32)))
}

fn forward_text(dtypes: [StorageType; 2], residual: bool) -> String {
    use rms_norm_fwd::{F, N, W};
    let rows_per_cube = ROW_PLANE_UNITS / LANES as usize;
    let mut b = builder::<F, W, N>(dtypes);
    let arg = ArrayCompilationArg { inplace: None };
    let x = <Array<Vector<F, N>> as LaunchArg>::expand(&arg, &mut b);
    let r = <Array<Vector<F, N>> as LaunchArg>::expand(&arg, &mut b);
    let w = <Array<Vector<W, N>> as LaunchArg>::expand(&arg, &mut b);
    let y = <Array<Vector<F, N>> as LaunchArg>::expand_output(&arg, &mut b);
    let sum = <Array<Vector<F, N>> as LaunchArg>::expand_output(&arg, &mut b);
    let rstd = <Array<f32> as LaunchArg>::expand_output(&arg, &mut b);
    let rows = <usize as LaunchArg>::expand(&(), &mut b);
    let row_vecs = <usize as LaunchArg>::expand(&(), &mut b);
    let eps = <f32 as LaunchArg>::expand(&(), &mut b);
    rms_norm_fwd::expand::<F, W, N>(
        &mut b.scope,
        VECTOR,
        x,
        r,
        w,
        y,
        sum,
        rstd,
        rows,
        row_vecs,
        eps,
        PER_UNIT,
        crate::launch::reduce_slots(LANES as usize, true),
        residual,
        true,
        true,
        dtypes,
    );
    cuda_text(b.build(settings("rms_norm_fwd", rows_per_cube as u32)))
}

/// Not a check: writes the files (run on purpose, see the module's doc).
#[test]
#[ignore = "writes CUDA text for tools/kernel-compile --text"]
fn rms_norm_cuda_text() {
    let dir = std::env::var_os("BURNMIX_CUDA_TEXT_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dtypes: [StorageType; 2] = [DType::BF16.into(), DType::F32.into()];
    let texts = [
        ("rms_norm_fwd_bf16_residual", forward_text(dtypes, true)),
        ("rms_norm_bwd_bf16_add_res", backward_text(dtypes, true)),
    ];
    for (name, text) in texts {
        assert!(text.contains("__global__"), "{name}: no kernel in\n{text}");
        let path = dir.join(format!("{name}.cu"));
        std::fs::write(&path, text).unwrap();
        println!("{}", path.display());
    }
}
