//! Benchmark of the fused kernels against their plain-Burn references on CUDA.
//!
//! For each op and dtype it prints the median time of the fused kernel and of the reference, the
//! fused kernel's achieved bandwidth (bytes the op must move / time) as a share of the 3.0 TB/s
//! device-to-device copy of an H100 (docs/peers.md), and the speed-up over the reference.
//!
//! - `fwd` rows run the op on the plain CUDA backend.
//! - `fwd+bwd` rows run it under `Autodiff` and call `backward()` on `sum(output)` (on the mean of
//!   the per-row losses for cross-entropy). That sum and the gradient it seeds cost the same in
//!   both columns and are not counted in the bytes, so the GB/s figure there is a lower bound.
//!
//! Timing: warm-up, then the median over `--reps` batches of `--iters` calls, each batch bounded
//! by device synchronisations.
//!
//! `cargo run --release --bin kernel_bench -- [--dtypes bf16,f16,f32] [--ops rms_norm,...]`

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, FloatDType, Int, Tensor, TensorData};
use burnmix::bench::DTypeArg;
use clap::Parser;

type C = Cuda;
type A = Autodiff<Cuda>;

/// Copy bandwidth of the H100 in docs/peers.md (bytes read + written per second).
const COPY_BW: f64 = 3.0e12;

#[derive(Parser)]
#[command(
    about = "Fused kernels versus plain Burn on CUDA: time, GB/s, share of copy bandwidth, speed-up"
)]
struct Args {
    /// Comma-separated dtypes.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "bf16,f32")]
    dtypes: Vec<DTypeArg>,
    /// Comma-separated ops (default: all): rms_norm, add_rms_norm, swiglu, gelu, dropout, rope,
    /// cross_entropy, adamw, embedding, linear_cross_entropy, sum_squares, sum_f32, add_as_f32,
    /// scale, format_stats. The reference of dropout is what Burn's `Dropout` module computes (a
    /// Bernoulli tensor, then two multiplies), at p = 0.1.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "rms_norm,add_rms_norm,swiglu,gelu,dropout,rope,cross_entropy,adamw,\
                         embedding,linear_cross_entropy,sum_squares,sum_f32,add_as_f32,scale,\
                         format_stats"
    )]
    ops: Vec<Op>,
    /// Calls per timed batch.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 15)]
    reps: usize,
}

/// The ops this benchmark times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
enum Op {
    RmsNorm,
    AddRmsNorm,
    Swiglu,
    Gelu,
    Dropout,
    Rope,
    CrossEntropy,
    Adamw,
    Embedding,
    LinearCrossEntropy,
    SumSquares,
    SumF32,
    AddAsF32,
    Scale,
    FormatStats,
}

fn bytes_of(dt: FloatDType) -> f64 {
    if dt == FloatDType::F32 {
        4.0
    } else {
        2.0
    }
}

/// Median seconds per call of `f`.
fn time<Bk: Backend>(dev: &Bk::Device, args: &Args, f: &mut dyn FnMut()) -> f64 {
    burnmix::bench::median_seconds::<Bk>(dev, 3, args.iters, args.reps, f)
}

fn row(op: &str, shape: &str, dt: FloatDType, pass: &str, bytes: f64, fused: f64, reference: f64) {
    let gbs = bytes / fused / 1e9;
    println!(
        "| {op} | {shape} | {} | {pass} | {:.1} | {:.1} | {:.0} | {:.2} | {:.2}x |",
        model::dtype::name(dt),
        fused * 1e6,
        reference * 1e6,
        gbs,
        gbs * 1e9 / COPY_BW,
        reference / fused
    );
}

fn randn<Bk: Backend, const D: usize>(
    shape: [usize; D],
    dt: FloatDType,
    dev: &Bk::Device,
) -> Tensor<Bk, D> {
    Tensor::<Bk, D>::random(shape, Distribution::Normal(0.0, 1.0), dev).cast(dt)
}

/// What Burn's `Dropout` module computes when training: `x * Bernoulli(1 - p) / (1 - p)`.
fn burn_dropout<Bk: Backend>(x: Tensor<Bk, 2>, p: f64) -> Tensor<Bk, 2> {
    let keep = 1.0 - p;
    let mask = x.random_like(Distribution::Bernoulli(keep));
    (x * mask) * (1.0 / keep)
}

/// Times `fused` and `reference` forward on the plain backend and forward+backward under autodiff;
/// `make` builds the inputs (leaves requiring gradients under autodiff).
fn fwd_bwd<const N: usize>(
    args: &Args,
    dev: &CudaDevice,
    op: &str,
    shape: &str,
    dt: FloatDType,
    bytes: (f64, f64),
    make_c: &dyn Fn() -> [Tensor<C, 2>; N],
    make_a: &dyn Fn() -> [Tensor<A, 2>; N],
    fused_c: &dyn Fn([Tensor<C, 2>; N]) -> Tensor<C, 2>,
    reference_c: &dyn Fn([Tensor<C, 2>; N]) -> Tensor<C, 2>,
    fused_a: &dyn Fn([Tensor<A, 2>; N]) -> Tensor<A, 2>,
    reference_a: &dyn Fn([Tensor<A, 2>; N]) -> Tensor<A, 2>,
) {
    let inputs = make_c();
    let tf = time::<C>(dev, args, &mut || drop(fused_c(inputs.clone())));
    let tr = time::<C>(dev, args, &mut || drop(reference_c(inputs.clone())));
    row(op, shape, dt, "fwd", bytes.0, tf, tr);
    let inputs = make_a();
    let tf = time::<A>(dev, args, &mut || {
        drop(fused_a(inputs.clone()).sum().backward())
    });
    let tr = time::<A>(dev, args, &mut || {
        drop(reference_a(inputs.clone()).sum().backward())
    });
    row(op, shape, dt, "fwd+bwd", bytes.0 + bytes.1, tf, tr);
}

fn main() {
    let args = Args::parse();
    kernels::kernel_cache::cache_per_build();
    let dev = CudaDevice::default();
    println!(
        "| op | shape | dtype | pass | fused µs | Burn µs | fused GB/s | of 3.0 TB/s | speed-up |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &dt in &args.dtypes {
        let dt = FloatDType::from(dt);
        let eb = bytes_of(dt);
        for &op in &args.ops {
            match op {
                Op::RmsNorm => rms_norm(&args, &dev, dt),
                Op::AddRmsNorm => {
                    let (r, c) = (16384, 4096);
                    let n = (r * c) as f64;
                    let wc = Tensor::<C, 1>::ones([c], &dev);
                    let wa = Tensor::<A, 1>::ones([c], &dev).require_grad();
                    let (wc1, wc2, wa1, wa2) = (wc.clone(), wc, wa.clone(), wa);
                    fwd_bwd::<2>(
                        &args,
                        &dev,
                        "add_rms_norm",
                        "16384x4096",
                        dt,
                        // fwd: read x, r, write sum, y; bwd: read sum, dy, write dx (the add's
                        // gradient fan-out is free).
                        (4.0 * n * eb, 3.0 * n * eb),
                        &|| [randn([r, c], dt, &dev), randn([r, c], dt, &dev)],
                        &|| {
                            [
                                randn::<A, 2>([r, c], dt, &dev).require_grad(),
                                randn::<A, 2>([r, c], dt, &dev).require_grad(),
                            ]
                        },
                        &move |[x, res]| kernels::add_rms_norm(x, res, wc1.clone(), 1e-5).1,
                        &move |[x, res]| {
                            kernels::rms_norm::add_reference(x, res, wc2.clone(), 1e-5).1
                        },
                        &move |[x, res]| kernels::add_rms_norm(x, res, wa1.clone(), 1e-5).1,
                        &move |[x, res]| {
                            kernels::rms_norm::add_reference(x, res, wa2.clone(), 1e-5).1
                        },
                    );
                }
                Op::Swiglu => {
                    let (r, f) = (16384, 4096);
                    let n = (r * f) as f64;
                    fwd_bwd::<1>(
                        &args,
                        &dev,
                        "swiglu (packed)",
                        "16384x(2x4096)",
                        dt,
                        // fwd: read gate, up, write out; bwd: read gate, up, dy, write both grads.
                        (3.0 * n * eb, 5.0 * n * eb),
                        &|| [randn([r, 2 * f], dt, &dev)],
                        &|| [randn::<A, 2>([r, 2 * f], dt, &dev).require_grad()],
                        &|[x]| kernels::swiglu_packed(x),
                        &|[x]| kernels::activation::swiglu_packed_reference(x),
                        &|[x]| kernels::swiglu_packed(x),
                        &|[x]| kernels::activation::swiglu_packed_reference(x),
                    );
                }
                Op::Gelu => {
                    let (r, f) = (16384, 4096);
                    let n = (r * f) as f64;
                    fwd_bwd::<1>(
                        &args,
                        &dev,
                        "gelu",
                        "16384x4096",
                        dt,
                        (2.0 * n * eb, 3.0 * n * eb),
                        &|| [randn([r, f], dt, &dev)],
                        &|| [randn::<A, 2>([r, f], dt, &dev).require_grad()],
                        &|[x]| kernels::gelu(x),
                        &|[x]| kernels::activation::gelu_reference(x),
                        &|[x]| kernels::gelu(x),
                        &|[x]| kernels::activation::gelu_reference(x),
                    );
                }
                Op::Dropout => {
                    let (r, f) = (16384, 768);
                    let n = (r * f) as f64;
                    let d = kernels::Dropout::new(0.1, 7);
                    fwd_bwd::<1>(
                        &args,
                        &dev,
                        "dropout",
                        "16384x768",
                        dt,
                        (2.0 * n * eb, 2.0 * n * eb),
                        &|| [randn([r, f], dt, &dev)],
                        &|| [randn::<A, 2>([r, f], dt, &dev).require_grad()],
                        &|[x]| kernels::dropout(x, d),
                        &|[x]| burn_dropout(x, d.p),
                        &|[x]| kernels::dropout(x, d),
                        &|[x]| burn_dropout(x, d.p),
                    );
                }
                Op::Rope => rope(&args, &dev, dt),
                Op::CrossEntropy => cross_entropy(&args, &dev, dt),
                Op::Adamw => adamw(&args, &dev, dt),
                Op::Embedding => embedding(&args, &dev, dt),
                Op::LinearCrossEntropy => linear_cross_entropy(&args, &dev, dt),
                Op::SumSquares | Op::SumF32 => sums(&args, &dev, dt, op),
                Op::AddAsF32 => add_as_f32(&args, &dev, dt),
                Op::Scale => scale(&args, &dev, dt),
                Op::FormatStats => format_stats(&args, &dev, dt),
            }
        }
    }
}

/// RMSNorm forward and backward against its reference, and its backward kernel alone.
fn rms_norm(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let eb = bytes_of(dt);
    let (r, c) = (16384, 4096);
    let n = (r * c) as f64;
    let w = |d: &CudaDevice| Tensor::<C, 1>::ones([c], d);
    let wa = Tensor::<A, 1>::ones([c], dev).require_grad();
    let (wa1, wa2) = (wa.clone(), wa.clone());
    let wc = w(dev);
    let (wc1, wc2) = (wc.clone(), wc.clone());
    // The backward kernel alone, on the plain backend.
    {
        use kernels::RmsNormKernels;
        let prim = |t: Tensor<C, 2>| t.into_primitive().tensor();
        let x = randn::<C, 2>([r, c], dt, dev);
        let dy = randn::<C, 2>([r, c], dt, dev);
        let (_, _, rstd) = C::rms_norm_forward(
            prim(x.clone()),
            None,
            wc.clone().into_primitive().tensor(),
            1e-5,
        );
        let tb = time::<C>(dev, args, &mut || {
            drop(C::rms_norm_backward(
                prim(x.clone()),
                wc.clone().into_primitive().tensor(),
                rstd.clone(),
                prim(dy.clone()),
                None,
            ))
        });
        let gbs = 3.0 * n * eb / tb / 1e9;
        println!(
            "| rms_norm | 16384x4096 | {} | bwd kernel | {:.1} | | {gbs:.0} | {:.2} | |",
            model::dtype::name(dt),
            tb * 1e6,
            gbs * 1e9 / COPY_BW
        );
    }
    fwd_bwd::<1>(
        args,
        dev,
        "rms_norm",
        "16384x4096",
        dt,
        // fwd: read x, write y; bwd: read x, dy, write dx (the f32 gain is noise).
        (2.0 * n * eb, 3.0 * n * eb),
        &|| [randn([r, c], dt, dev)],
        &|| [randn::<A, 2>([r, c], dt, dev).require_grad()],
        &move |[x]| kernels::rms_norm(x, wc1.clone(), 1e-5),
        &move |[x]| kernels::rms_norm::reference(x, wc2.clone(), 1e-5),
        &move |[x]| kernels::rms_norm(x, wa1.clone(), 1e-5),
        &move |[x]| kernels::rms_norm::reference(x, wa2.clone(), 1e-5),
    );
}

/// RoPE forward and backward against its reference.
fn rope(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let eb = bytes_of(dt);
    let (b, h, t, hd) = (16, 32, 1024, 128);
    let n = (b * h * t * hd) as f64;
    let (cc, sc) = kernels::rope::tables::<C>(t, hd, 10_000.0, dev);
    let (ca, sa) = kernels::rope::tables::<A>(t, hd, 10_000.0, dev);
    let (cc1, sc1, cc2, sc2) = (cc.clone(), sc.clone(), cc, sc);
    let (ca1, sa1, ca2, sa2) = (ca.clone(), sa.clone(), ca, sa);
    let shape4 = [b, h, t, hd];
    fwd_bwd::<1>(
        args,
        dev,
        "rope",
        "16x32x1024x128",
        dt,
        (2.0 * n * eb, 2.0 * n * eb),
        &|| [randn([b * h * t, hd], dt, dev)],
        &|| [randn::<A, 2>([b * h * t, hd], dt, dev).require_grad()],
        &move |[x]| {
            kernels::rope(x.reshape(shape4), cc1.clone(), sc1.clone()).reshape([b * h * t, hd])
        },
        &move |[x]| {
            kernels::rope::reference(x.reshape(shape4), cc2.clone(), sc2.clone())
                .reshape([b * h * t, hd])
        },
        &move |[x]| {
            kernels::rope(x.reshape(shape4), ca1.clone(), sa1.clone()).reshape([b * h * t, hd])
        },
        &move |[x]| {
            kernels::rope::reference(x.reshape(shape4), ca2.clone(), sa2.clone())
                .reshape([b * h * t, hd])
        },
    );
}

fn targets<Bk: Backend>(rows: usize, classes: usize, dev: &Bk::Device) -> Tensor<Bk, 1, Int> {
    let v: Vec<i64> = (0..rows).map(|i| ((i * 7919) % classes) as i64).collect();
    Tensor::from_data(TensorData::new(v, [rows]), dev)
}

/// Cross-entropy [8192, 50304]: the forward reads the logits once; the backward reads them and
/// writes their gradient. Also reports the device memory held between forward and backward.
fn cross_entropy(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let (r, v) = (8192, 50304);
    let n = (r * v) as f64;
    let eb = bytes_of(dt);
    let tc = targets::<C>(r, v, dev);
    let ta = targets::<A>(r, v, dev);
    let x = randn::<C, 2>([r, v], dt, dev);
    let tf = time::<C>(dev, args, &mut || {
        drop(kernels::cross_entropy(x.clone(), tc.clone(), 0.0))
    });
    let tr = time::<C>(dev, args, &mut || {
        drop(kernels::cross_entropy::reference_log_softmax(
            x.clone(),
            tc.clone(),
        ))
    });
    row("cross_entropy", "8192x50304", dt, "fwd", n * eb, tf, tr);
    let xa = randn::<A, 2>([r, v], dt, dev).require_grad();
    let fused = || kernels::cross_entropy(xa.clone(), ta.clone(), 0.0).mean();
    let reference = || kernels::cross_entropy::reference_log_softmax(xa.clone(), ta.clone());
    let tf = time::<A>(dev, args, &mut || drop(fused().backward()));
    let tr = time::<A>(dev, args, &mut || drop(reference().backward()));
    row(
        "cross_entropy",
        "8192x50304",
        dt,
        "fwd+bwd",
        3.0 * n * eb,
        tf,
        tr,
    );
    // Memory held from the forward to the backward: the graph's saved tensors.
    let held = |f: &dyn Fn() -> Tensor<A, 1>| {
        A::sync(dev).expect("sync");
        A::memory_cleanup(dev);
        let before = in_use(dev);
        let loss = f();
        A::sync(dev).expect("sync");
        let after = in_use(dev);
        drop(loss.backward());
        after.saturating_sub(before)
    };
    let (hf, hr) = (held(&fused), held(&reference));
    println!(
        "| cross_entropy | 8192x50304 | {} | held fwd->bwd | fused {:.1} MiB | Burn {:.1} MiB | | | {:.0}x less |",
        model::dtype::name(dt),
        hf as f64 / 1048576.0,
        hr as f64 / 1048576.0,
        hr as f64 / hf.max(1) as f64
    );
}

fn in_use(dev: &CudaDevice) -> u64 {
    use cubecl::Runtime;
    let client = <cubecl::cuda::CudaRuntime as Runtime>::client(dev);
    client.memory_usage().map(|m| m.bytes_in_use).unwrap_or(0)
}

/// AdamW over 64M f32 parameters with gradients in `dt`, writing a `dt` compute copy when `dt` is
/// not f32: reads p, g, m, v and writes p, m, v (and the copy).
fn adamw(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let (r, c) = (16384, 4096);
    let n = (r * c) as f64;
    let p = randn::<C, 2>([r, c], FloatDType::F32, dev);
    let g = randn::<C, 2>([r, c], dt, dev).mul_scalar(1e-2);
    let m = p.clone().mul_scalar(1e-3);
    let v = p.clone().powi_scalar(2).mul_scalar(1e-6);
    let factor = Tensor::<C, 1>::from_floats([0.5], dev);
    let hp = kernels::AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 10,
    };
    let copy = (dt != FloatDType::F32).then_some(dt);
    let tf = time::<C>(dev, args, &mut || {
        drop(kernels::adamw_step(
            p.clone(),
            g.clone(),
            m.clone(),
            v.clone(),
            factor.clone(),
            &hp,
            copy,
        ))
    });
    let tr = time::<C>(dev, args, &mut || {
        drop(kernels::adamw::reference(
            p.clone(),
            g.clone(),
            m.clone(),
            v.clone(),
            factor.clone(),
            &hp,
            copy,
        ))
    });
    let bytes = n * (4.0 * 3.0 + bytes_of(dt) + 4.0 * 3.0 + copy.map_or(0.0, bytes_of));
    row("adamw (+copy)", "64M params", dt, "step", bytes, tf, tr);
}

/// The token embedding of `gpt2_small` (`[50304, 768]`, ids `[16, 1024]`): the forward gathers
/// rows (read and write 16384 x 768); the backward adds them into an f32 table gradient (clear
/// it, read the output gradient, add to it), where Burn's reference scatters with select-assign.
fn embedding(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let (vocab, d, b, t) = (50304, 768, 16, 1024);
    let n = (b * t * d) as f64;
    let eb = bytes_of(dt);
    let (ic, ia) = (
        targets::<C>(b * t, vocab, dev).reshape([b, t]),
        targets::<A>(b * t, vocab, dev).reshape([b, t]),
    );
    let (ic1, ic2, ia1, ia2) = (ic.clone(), ic, ia.clone(), ia);
    fwd_bwd::<1>(
        args,
        dev,
        "embedding",
        "50304x768[16x1024]",
        dt,
        (2.0 * n * eb, (vocab * d) as f64 * 4.0 + n * (eb + 4.0)),
        &|| [randn([vocab, d], dt, dev)],
        &|| [randn::<A, 2>([vocab, d], dt, dev).require_grad()],
        &move |[w]| kernels::embedding(w, ic1.clone()).reshape([b * t, d]),
        &move |[w]| kernels::embedding::reference(w, ic2.clone()).reshape([b * t, d]),
        &move |[w]| kernels::embedding(w, ia1.clone()).reshape([b * t, d]),
        &move |[w]| kernels::embedding::reference(w, ia2.clone()).reshape([b * t, d]),
    );
}

/// The LM head and its loss at `gpt2_small`'s shapes (16384 rows of width 768, 50304 classes),
/// forward and backward: the chunked kernel against all logits at once (Burn's matmul and the
/// reference cross-entropy). Compute-bound: TFLOP/s of the three GEMMs (logits, dx, dw: 6 r v d)
/// in the bandwidth column.
fn linear_cross_entropy(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    use kernels::cross_entropy::LinearCrossEntropy;
    let (r, d, v) = (16384, 768, 50304);
    let ta = targets::<A>(r, v, dev);
    let x = randn::<A, 2>([r, d], dt, dev).require_grad();
    let w = randn::<A, 2>([v, d], dt, dev)
        .mul_scalar(0.02)
        .require_grad();
    let tf = time::<A>(dev, args, &mut || {
        let loss = kernels::linear_cross_entropy(
            x.clone(),
            w.clone(),
            ta.clone(),
            LinearCrossEntropy::default(),
        );
        drop(loss.backward())
    });
    let tr = time::<A>(dev, args, &mut || {
        let loss = kernels::cross_entropy::linear::reference(x.clone(), w.clone(), ta.clone(), 0.0);
        drop(loss.backward())
    });
    let flops = 6.0 * (r * v * d) as f64;
    println!(
        "| linear_cross_entropy | 16384x768, 50304 classes | {} | fwd+bwd | {:.1} | {:.1} | {:.0} TFLOP/s | | {:.2}x |",
        model::dtype::name(dt),
        tf * 1e6,
        tr * 1e6,
        flops / tf / 1e12,
        tr / tf
    );
}

/// A model's worth of tensors (12 of [768, 3072], 12 of [3072, 768], 24 of [768, 768] and one of
/// [50304, 768]: 124M elements in 49 tensors, GPT-2 small's weights) for the sums over many tensors.
fn model_tensors(dt: FloatDType, dev: &CudaDevice) -> Vec<Tensor<C, 2>> {
    let mut shapes = vec![[50304, 768]];
    shapes.extend([[768, 3072], [3072, 768], [768, 768], [768, 768]].repeat(12));
    shapes
        .into_iter()
        .map(|s| randn::<C, 2>(s, dt, dev))
        .collect()
}

/// The sum of squares (the gradient norm of clipping) or the plain sum of every element of
/// GPT-2 small's tensors, into one f32 value: each tensor read once.
fn sums(args: &Args, dev: &CudaDevice, dt: FloatDType, op: Op) {
    let tensors = model_tensors(dt, dev);
    let n: usize = tensors.iter().map(|t| t.shape().num_elements()).sum();
    let prims = || -> Vec<_> {
        tensors
            .iter()
            .map(|t| t.clone().into_primitive().tensor())
            .collect()
    };
    let (name, tf, tr) = if op == Op::SumSquares {
        let tf = time::<C>(dev, args, &mut || {
            let mut sq = kernels::SumSquares::new(dev);
            tensors.iter().for_each(|t| sq.add(t.clone()));
            drop(sq.finish())
        });
        let tr = time::<C>(dev, args, &mut || {
            drop(kernels::reduce::sum_squares_reference::<C>(prims(), dev))
        });
        ("sum_squares", tf, tr)
    } else {
        let tf = time::<C>(dev, args, &mut || {
            drop(kernels::sum_f32(tensors.clone(), dev))
        });
        let tr = time::<C>(dev, args, &mut || {
            drop(kernels::reduce::sum_f32_reference::<C>(prims(), dev))
        });
        ("sum_f32", tf, tr)
    };
    row(
        name,
        "49 tensors, 124M",
        dt,
        "fwd",
        n as f64 * bytes_of(dt),
        tf,
        tr,
    );
}

/// Gradient accumulation: `f32(a) + f32(b)` with both in `dt` (the first micro-batch's sum),
/// written in f32.
fn add_as_f32(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let (r, c) = (16384, 4096);
    let n = (r * c) as f64;
    let (a, b) = (
        randn::<C, 2>([r, c], dt, dev),
        randn::<C, 2>([r, c], dt, dev),
    );
    let tf = time::<C>(dev, args, &mut || {
        drop(kernels::add_as_f32(a.clone(), b.clone()))
    });
    let tr = time::<C>(dev, args, &mut || {
        drop(kernels::reduce::add_as_f32_reference(a.clone(), b.clone()))
    });
    row(
        "add_as_f32",
        "16384x4096",
        dt,
        "fwd",
        n * (2.0 * bytes_of(dt) + 4.0),
        tf,
        tr,
    );
}

/// An f32 gradient times a device factor, stored in `dt` (unscaling and casting in one pass).
fn scale(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let (r, c) = (16384, 4096);
    let n = (r * c) as f64;
    let x = randn::<C, 2>([r, c], FloatDType::F32, dev);
    let factor = Tensor::<C, 1>::from_floats([0.5], dev);
    let tf = time::<C>(dev, args, &mut || {
        drop(kernels::scale(x.clone(), factor.clone(), dt))
    });
    let tr = time::<C>(dev, args, &mut || {
        drop(kernels::reduce::scale_reference(
            x.clone(),
            factor.clone(),
            dt,
        ))
    });
    row(
        "scale (f32 in)",
        "16384x4096",
        dt,
        "fwd",
        n * (4.0 + bytes_of(dt)),
        tf,
        tr,
    );
}

/// The format statistics of a tensor (largest magnitude, values below f16's smallest normal,
/// nonzero and non-finite counts) as partial rows: one read.
fn format_stats(args: &Args, dev: &CudaDevice, dt: FloatDType) {
    let (r, c) = (16384, 4096);
    let n = (r * c) as f64;
    let x = randn::<C, 2>([r, c], dt, dev).mul_scalar(1e-4);
    let min_normal = 2f64.powi(-14);
    let tf = time::<C>(dev, args, &mut || {
        drop(kernels::format_stats(x.clone(), min_normal))
    });
    let tr = time::<C>(dev, args, &mut || {
        drop(kernels::format_stats::reference(x.clone(), min_normal))
    });
    row(
        "format_stats",
        "16384x4096",
        dt,
        "fwd",
        n * bytes_of(dt),
        tf,
        tr,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_of_ops_and_dtypes_parse_and_unknown_ones_are_refused() {
        let args = Args::try_parse_from([
            "kernel_bench",
            "--ops",
            "rms_norm,cross_entropy",
            "--dtypes",
            "f16",
        ])
        .unwrap();
        assert_eq!(args.ops, [Op::RmsNorm, Op::CrossEntropy]);
        assert_eq!(args.dtypes, [DTypeArg::F16]);
        // The default is every op.
        assert_eq!(
            Args::try_parse_from(["kernel_bench"]).unwrap().ops,
            <Op as clap::ValueEnum>::value_variants()
        );
        let err = Args::try_parse_from(["kernel_bench", "--ops", "rms_norm,softmax"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("softmax") && err.contains("cross_entropy"),
            "{err}"
        );
        assert!(Args::try_parse_from(["kernel_bench", "--dtypes", "f64"]).is_err());
    }
}
