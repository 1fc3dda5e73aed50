//! Runs of one process per GPU, on two GPUs. Each test starts this test binary twice as its
//! workers (tests named `*_worker`, which do nothing unless the parent set their variables), with
//! torchrun's variables, as `train --nproc-per-node 2` would.
//!
//! - Collectives (`kernels::collective`): the two processes meet in the trainer's TCP rendezvous,
//!   join an NCCL communicator from the unique id it hands them, and check all-reduce,
//!   reduce-scatter and all-gather against values each rank can compute alone, in f32, bf16 and
//!   f16, on awkward shapes, on strided and pitched inputs, and in a chain of collectives and
//!   CubeCL kernels with no host synchronisation between them (the calls run on CubeCL's stream,
//!   in its order). Then the all-reduce's bus bandwidth, for the record.
//! - Training: two processes with 4 sequences each reach the losses and weights of one GPU with 8
//!   (as `multi_gpu.rs` checks for two threads), and a rank killed with SIGKILL ends the other
//!   with an error naming it, within a minute.
//!
//! The tests are marked `#[ignore = "needs 2 GPUs"]`: run on a machine with two CUDA GPUs and
//! NCCL with `cargo test --release --test multi_process -- --ignored --test-threads=1` (or the
//! staged binary, `--ignored`).

mod common;

use common::master_weights;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn::backend::cuda::CudaDevice;
use burn::backend::Cuda;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use kernels::collective::{ProcessGroup, ReduceOp};
use trainer::parallel::place::Place;
use trainer::parallel::rendezvous::rendezvous;

/// The variable that makes a `*_worker` test a worker (its value: what the worker needs).
const WORKER: &str = "BURNMIX_PROCESS_WORKER";

/// Starts two workers: this test binary running only the test `worker`, as ranks 0 and 1 of a run
/// on GPUs 0 and 1 whose rendezvous is on a free local port, with `WORKER` set to `arg`.
fn start_workers(worker: &str, arg: &str) -> Vec<Child> {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().unwrap().port()
    };
    let exe = std::env::current_exe().unwrap();
    (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    worker,
                    "--include-ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(WORKER, arg)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("the test binary starts again")
        })
        .collect()
}

/// Waits (until `deadline`, then kills) for a worker: whether it succeeded, and its output.
fn finish(mut w: Child, deadline: Instant) -> (Option<std::process::ExitStatus>, String) {
    let status = loop {
        if let Some(s) = w.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = w.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = w.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (status, text)
}

/// Waits for both workers and fails the test with their output if either failed.
fn expect_success(workers: Vec<Child>, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut failed = Vec::new();
    for (rank, w) in workers.into_iter().enumerate() {
        let (status, text) = finish(w, deadline);
        for line in text
            .lines()
            .filter(|l| l.starts_with("rank ") || l.contains("panicked") || l.contains("error"))
        {
            println!("{line}");
        }
        if status.is_none_or(|s| !s.success()) {
            failed.push(format!("rank {rank} ({status:?}):\n{text}"));
        }
    }
    assert!(failed.is_empty(), "workers failed:\n{}", failed.join("\n"));
}

#[test]
#[ignore = "needs 2 GPUs"]
fn two_processes_reduce_scatter_and_gather() {
    expect_success(
        start_workers("collective_worker", "1"),
        Duration::from_secs(240),
    );
}

/// One rank of [`two_processes_reduce_scatter_and_gather`]; does nothing unless started by it.
#[test]
#[ignore = "a worker of two_processes_reduce_scatter_and_gather"]
fn collective_worker() {
    if std::env::var(WORKER).is_err() {
        return;
    }
    let place = Place::from_env()
        .unwrap()
        .expect("the parent sets WORLD_SIZE");
    let (rank, world) = (place.rank, place.world_size);
    let device = CudaDevice::new(place.local_rank);
    let joined = rendezvous(
        &place,
        0xC011_EC71,
        || {
            Ok(kernels::collective::unique_id()
                .map_err(anyhow::Error::msg)?
                .to_vec())
        },
        Duration::from_secs(60),
    )
    .unwrap();
    let id: [u8; 128] = joined.payload.as_slice().try_into().expect("128 bytes");
    let group = ProcessGroup::join::<Cuda>(&device, &id, rank, world).unwrap();
    assert_eq!((group.rank(), group.world()), (rank, world));

    for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
        check_calls(&group, &device, dtype);
    }
    check_chain(&group, &device);
    group.check().unwrap();
    bandwidth(&group, &device);
    group.check().unwrap();
    // Every free reaches the device before the process exits.
    <Cuda as burn::tensor::backend::Backend>::sync(&device).unwrap();
    println!("rank {rank}: ok");
}

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

fn check_calls(group: &ProcessGroup, device: &CudaDevice, dtype: FloatDType) {
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
    group.check().unwrap();
}

/// 40 rounds of `x = all_reduce_mean(x) * 2 + rank`, queued without reading anything back: each
/// collective must see the kernel before it, and each kernel the collective before it. The
/// rounds are computed alone on the host for comparison (integers, exact in f32).
fn check_chain(group: &ProcessGroup, device: &CudaDevice) {
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
fn bandwidth(group: &ProcessGroup, device: &CudaDevice) {
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

/// Off CUDA a process group is refused with an error, not a panic.
#[test]
fn a_process_group_needs_cuda() {
    let device = burn::backend::wgpu::WgpuDevice::default();
    let err = ProcessGroup::join::<burn::backend::Wgpu>(&device, &[0; 128], 0, 1)
        .err()
        .expect("refused");
    assert!(err.contains("CUDA"), "{err}");
}

fn cuda() -> trainer::device::Selected {
    trainer::device::Selected::Cuda {
        index: 0,
        name: "test".into(),
    }
}

/// The run of `multi_gpu.rs`: a tiny model on the GPU's own kernels, `batch` sequences per GPU.
fn train_config(
    precision: trainer::config::PrecisionKind,
    batch: usize,
    steps: usize,
) -> trainer::config::Config {
    let mut cfg = common::tiny_config(steps);
    cfg.device = trainer::config::DeviceKind::Cuda;
    cfg.precision = precision;
    cfg.model.kernels = model::KernelsKind::Auto;
    cfg.model.attention = model::AttentionKind::Auto;
    cfg.model.dropout = 0.0;
    cfg.model.d_model = 64;
    cfg.model.context = 64;
    cfg.training.batch_size = batch;
    cfg
}

/// One rank of a training run: `WORKER` holds `DIR;PRECISION;STEPS`.
#[test]
#[ignore = "a worker of the training tests"]
fn train_worker() {
    let Ok(arg) = std::env::var(WORKER) else {
        return;
    };
    let parts: Vec<&str> = arg.split(';').collect();
    let (dir, precision, steps) = (parts[0], parts[1], parts[2]);
    let precision: trainer::config::PrecisionKind =
        serde_json::from_str(&format!("\"{precision}\"")).unwrap();
    let cfg = train_config(precision, 4, steps.parse().unwrap());
    let mut opts = common::opts(dir.into(), false);
    opts.place = Place::from_env().unwrap();
    opts.verbose = true;
    // As the `train` binary does: SIGTERM asks for a checkpoint at the next step boundary.
    trainer::stop::install_handlers();
    trainer::run(&cfg, &cuda(), &opts).unwrap_or_else(|e| panic!("{e:#}"));
    println!("rank {}: trained", opts.place.unwrap().rank);
}

/// A run's per-step losses and final checkpoint (header and values).
fn read_run(dir: &Path, steps: usize) -> (Vec<f64>, trainer::checkpoint::Header, Vec<f32>) {
    let losses = common::read_metrics(dir).iter().map(|r| r.loss).collect();
    let (h, v) = trainer::checkpoint::read(
        &dir.join("checkpoints")
            .join(trainer::checkpoint::file_name(steps as u64)),
    )
    .unwrap();
    (losses, h, v)
}

/// 20 steps in 2 processes with 4 sequences each equal 20 steps on one GPU with 8: per-step
/// losses within the precision's rounding, final weights within a small fraction of one AdamW
/// step on average, the two replicas' checksums equal, and only rank 0 wrote the run's files.
#[test]
#[ignore = "needs 2 GPUs"]
fn two_processes_train_like_one_gpu_with_the_doubled_batch() {
    use trainer::config::PrecisionKind;
    let _guard = common::serial();
    let steps = 20;
    // The tolerances of multi_gpu.rs (see there).
    for (precision, loss_tol, mean_tol) in [
        (PrecisionKind::Fp32, 1e-3, 0.01),
        (PrecisionKind::Bf16, 4.0 * 2f64.powi(-8), 0.1),
    ] {
        let one = train_config(precision, 8, steps);
        let one_dir = common::scratch(&format!("mp_one_{precision}"));
        trainer::run(&one, &cuda(), &common::opts(one_dir.clone(), false))
            .unwrap_or_else(|e| panic!("one GPU: {e:#}"));
        let two_dir = common::scratch(&format!("mp_two_{precision}"));
        expect_success(
            start_workers(
                "train_worker",
                &format!("{};{precision};{steps}", two_dir.display()),
            ),
            Duration::from_secs(300),
        );
        let (la, ha, va) = read_run(&one_dir, steps);
        let (lb, hb, vb) = read_run(&two_dir, steps);
        assert_eq!(
            hb.replica_checksums.len(),
            2,
            "{precision}: checksums of both ranks"
        );
        assert_eq!(
            hb.replica_checksums[0], hb.replica_checksums[1],
            "{precision}: the replicas differ"
        );
        assert!(two_dir.join("summary.json").exists());
        assert_eq!(
            la.len(),
            lb.len(),
            "{precision}: rank 0 logged every step once"
        );
        common::assert_losses_agree(
            &format!("{precision}, one GPU against two processes"),
            &la,
            &lb,
            loss_tol,
        );
        let lr = one.optimizer.lr;
        let (wa, wb) = (master_weights(&ha, &va), master_weights(&hb, &vb));
        let mean = wa
            .iter()
            .zip(&wb)
            .map(|(a, b)| (a - b).abs() as f64)
            .sum::<f64>()
            / wa.len() as f64;
        println!("{precision}: final master weights differ by {mean:.2e} on average (lr {lr})");
        assert!(
            mean < mean_tol * lr,
            "{precision}: final master weights differ by {mean:.2e} on average (lr {lr})"
        );
    }
}

/// SIGKILL of rank 1 while both train ends rank 0 with an error naming rank 1 within a minute
/// (rank 0 is then waiting in NCCL or on the GPU for rank 1's share).
#[test]
#[ignore = "needs 2 GPUs"]
fn a_killed_rank_ends_the_other_naming_it() {
    let dir = common::scratch("mp_killed");
    let mut workers = start_workers("train_worker", &format!("{};fp32;1000000", dir.display()));
    // Rank 0 writes metrics.jsonl once the steps run.
    wait_for_steps(&dir, 5);
    let rank1 = workers.pop().unwrap();
    let rank0 = workers.pop().unwrap();
    let mut rank1 = rank1;
    rank1.kill().unwrap();
    let _ = rank1.wait();
    let killed = Instant::now();
    let (status, text) = finish(rank0, killed + Duration::from_secs(60));
    let took = killed.elapsed();
    println!("rank 0 ended {took:?} after rank 1 was killed");
    let status =
        status.unwrap_or_else(|| panic!("rank 0 still ran 60 s after rank 1 was killed:\n{text}"));
    assert!(!status.success(), "{text}");
    assert!(
        text.contains("rank 0: rank 1 closed its connection before finishing"),
        "{text}"
    );
}

/// SIGTERM to rank 1 alone (a preemption notice that reached one process) stops both ranks at the
/// same step boundary, with that step's checkpoint, and both exit 0.
#[test]
#[ignore = "needs 2 GPUs"]
fn a_signal_to_one_rank_stops_every_rank_with_a_checkpoint() {
    let dir = common::scratch("mp_sigterm");
    let mut workers = start_workers("train_worker", &format!("{};fp32;1000000", dir.display()));
    wait_for_steps(&dir, 5);
    // SAFETY: signals a child this test started and has not reaped.
    unsafe { libc::kill(workers[1].id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    let rank1 = workers.pop().unwrap();
    let rank0 = workers.pop().unwrap();
    for (rank, w) in [(0, rank0), (1, rank1)] {
        let (status, text) = finish(w, deadline);
        assert!(
            status.is_some_and(|s| s.success()),
            "rank {rank} ({status:?}):\n{text}"
        );
    }
    let last = steps_logged(&dir) as u64;
    assert!(dir
        .join("checkpoints")
        .join(trainer::checkpoint::file_name(last))
        .exists());
    println!("both ranks stopped after step {last}, with its checkpoint");
}

/// Steps rank 0 has logged in `dir`'s `metrics.jsonl`.
fn steps_logged(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
}

/// Waits (at most 3 minutes: the first step compiles the kernels) until rank 0 logged `n` steps.
fn wait_for_steps(dir: &Path, n: usize) {
    let started = Instant::now();
    while steps_logged(dir) < n {
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "the run did not reach step {n}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
