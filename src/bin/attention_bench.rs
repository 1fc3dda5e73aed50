//! FlashAttention benchmark on CUDA: our kernels beside Burn's own `attention`, with ratios to the
//! PyTorch SDPA (FlashAttention-2) figures of docs/peers.md.
//!
//! Shapes follow the FlashAttention benchmark convention: batch * seq = 16384 tokens and
//! heads * head_dim = 2048. FLOPs: forward `4 * b * h * s^2 * hd` (halved when causal), backward
//! 2.5x the forward, forward+backward 3.5x.
//!
//! Columns:
//! - `fwd`: `kernels::flash_attention_with_lse` on the plain CUDA backend;
//! - `bwd`: the backward kernels alone (delta pre-pass, dQ, dK/dV) from a saved forward;
//! - `fwd+bwd`: `kernels::flash_attention(..).sum().backward()` under `Autodiff`;
//! - `Burn fwd`, `Burn fwd+bwd`: `burn::tensor::module::attention` the same ways (under `Autodiff`
//!   Burn materialises the `s x s` scores);
//! - `/SDPA`: our fwd (bwd) TFLOP/s over docs/peers.md's PyTorch SDPA figure for the same shape.
//!
//! `--memory` instead runs forward+backward at B=1, H=16, S=16384, hd=128 and reports device
//! memory.
//!
//! Tile sweeps: the environment variable `BURNMIX_FLASH_TILES` (`kernels::settings::Settings::flash_tiles`)
//! overrides the tensor-core kernels' tile shapes, e.g. `BURNMIX_FLASH_TILES=fwd=2x64,dkdv=1x32x8`
//! (row tiles of 16 per warp x block depth [x warps per cube], per kernel: `fwd`, `dq`, `dkdv`),
//! `dq=fused` / `dq=separate` chooses whether the dK/dV kernel also computes dQ, and `bwd=split`
//! runs the backward in FlashAttention-2's split warp layouts.
//!
//! `--gqa` instead compares grouped-query with multi-head attention at Llama 3.2 1B's shape.
//!
//! `BURNMIX_FLASH_FP8=on` times the Hopper forward in FP8 (its quantization of q, k and v
//! included); the path column then says `hopper fp8` (`hopper` for the 16-bit Hopper forward).
//!
//! `cargo run --release --bin attention_bench -- [--dtype bf16] [--seqs 1024,2048,4096,8192]
//!  [--head-dims 64,128] [--no-burn] [--memory] [--qkv] [--gqa]`

use std::time::Instant;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::backend::Backend;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Distribution, FloatDType, Tensor};
use burnmix::bench::DTypeArg;
use clap::Parser;
use kernels::AttentionKernels;

type C = Cuda;
type A = Autodiff<Cuda>;

#[derive(Parser)]
#[command(
    about = "FlashAttention kernels versus Burn's attention on CUDA: TFLOP/s and ratios to PyTorch SDPA"
)]
struct Args {
    /// Input dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DTypeArg,
    /// Comma-separated sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    seqs: Vec<usize>,
    /// Comma-separated head dims.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    head_dims: Vec<usize>,
    /// Skip Burn's attention (it is slow and memory-hungry at long sequences).
    #[arg(long)]
    no_burn: bool,
    /// Calls per timed batch. A batch is timed on the host from the first launch to a
    /// synchronisation, so it also counts one launch's and one synchronisation's latency (tens of
    /// microseconds); 20 calls make that a few percent of a forward at S = 1024 (PyTorch's SDPA
    /// figures are timed with CUDA events, which leave it out).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Dropout probability inside the kernels (the SDPA columns stay those without dropout).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Compare, at GPT-2's attention shape (16 x 1024 tokens, 12 heads of 64), the model's way
    /// (q, k, v sliced out of the qkv projection, RoPE on q and k, FlashAttention) with
    /// `kernels::flash_attention_qkv` on the packed projection: fwd+bwd time and the memory the
    /// forward keeps for the backward.
    #[arg(long)]
    qkv: bool,
    /// Grouped-query attention against multi-head attention at Llama 3.2 1B's attention shape
    /// (8 x 2048 tokens, 32 query heads of 64, causal): `kernels::flash_attention_qkv` with 32,
    /// 8 and 1 key/value heads, forward and forward+backward, each as a share of the MHA time.
    #[arg(long)]
    gqa: bool,
    /// Report memory of forward+backward at B=1, H=16, S=16384, hd=128 instead.
    #[arg(long)]
    memory: bool,
}

/// PyTorch SDPA flash (bf16) forward / backward TFLOP/s on an H100 (docs/peers.md).
fn sdpa(hd: usize, causal: bool, s: usize) -> Option<(f64, f64)> {
    let col = match s {
        1024 => 0,
        2048 => 1,
        4096 => 2,
        8192 => 3,
        _ => return None,
    };
    let table: [[(f64, f64); 4]; 4] = [
        [
            (278.0, 210.0),
            (301.0, 248.0),
            (305.0, 264.0),
            (312.0, 287.0),
        ],
        [
            (219.0, 151.0),
            (269.0, 198.0),
            (282.0, 228.0),
            (298.0, 257.0),
        ],
        [
            (339.0, 226.0),
            (357.0, 256.0),
            (352.0, 286.0),
            (365.0, 306.0),
        ],
        [
            (252.0, 165.0),
            (291.0, 213.0),
            (304.0, 251.0),
            (317.0, 278.0),
        ],
    ];
    let row = match (hd, causal) {
        (64, false) => 0,
        (64, true) => 1,
        (128, false) => 2,
        (128, true) => 3,
        _ => return None,
    };
    Some(table[row][col])
}

fn time<Bk: Backend>(dev: &Bk::Device, iters: usize, reps: usize, f: &mut dyn FnMut()) -> f64 {
    burnmix::bench::median_seconds::<Bk>(dev, 1, iters, reps, f)
}

fn randn<Bk: Backend>(shape: [usize; 4], dt: FloatDType, dev: &Bk::Device) -> Tensor<Bk, 4> {
    Tensor::<Bk, 4>::random(shape, Distribution::Normal(0.0, 1.0), dev).cast(dt)
}

fn prim<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> burn::tensor::ops::FloatTensor<Bk> {
    t.into_primitive().tensor()
}

fn burn_attention<Bk: Backend>(
    q: Tensor<Bk, 4>,
    k: Tensor<Bk, 4>,
    v: Tensor<Bk, 4>,
    causal: bool,
) -> Tensor<Bk, 4> {
    burn::tensor::module::attention(
        q,
        k,
        v,
        None,
        None,
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: causal,
        },
    )
}

fn in_use(dev: &CudaDevice) -> (u64, u64) {
    use cubecl::Runtime;
    let client = <cubecl::cuda::CudaRuntime as Runtime>::client(dev);
    client
        .memory_usage()
        .map(|m| (m.bytes_in_use, m.bytes_reserved))
        .unwrap_or((0, 0))
}

/// Sliced q, k, v with RoPE and FlashAttention against `kernels::flash_attention_qkv` (see
/// `--qkv`).
fn packed(dev: &CudaDevice, dt: FloatDType, args: &Args) {
    let (b, t, h, hd) = (16, 1024, 12, 64);
    let d = h * hd;
    let (cos, sin) = kernels::rope::tables::<A>(t, hd, 10_000.0, dev);
    let qkv = Tensor::<A, 3>::random([b, t, 3 * d], Distribution::Normal(0.0, 1.0), dev)
        .cast(dt)
        .require_grad();
    let g = Tensor::<A, 3>::random([b, t, d], Distribution::Normal(0.0, 1.0), dev).cast(dt);
    let sliced = |qkv: Tensor<A, 3>| {
        let x = qkv.reshape([b, t, 3 * h, hd]).swap_dims(1, 2);
        let part = |p: usize| x.clone().slice([0..b, p * h..(p + 1) * h, 0..t, 0..hd]);
        let q = kernels::rope(part(0), cos.clone(), sin.clone());
        let k = kernels::rope(part(1), cos.clone(), sin.clone());
        kernels::flash_attention(q, k, part(2), true, None)
            .swap_dims(1, 2)
            .reshape([b, t, d])
    };
    let fused = |qkv: Tensor<A, 3>| {
        kernels::flash_attention_qkv(qkv, h, h, cos.clone(), sin.clone(), true, None, None)
    };
    println!("Attention of a packed qkv projection, {dt:?}, B={b} T={t} H={h} hd={hd}, causal (median of {} x {} calls)\n", args.reps, args.iters);
    println!("| path | fwd+bwd ms | kept by the forward, MiB |");
    println!("|---|---|---|");
    for (name, f) in [
        (
            "slices + rope + flash_attention",
            &sliced as &dyn Fn(Tensor<A, 3>) -> Tensor<A, 3>,
        ),
        ("flash_attention_qkv", &fused),
    ] {
        let secs = time::<A>(dev, args.iters, args.reps, &mut || {
            drop((f(qkv.clone()) * g.clone()).sum().backward())
        });
        A::sync(dev).expect("sync");
        let (before, _) = in_use(dev);
        let y = f(qkv.clone());
        A::sync(dev).expect("sync");
        let (after, _) = in_use(dev);
        drop(y);
        println!(
            "| {name} | {:.3} | {:.1} |",
            secs * 1e3,
            mib(after.saturating_sub(before))
        );
    }
}

/// Grouped-query against multi-head attention (see `--gqa`).
fn gqa(dev: &CudaDevice, dt: FloatDType, args: &Args) {
    let (b, t, h, hd) = (8, 2048, 32, 64);
    let (cos, sin) = kernels::rope::tables::<A>(t, hd, 500_000.0, dev);
    let (cos_c, sin_c) = (cos.clone().inner(), sin.clone().inner());
    let flops = 4.0 * (b * h * t * t * hd) as f64 * 0.5;
    println!("Grouped-query FlashAttention on a packed qkv projection, {dt:?}, B={b} T={t}, {h} query heads of {hd}, causal (median of {} x {} calls)\n", args.reps, args.iters);
    println!("| key/value heads | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd / MHA's time | fwd+bwd / MHA's time |");
    println!("|---|---|---|---|---|---|---|");
    let mut mha: Option<(f64, f64)> = None;
    for hkv in [h, 8, 1] {
        let width = (h + 2 * hkv) * hd;
        let qkv = Tensor::<A, 3>::random([b, t, width], Distribution::Normal(0.0, 1.0), dev)
            .cast(dt)
            .require_grad();
        let qkv_c = qkv.clone().inner();
        let g =
            Tensor::<A, 3>::random([b, t, h * hd], Distribution::Normal(0.0, 1.0), dev).cast(dt);
        let fwd = time::<C>(dev, args.iters, args.reps, &mut || {
            drop(kernels::flash_attention_qkv(
                qkv_c.clone(),
                h,
                hkv,
                cos_c.clone(),
                sin_c.clone(),
                true,
                None,
                None,
            ))
        });
        let both = time::<A>(dev, args.iters, args.reps, &mut || {
            let y = kernels::flash_attention_qkv(
                qkv.clone(),
                h,
                hkv,
                cos.clone(),
                sin.clone(),
                true,
                None,
                None,
            );
            drop((y * g.clone()).sum().backward())
        });
        let (f0, b0) = *mha.get_or_insert((fwd, both));
        println!(
            "| {hkv} | {:.3} | {:.0} | {:.3} | {:.0} | {:.3} | {:.3} |",
            fwd * 1e3,
            flops / fwd / 1e12,
            both * 1e3,
            3.5 * flops / both / 1e12,
            fwd / f0,
            both / b0
        );
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

fn main() {
    let args = Args::parse();
    kernels::kernel_cache::cache_per_build();
    let dev = CudaDevice::default();
    let dt = FloatDType::from(args.dtype);
    if args.memory {
        memory(&dev, dt);
        return;
    }
    if args.qkv {
        packed(&dev, dt, &args);
        return;
    }
    if args.gqa {
        gqa(&dev, dt, &args);
        return;
    }
    let dropout = (args.dropout > 0.0).then(|| kernels::Dropout::new(args.dropout, 0x5eed));
    println!("FlashAttention, {}, dropout {}, batch * seq = 16384, heads * head_dim = 2048; TFLOP/s (median of {} x {} calls)\n", args.dtype, args.dropout, args.reps, args.iters);
    println!("| hd | mask | S | B x H | path | fwd | bwd | fwd+bwd | Burn fwd | Burn fwd+bwd | fwd vs Burn | fwd+bwd vs Burn | fwd/SDPA | bwd/SDPA |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &hd in &args.head_dims {
        for causal in [false, true] {
            for &s in &args.seqs {
                let (b, h) = ((16384 / s).max(1), (2048 / hd).max(1));
                let fwd_flops = 4.0 * (b * h * s * s * hd) as f64 * if causal { 0.5 } else { 1.0 };
                let shape = [b, h, s, hd];
                let (q, k, v) = (
                    randn::<C>(shape, dt, &dev),
                    randn::<C>(shape, dt, &dev),
                    randn::<C>(shape, dt, &dev),
                );
                let path = kernels::flash_attention_path(&q)
                    .map(|p| p.to_string())
                    .unwrap_or_default();
                let scale = kernels::attention::default_scale(hd) as f32;
                let forward = || {
                    C::flash_attention_forward(
                        prim(q.clone()),
                        prim(k.clone()),
                        prim(v.clone()),
                        causal,
                        scale,
                        dropout,
                    )
                };
                let before = kernels::attention::hopper_calls();
                let t_fwd = time::<C>(&dev, args.iters, args.reps, &mut || drop(forward()));
                let after = kernels::attention::hopper_calls();
                // Which forward the timing took, where it was a Hopper kernel.
                let path = if after.forward_fp8 > before.forward_fp8 {
                    "hopper fp8".to_string()
                } else if after.forward > before.forward {
                    "hopper".to_string()
                } else {
                    path
                };
                let (o, lse) = forward();
                let g = randn::<C>(shape, dt, &dev);
                let t_bwd = time::<C>(&dev, args.iters, args.reps, &mut || {
                    drop(C::flash_attention_backward(
                        prim(q.clone()),
                        prim(k.clone()),
                        prim(v.clone()),
                        o.clone(),
                        lse.clone(),
                        prim(g.clone()),
                        causal,
                        scale,
                        dropout,
                    ))
                });
                let leaf = |t: &Tensor<C, 4>| Tensor::<A, 4>::from_inner(t.clone()).require_grad();
                let (qa, ka, va) = (leaf(&q), leaf(&k), leaf(&v));
                let t_fb = time::<A>(&dev, args.iters, args.reps, &mut || {
                    drop(
                        match dropout {
                            Some(d) => kernels::flash_attention_dropout(
                                qa.clone(),
                                ka.clone(),
                                va.clone(),
                                causal,
                                None,
                                d,
                            ),
                            None => kernels::flash_attention(
                                qa.clone(),
                                ka.clone(),
                                va.clone(),
                                causal,
                                None,
                            ),
                        }
                        .sum()
                        .backward(),
                    )
                });
                let (burn_f, burn_fb) = if args.no_burn {
                    (f64::NAN, f64::NAN)
                } else {
                    let tf = time::<C>(&dev, 1, 3, &mut || {
                        drop(burn_attention(q.clone(), k.clone(), v.clone(), causal))
                    });
                    let tfb = time::<A>(&dev, 1, 3, &mut || {
                        drop(
                            burn_attention(qa.clone(), ka.clone(), va.clone(), causal)
                                .sum()
                                .backward(),
                        )
                    });
                    (tf, tfb)
                };
                let tf = |t: f64, mult: f64| fwd_flops * mult / t / 1e12;
                let (sf, sb) = sdpa(hd, causal, s).unwrap_or((f64::NAN, f64::NAN));
                println!(
                    "| {hd} | {} | {s} | {b} x {h} | {path} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1}x | {:.1}x | {:.2} | {:.2} |",
                    if causal { "causal" } else { "full" },
                    tf(t_fwd, 1.0),
                    tf(t_bwd, 2.5),
                    tf(t_fb, 3.5),
                    tf(burn_f, 1.0),
                    tf(burn_fb, 3.5),
                    burn_f / t_fwd,
                    burn_fb / t_fb,
                    tf(t_fwd, 1.0) / sf,
                    tf(t_bwd, 2.5) / sb,
                );
            }
        }
    }
}

/// Device memory of forward+backward at B=1, H=16, S=16384, hd=128: in use after the inputs, after
/// the forward (output and log-sum-exp kept for the backward), and with the three gradients.
fn memory(dev: &CudaDevice, dt: FloatDType) {
    let (b, h, s, hd) = (1, 16, 16384, 128);
    let shape = [b, h, s, hd];
    let leaf = || randn::<A>(shape, dt, dev).detach().require_grad();
    let (q, k, v) = (leaf(), leaf(), leaf());
    A::sync(dev).expect("sync");
    let (base, base_res) = in_use(dev);
    let t = Instant::now();
    let o = kernels::flash_attention(q.clone(), k.clone(), v.clone(), true, None);
    A::sync(dev).expect("sync");
    let (after_fwd, _) = in_use(dev);
    let grads = (o * randn::<A>(shape, dt, dev)).sum().backward();
    let (dq, dk, dv) = (
        q.grad(&grads).expect("dq"),
        k.grad(&grads).expect("dk"),
        v.grad(&grads).expect("dv"),
    );
    A::sync(dev).expect("sync");
    let secs = t.elapsed().as_secs_f64();
    let (after_bwd, after_res) = in_use(dev);
    let nan = |t: Tensor<C, 4>| t.is_nan().any().into_scalar() != 0;
    let has_nan = nan(dq) || nan(dk) || nan(dv);
    let input =
        (3 * b * h * s * hd) as f64 * if dt == FloatDType::F32 { 4.0 } else { 2.0 } / 1048576.0;
    println!("FlashAttention fwd+bwd, causal, B={b} H={h} S={s} hd={hd} {dt:?}: {secs:.2} s (first call, includes compilation)");
    println!("| what | MiB |");
    println!("|---|---|");
    println!("| q, k, v | {input:.1} |");
    println!("| in use before | {:.1} |", mib(base));
    println!(
        "| in use after forward (+ output, lse, probe) | {:.1} |",
        mib(after_fwd)
    );
    println!(
        "| in use after backward (+ dq, dk, dv, probe) | {:.1} |",
        mib(after_bwd)
    );
    println!(
        "| reserved by the allocator: before / after | {:.1} / {:.1} |",
        mib(base_res),
        mib(after_res)
    );
    println!(
        "| one f32 S x S score matrix per head, for comparison | {:.1} |",
        (h * s * s * 4) as f64 / 1048576.0
    );
    println!("gradients contain NaN: {has_nan}");
}
