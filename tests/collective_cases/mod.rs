//! The collectives between two processes, checked from inside one rank (the workers of
//! `tests/multi_process.rs`): every call of `kernels::collective::ProcessGroup` against values
//! each rank computes alone, a chain of collectives and kernels with no host synchronisation, and
//! the all-reduce's bus bandwidth.

use std::time::Instant;

use burn::backend::cuda::CudaDevice;
use burn::backend::Cuda;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};
use kernels::collective::{Flat, ProcessGroup, ReduceOp};

/// Rank `r`'s values: small integers times `r + 1`, exact in every dtype under test, as are their
/// sums and halves over two ranks.
fn values(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + salt) % 61) as f32 * (rank + 1) as f32)
        .collect()
}

fn tensor<const D: usize>(
    v: Vec<f32>,
    shape: [usize; D],
    device: &CudaDevice,
    dtype: FloatDType,
) -> Tensor<Cuda, D> {
    Tensor::<Cuda, D>::from_data(TensorData::new(v, shape), device).cast(dtype)
}

fn read<const D: usize>(t: Tensor<Cuda, D>) -> Vec<f32> {
    t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
}

pub fn check_calls(group: &ProcessGroup, device: &CudaDevice, dtype: FloatDType) {
    let (rank, world) = (group.rank(), group.world());
    let every = |n: usize, salt: usize| -> Vec<Vec<f32>> {
        (0..world).map(|r| values(r, n, salt)).collect()
    };
    let sum = |all: &[Vec<f32>]| -> Vec<f32> {
        (0..all[0].len())
            .map(|i| all.iter().map(|v| v[i]).sum())
            .collect()
    };
    // All-reduce, sum and mean, of a 2-D tensor whose bf16/f16 rows (386 bytes) CUDA pitches.
    let (rows, cols) = (37, 193);
    for (op, div) in [(ReduceOp::Sum, 1.0), (ReduceOp::Mean, world as f32)] {
        let all = every(rows * cols, 1);
        let got =
            read(group.all_reduce(tensor(all[rank].clone(), [rows, cols], device, dtype), op));
        let want: Vec<f32> = sum(&all).iter().map(|s| s / div).collect();
        assert_eq!(
            got, want,
            "rank {rank}: all_reduce {op:?} {dtype:?} [{rows}, {cols}]"
        );
    }
    // A strided input (a transposed view) and an input that another tensor shares: neither may
    // be written in place, and the result is in the view's logical order.
    let all = every(rows * cols, 2);
    let base = tensor(all[rank].clone(), [rows, cols], device, dtype);
    let kept = base.clone();
    let got = read(group.all_reduce(base.transpose(), ReduceOp::Sum));
    let summed = sum(&all);
    let want: Vec<f32> = (0..cols * rows)
        .map(|k| summed[(k % rows) * cols + k / rows])
        .collect();
    assert_eq!(
        got, want,
        "rank {rank}: all_reduce of a transposed view, {dtype:?}"
    );
    assert_eq!(
        read(kept),
        all[rank],
        "rank {rank}: the shared input was written"
    );
    // Reduce-scatter of world * 1001 elements: this rank's share of the sum.
    let n = 1001;
    let all = every(world * n, 3);
    let got = read(group.reduce_scatter(
        tensor(all[rank].clone(), [world * n], device, dtype),
        ReduceOp::Sum,
    ));
    assert_eq!(
        got,
        sum(&all)[rank * n..(rank + 1) * n],
        "rank {rank}: reduce_scatter {dtype:?}"
    );
    // All-gather of 999 elements each, rank 0's first, from a 2-D tensor.
    let all = every(27 * 37, 4);
    let got = read(group.all_gather(tensor(all[rank].clone(), [27, 37], device, dtype)));
    assert_eq!(got, all.concat(), "rank {rank}: all_gather {dtype:?}");
    // Overlapped all-gathers of three tensors in one NCCL group (one of them f32, one of one
    // element), read after the wait: each as its own all-gather.
    let sizes = [999, 1, 4099];
    let all: Vec<Vec<Vec<f32>>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| every(n, 20 + k))
        .collect();
    let inputs = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let d = if k == 1 { FloatDType::F32 } else { dtype };
            Flat::Float(tensor(all[k][rank].clone(), [n], device, d))
        })
        .collect();
    let outs = group.all_gather_overlapped(inputs);
    group.wait_overlapped::<Cuda>(device);
    for (k, out) in outs.into_iter().enumerate() {
        assert_eq!(
            read(out.float()),
            all[k].concat(),
            "rank {rank}: overlapped all_gather {k} of a group, {dtype:?}"
        );
    }
    // Integers (FP8 codes, four to an element) gather bytes for bytes, beside floats in one
    // group, in order and overlapped, with every bit pattern (a NaN's among them) intact; the
    // group counts the bytes its gathers receive.
    let words = |r: usize| -> Vec<i32> {
        (0..1027)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ (r as u32 * 0x7fc0_0001)) as i32)
            .collect()
    };
    let every_words: Vec<i32> = (0..world).flat_map(words).collect();
    let scales = every(9, 21);
    for overlapped in [false, true] {
        let before = group.gathered_bytes();
        let codes = Tensor::<Cuda, 1, Int>::from_data(TensorData::new(words(rank), [1027]), device);
        let parts = vec![
            Flat::Int(codes),
            Flat::Float(tensor(scales[rank].clone(), [9], device, FloatDType::F32)),
        ];
        let mut outs = if overlapped {
            let outs = group.all_gather_overlapped(parts);
            group.wait_overlapped::<Cuda>(device);
            outs
        } else {
            group.all_gather_group(parts)
        };
        let got_scales = read(outs.pop().unwrap().float());
        let got_words = outs.pop().unwrap().int().into_data().convert::<i32>();
        assert_eq!(
            got_words.to_vec::<i32>().unwrap(),
            every_words,
            "rank {rank}: all-gathered i32 words (overlapped: {overlapped})"
        );
        assert_eq!(got_scales, scales.concat(), "rank {rank}: and their scales");
        assert_eq!(
            group.gathered_bytes() - before,
            (world * (1027 + 9) * 4) as u64,
            "rank {rank}: the bytes counted"
        );
    }
    // Reduce (mean) to each rank in turn, of a pitched 2-D tensor: the result on that rank only.
    for root in 0..world {
        let all = every(rows * cols, 5 + root);
        let got = group.reduce(
            tensor(all[rank].clone(), [rows, cols], device, dtype),
            ReduceOp::Mean,
            root,
        );
        if rank == root {
            let want: Vec<f32> = sum(&all).iter().map(|s| s / world as f32).collect();
            assert_eq!(read(got), want, "rank {rank}: reduce to {root}, {dtype:?}");
        }
    }
    // Broadcast from each rank in turn: the others' values are overwritten with the root's.
    for root in 0..world {
        let all = every(rows * cols, 9 + root);
        let got =
            read(group.broadcast(tensor(all[rank].clone(), [rows, cols], device, dtype), root));
        assert_eq!(
            got, all[root],
            "rank {rank}: broadcast from {root}, {dtype:?}"
        );
    }
    group.check().unwrap();
}

/// 40 rounds of `x = all_reduce_mean(x) * 2 + rank`, queued without reading anything back: each
/// collective must see the kernel before it, and each kernel the collective before it. The
/// rounds are computed alone on the host for comparison (integers, exact in f32).
pub fn check_chain(group: &ProcessGroup, device: &CudaDevice) {
    let (rank, world) = (group.rank(), group.world());
    let n = 4099;
    let start =
        |r: usize| -> Vec<f32> { values(r, n, 5).iter().map(|v| v.rem_euclid(8.0)).collect() };
    let mut x = tensor(start(rank), [n], device, FloatDType::F32);
    let mut host: Vec<Vec<f32>> = (0..world).map(start).collect();
    for _ in 0..40 {
        x = group
            .all_reduce(x, ReduceOp::Mean)
            .mul_scalar(2.0)
            .add_scalar(rank as f32);
        let mean: Vec<f32> = (0..n)
            .map(|i| host.iter().map(|v| v[i]).sum::<f32>() / world as f32)
            .collect();
        host = (0..world)
            .map(|r| {
                mean.iter()
                    .map(|m| (m * 2.0 + r as f32).rem_euclid(4096.0))
                    .collect()
            })
            .collect();
        // Kept small (and exact) on both sides.
        x = x.remainder_scalar(4096.0);
    }
    assert_eq!(
        read(x),
        host[rank],
        "rank {rank}: a chain of collectives and kernels"
    );
}

/// The all-reduce's algorithm and bus bandwidth on 256 MiB of bf16, as NCCL's tests report them
/// (bus = algorithm * 2 (n - 1) / n).
pub fn bandwidth(group: &ProcessGroup, device: &CudaDevice) {
    let n = 128 << 20;
    let mut x = Tensor::<Cuda, 1>::zeros([n], device).cast(FloatDType::BF16);
    assert_eq!(x.dtype(), DType::BF16);
    for _ in 0..5 {
        x = group.all_reduce(x, ReduceOp::Sum);
    }
    let _ = read(x.clone().narrow(0, 0, 1));
    let iters = 20;
    let t = Instant::now();
    for _ in 0..iters {
        x = group.all_reduce(x, ReduceOp::Sum);
    }
    let _ = read(x.narrow(0, 0, 1));
    let s = t.elapsed().as_secs_f64() / iters as f64;
    let algo = (n * 2) as f64 / s / 1e9;
    let world = group.world() as f64;
    println!(
        "rank {}: all_reduce bf16 256 MiB: {:.3} ms, algorithm {algo:.1} GB/s, bus {:.1} GB/s",
        group.rank(),
        s * 1e3,
        algo * 2.0 * (world - 1.0) / world
    );
}
