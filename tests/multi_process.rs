//! Runs of one process per GPU, on two GPUs or on one. Each test starts this test binary twice as
//! its workers (tests named `*_worker`, which do nothing unless the parent set their variables),
//! with torchrun's variables, as `train --nproc-per-node 2` would.
//!
//! - Collectives (`kernels::collective`): the two processes meet in the trainer's TCP rendezvous,
//!   join an NCCL communicator from the unique id it hands them, and check all-reduce,
//!   reduce-scatter, all-gather (alone, and overlapped in a group), reduce and broadcast against
//!   values each rank can compute alone, in f32, bf16 and f16, on awkward shapes, on strided and
//!   pitched inputs, and in a chain of collectives and CubeCL kernels with no host
//!   synchronisation between them (the calls run on CubeCL's stream, in its order). Then the
//!   all-reduce's bus bandwidth, for the record.
//! - Training: two processes with 4 sequences each reach the losses and weights of one GPU with 8
//!   (as `multi_gpu.rs` checks for two threads), on one node and as two nodes whose NCCL traffic
//!   goes through its socket transport over loopback; a rank killed with SIGKILL ends the other
//!   with an error naming it, within a minute; SIGTERM to one rank stops both with a checkpoint.
//!
//! Layouts ([`Layout`]): with two GPUs, the ranks are one node's processes on GPUs 0 and 1, and
//! the two-node test runs beside. With one GPU, every test runs its two ranks as two "nodes" that
//! share the GPU: NCCL refuses two ranks of one host on one GPU, so each rank gets its own host id
//! (`NCCL_HOSTID`), which also puts their traffic on the socket transport. That checks every
//! collective and every training path on a machine of one GPU; only the bandwidth figure then
//! means nothing.
//!
//! The tests are marked `#[ignore = "needs a GPU and NCCL"]`: run them with
//! `cargo test --release --test multi_process -- --ignored --test-threads=1` (or the staged
//! binary, `--ignored`).

mod collective_cases;
mod common;

use collective_cases::{bandwidth, check_calls, check_chain};
use common::master_weights;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn::backend::cuda::CudaDevice;
use burn::backend::Cuda;
use burn::tensor::FloatDType;
use kernels::collective::ProcessGroup;
use trainer::parallel::place::Place;

/// The variable that makes a `*_worker` test a worker (its value: what the worker needs).
const WORKER: &str = "BURNMIX_PROCESS_WORKER";

/// Where the two ranks of a test run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    /// One node: ranks 0 and 1 on GPUs 0 and 1 (NCCL picks its fastest transport).
    OneNode,
    /// Two nodes of one process each on this host: rank r on GPU r modulo the GPU count, its own
    /// NCCL host id, and NCCL's peer-to-peer, shared-memory and InfiniBand transports off, so that
    /// everything goes through sockets over loopback, as between machines without InfiniBand.
    TwoNodes,
}

impl Layout {
    /// The layout of the tests that do not choose: one node where there are two GPUs.
    fn default_here() -> Layout {
        if gpus() >= 2 {
            Layout::OneNode
        } else {
            Layout::TwoNodes
        }
    }
}

/// The CUDA GPUs this process sees.
fn gpus() -> usize {
    trainer::parallel::cuda_device_count().expect("the CUDA driver")
}

/// Starts two workers: this test binary running only the test `worker`, as ranks 0 and 1 of a run
/// laid out as `layout`, whose rendezvous is on a free local port, with `WORKER` set to `arg`.
/// A worker dies with the thread of the test that started it (a test that panics leaves none behind).
fn start_workers(worker: &str, arg: &str, layout: Layout) -> Vec<Child> {
    use std::os::unix::process::CommandExt;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().unwrap().port()
    };
    let exe = std::env::current_exe().unwrap();
    let gpus = gpus();
    (0..2)
        .map(|rank| {
            let mut c = Command::new(&exe);
            c.args([
                "--exact",
                worker,
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WORKER, arg)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            match layout {
                Layout::OneNode => c.env("LOCAL_RANK", rank.to_string()),
                Layout::TwoNodes => c
                    .env("LOCAL_RANK", (rank % gpus).to_string())
                    .env("NCCL_HOSTID", format!("burnmix-test-node-{rank}"))
                    .env("NCCL_P2P_DISABLE", "1")
                    .env("NCCL_SHM_DISABLE", "1")
                    .env("NCCL_IB_DISABLE", "1"),
            };
            // SAFETY: prctl is async-signal-safe, and the closure touches nothing else.
            unsafe {
                c.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            c.spawn().expect("the test binary starts again")
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

/// Waits for both workers and fails the test with their output if either failed; their outputs.
fn expect_success(workers: Vec<Child>, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let mut failed = Vec::new();
    let mut outputs = Vec::new();
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
        outputs.push(text);
    }
    assert!(failed.is_empty(), "workers failed:\n{}", failed.join("\n"));
    outputs
}

#[test]
#[ignore = "needs a GPU and NCCL"]
fn two_processes_reduce_scatter_and_gather() {
    expect_success(
        start_workers("collective_worker", "1", Layout::default_here()),
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
    let membership =
        trainer::parallel::process::join::<Cuda>(&place, 0xC011_EC71, &device).unwrap();
    let group = membership.group.clone();
    assert_eq!((group.rank(), group.world()), (rank, world));

    for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
        check_calls(&group, &device, dtype);
    }
    check_chain(&group, &device);
    group.check().unwrap();
    bandwidth(&group, &device);
    group.check().unwrap();
    // Every free reaches the device, and every rank has its collectives' results, before the
    // process exits.
    <Cuda as burn::tensor::backend::Backend>::sync(&device).unwrap();
    membership.finish();
    println!("rank {rank}: ok");
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
    let mut cfg = common::tiny_config_on(trainer::config::DeviceKind::Cuda, steps);
    cfg.precision = precision;
    cfg.model.kernels = model::KernelsKind::Auto;
    cfg.model.attention = model::AttentionKind::Auto;
    cfg.model.dropout = 0.0;
    cfg.model.d_model = 64;
    cfg.model.context = 64;
    cfg.training.batch_size = batch;
    cfg
}

/// One rank of a training run: `WORKER` holds `DIR;PRECISION;STEPS`, then any of `zero=N`,
/// `bucket_mb=X`, `grad_accum=N`, `stop_at=STEP`, `recompute=MODE`, `d_model=N`,
/// `gather_codes=1`, `fp8_projections=RULE` and `resume=1`, separated by `;`.
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
    let mut cfg = train_config(precision, 4, steps.parse().unwrap());
    let (mut stop_at, mut resume) = (None, false);
    for setting in &parts[3..] {
        let (key, value) = setting.split_once('=').unwrap();
        match key {
            "zero" => cfg.training.zero = value.parse().unwrap(),
            "bucket_mb" => cfg.training.bucket_mb = value.parse().unwrap(),
            "grad_accum" => cfg.training.grad_accum = value.parse().unwrap(),
            "stop_at" => stop_at = Some(value.parse().unwrap()),
            "recompute" => {
                cfg.model.recompute = serde_json::from_str(&format!("\"{value}\"")).unwrap()
            }
            "resume" => resume = value == "1",
            "d_model" => cfg.model.d_model = value.parse().unwrap(),
            "gather_codes" => cfg.fp8.gather_codes = value == "1",
            "fp8_projections" => {
                cfg.fp8.projections = trainer::precision::Fp8Projections::Rule(value.into())
            }
            _ => panic!("unknown worker setting {setting}"),
        }
    }
    let mut opts = common::opts(dir.into(), resume);
    opts.stop_at = stop_at;
    opts.place = Place::from_env().unwrap();
    opts.verbose = true;
    // As the `train` binary does: SIGTERM asks for a checkpoint at the next step boundary.
    trainer::stop::install_handlers();
    trainer::run(&cfg, &cuda(), &opts).unwrap_or_else(|e| panic!("{e:#}"));
    println!("rank {}: trained", opts.place.unwrap().rank);
}

/// A run's per-step losses and gradient norms and its final checkpoint (header and values; a
/// sharded checkpoint reads as the whole one).
type Run = (Vec<f64>, Vec<f64>, trainer::checkpoint::Header, Vec<f32>);

fn read_run(dir: &Path, steps: usize) -> Run {
    let records = common::read_metrics(dir);
    let losses = records.iter().map(|r| r.loss).collect();
    let norms = records.iter().map(|r| r.grad_norm).collect();
    let (step, path) = trainer::checkpoint::list(dir)
        .unwrap()
        .pop()
        .expect("a checkpoint");
    assert_eq!(step, steps as u64, "{}", path.display());
    let (h, v) = trainer::checkpoint::read(&path).unwrap();
    (losses, norms, h, v)
}

/// The two-process run in `two` against the one-GPU run in `one`, both `steps` long: the two
/// replicas' checksums equal, rank 0 wrote the summary, and the training agrees
/// ([`assert_trains_like`]).
fn assert_like_one_gpu(
    what: &str,
    one: &Path,
    two: &Path,
    steps: usize,
    tols: (f64, f64),
    lr: f64,
) {
    let (_, _, hb, _) = read_run(two, steps);
    assert_eq!(
        hb.replica_checksums.len(),
        2,
        "{what}: checksums of both ranks"
    );
    assert_eq!(
        hb.replica_checksums[0], hb.replica_checksums[1],
        "{what}: the replicas differ"
    );
    assert!(two.join("summary.json").exists());
    assert_trains_like(what, one, two, steps, tols, lr);
}

/// The run in `other` against the one in `one`, both `steps` long: every step logged once,
/// per-step losses within `loss_tol` and gradient norms within 4 times that (a norm summed
/// wrongly across the ranks, say under ZeRO-2, is off by a factor near sqrt(2)), final master
/// weights within `mean_tol * lr` on average.
fn assert_trains_like(
    what: &str,
    one: &Path,
    other: &Path,
    steps: usize,
    (loss_tol, mean_tol): (f64, f64),
    lr: f64,
) {
    let (la, na, ha, va) = read_run(one, steps);
    let (lb, nb, hb, vb) = read_run(other, steps);
    assert_eq!(la.len(), lb.len(), "{what}: rank 0 logged every step once");
    common::assert_losses_agree(what, &la, &lb, loss_tol);
    let norms = format!("{what}, gradient norm");
    common::assert_losses_agree(&norms, &na, &nb, 4.0 * loss_tol);
    let (wa, wb) = (master_weights(&ha, &va), master_weights(&hb, &vb));
    let mean = wa
        .iter()
        .zip(&wb)
        .map(|(a, b)| (a - b).abs() as f64)
        .sum::<f64>()
        / wa.len() as f64;
    println!("{what}: final master weights differ by {mean:.2e} on average (lr {lr})");
    assert!(
        mean < mean_tol * lr,
        "{what}: final master weights differ by {mean:.2e} on average (lr {lr})"
    );
}

/// The tolerances of multi_gpu.rs (see there): per-step loss, and mean final weight difference
/// as a fraction of the learning rate.
fn tolerances(precision: trainer::config::PrecisionKind) -> (f64, f64) {
    match precision {
        trainer::config::PrecisionKind::Fp32 => (1e-3, 0.01),
        _ => (4.0 * 2f64.powi(-8), 0.1),
    }
}

/// A one-GPU run with 8 sequences per step, in a fresh directory named after `name`.
fn one_gpu_run(
    name: &str,
    precision: trainer::config::PrecisionKind,
    steps: usize,
) -> std::path::PathBuf {
    one_gpu_run_accumulating(name, precision, steps, 1)
}

/// [`one_gpu_run`] with `grad_accum` micro-batches of 8 per step.
fn one_gpu_run_accumulating(
    name: &str,
    precision: trainer::config::PrecisionKind,
    steps: usize,
    grad_accum: usize,
) -> std::path::PathBuf {
    let mut one = train_config(precision, 8, steps);
    one.training.grad_accum = grad_accum;
    let dir = common::scratch(name);
    trainer::run(&one, &cuda(), &common::opts(dir.clone(), false))
        .unwrap_or_else(|e| panic!("one GPU: {e:#}"));
    dir
}

/// 20 steps in 2 processes with 4 sequences each equal 20 steps on one GPU with 8 (see
/// [`assert_like_one_gpu`]). On one node where there are two GPUs, and as two nodes whose NCCL
/// traffic goes through sockets.
#[test]
#[ignore = "needs a GPU and NCCL"]
fn two_processes_train_like_one_gpu_with_the_doubled_batch() {
    use trainer::config::PrecisionKind;
    let _guard = common::serial();
    let steps = 20;
    let layouts = if gpus() >= 2 {
        vec![Layout::OneNode, Layout::TwoNodes]
    } else {
        vec![Layout::TwoNodes]
    };
    for precision in [PrecisionKind::Fp32, PrecisionKind::Bf16] {
        let one = one_gpu_run(&format!("mp_one_{precision}"), precision, steps);
        for &layout in &layouts {
            let what = format!("{precision}, one GPU against two processes ({layout:?})");
            let two = common::scratch(&format!("mp_two_{precision}_{layout:?}"));
            let arg = format!("{};{precision};{steps}", two.display());
            expect_success(
                start_workers("train_worker", &arg, layout),
                Duration::from_secs(300),
            );
            let lr = train_config(precision, 8, steps).optimizer.lr;
            assert_like_one_gpu(&what, &one, &two, steps, tolerances(precision), lr);
        }
    }
}

/// The gradients averaged while the backward runs, in many small buckets (about 0.1 MB: several
/// per block of the test model), with one micro-batch and with two (the first one's gradients
/// carried into the second's buckets), and averaged after the backward (`bucket_mb = 0`), train as
/// one GPU with the doubled batch does (see [`assert_like_one_gpu`]); ZeRO-1 takes the buckets too.
/// The other process tests run with the default buckets (one bucket for the test model).
#[test]
#[ignore = "needs a GPU and NCCL"]
fn bucketed_gradients_train_like_one_gpu() {
    use trainer::config::PrecisionKind;
    let _guard = common::serial();
    let (steps, precision) = (20, PrecisionKind::Bf16);
    let lr = train_config(precision, 8, steps).optimizer.lr;
    for accum in [1, 2] {
        let one =
            one_gpu_run_accumulating(&format!("mp_bucket_one_{accum}"), precision, steps, accum);
        let cases: &[(f64, u8)] = match accum {
            1 => &[(0.0, 0), (0.1, 0), (0.1, 1)],
            _ => &[(0.1, 0)],
        };
        for &(mb, zero) in cases {
            let what = format!("{precision}, bucket_mb {mb}, grad_accum {accum}, ZeRO-{zero}");
            let two = common::scratch(&format!("mp_bucket_{mb}_{accum}_{zero}"));
            let arg = format!(
                "{};{precision};{steps};zero={zero};bucket_mb={mb};grad_accum={accum}",
                two.display()
            );
            let outputs = expect_success(
                start_workers("train_worker", &arg, Layout::default_here()),
                Duration::from_secs(300),
            );
            let how = if mb > 0.0 {
                "averaged in buckets of up to"
            } else {
                "averaged one tensor at a time after the backward"
            };
            assert!(
                outputs[0].contains(how),
                "{what}: rank 0 did not say \"{how}\":\n{}",
                outputs[0]
            );
            // The overlapped calls need CubeCL's stream; without it they run in order.
            for out in &outputs {
                assert!(!out.contains("CUDA stream was not found"), "{what}:\n{out}");
            }
            assert_like_one_gpu(&what, &one, &two, steps, tolerances(precision), lr);
        }
    }
}

/// ZeRO-1 and ZeRO-2 between two processes train as one GPU with the doubled batch does (see
/// [`assert_like_one_gpu`]), in bf16, where the weights that a rank does not own travel as their
/// bf16 compute copy. Their checkpoints are sharded (each rank wrote its masters and moments) and
/// read as the whole one; consolidated into one file, they read the same.
#[test]
#[ignore = "needs a GPU and NCCL"]
fn zero_1_and_2_between_processes_train_like_one_gpu() {
    use trainer::config::PrecisionKind;
    let _guard = common::serial();
    let (steps, precision) = (20, PrecisionKind::Bf16);
    let one = one_gpu_run("mp_zero_one", precision, steps);
    for zero in [1, 2] {
        let what = format!("{precision}, one GPU against two processes with ZeRO-{zero}");
        let two = common::scratch(&format!("mp_zero_{zero}"));
        let arg = format!("{};{precision};{steps};zero={zero}", two.display());
        expect_success(
            start_workers("train_worker", &arg, Layout::default_here()),
            Duration::from_secs(300),
        );
        let lr = train_config(precision, 8, steps).optimizer.lr;
        assert_like_one_gpu(&what, &one, &two, steps, tolerances(precision), lr);
        assert_consolidates(&what, &two);
    }
}

/// The newest checkpoint in `dir` is sharded, and consolidated into one file it reads as the
/// shards do (as the whole checkpoint of a run of two).
fn assert_consolidates(what: &str, dir: &Path) {
    let (_, sharded) = trainer::checkpoint::list(dir).unwrap().pop().unwrap();
    assert!(
        sharded.is_dir(),
        "{what}: not sharded: {}",
        sharded.display()
    );
    let out = dir.join("consolidated.ckpt");
    trainer::checkpoint::shards::consolidate(&sharded, &out).unwrap();
    let (hs, vs) = trainer::checkpoint::read(&sharded).unwrap();
    let (hc, vc) = trainer::checkpoint::read(&out).unwrap();
    assert!(
        hs.params.iter().all(|p| p.rows.is_none()),
        "{what}: whole parameters"
    );
    assert_eq!((hs.params, hs.devices, vs), (hc.params, 2, vc), "{what}");
}

/// ZeRO-3 between two processes (each block's weights gathered as it runs, its gradients
/// reduce-scattered onto row shards) trains as one GPU with the doubled batch does (see
/// [`assert_trains_like`]), in bf16: as it is; with every block recomputed (gathered again for its
/// backward) and two micro-batches per step; and stopped halfway and resumed from its sharded
/// checkpoint, whose row shards read as the whole checkpoint and consolidate into one file. Then
/// in fp16, and in FP8 with its weights gathered in bf16 and as FP8 codes.
#[test]
#[ignore = "needs a GPU and NCCL"]
fn zero_3_between_processes_trains_like_one_gpu() {
    use trainer::config::PrecisionKind;
    let _guard = common::serial();
    let (steps, precision) = (20, PrecisionKind::Bf16);
    let lr = train_config(precision, 8, steps).optimizer.lr;
    for (name, accum, settings) in [
        ("plain", 1, ""),
        ("recomputed", 2, ";recompute=full;grad_accum=2"),
    ] {
        let one =
            one_gpu_run_accumulating(&format!("mp_zero3_one_{name}"), precision, steps, accum);
        let what = format!("{precision}, one GPU against two processes with ZeRO-3, {name}");
        let two = common::scratch(&format!("mp_zero3_{name}"));
        let arg = format!("{};{precision};{steps};zero=3{settings}", two.display());
        expect_success(
            start_workers("train_worker", &arg, Layout::default_here()),
            Duration::from_secs(300),
        );
        assert!(
            two.join("summary.json").exists(),
            "{what}: rank 0's summary"
        );
        assert_trains_like(&what, &one, &two, steps, tolerances(precision), lr);
        if name == "plain" {
            assert_consolidates(&what, &two);
        }
    }
    let one = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mp_zero3_one_plain");
    let dir = common::scratch("mp_zero3_resumed");
    let arg = format!("{};{precision};{steps};zero=3", dir.display());
    for more in [format!(";stop_at={}", steps / 2), ";resume=1".to_string()] {
        expect_success(
            start_workers(
                "train_worker",
                &format!("{arg}{more}"),
                Layout::default_here(),
            ),
            Duration::from_secs(300),
        );
    }
    let what = format!("{precision}, ZeRO-3 on two processes, stopped and resumed");
    assert_trains_like(&what, &one, &dir, steps, tolerances(precision), lr);

    // fp16 with its loss scaling, against one GPU; FP8, whose scales follow each GPU's own rows of
    // the batch, against two processes without ZeRO, at width 256: with its weights gathered in
    // bf16, and as FP8 codes (`fp8.gather_codes`, shards of 128 rows) with at most 0.55x the
    // bytes a step.
    let fp16 = PrecisionKind::Fp16;
    let one = one_gpu_run("mp_zero3_one_fp16", fp16, steps);
    let run = |precision: PrecisionKind, zero: usize, more: &str| {
        let name = format!("mp_zero{zero}_{precision}{}", more.replace([';', '='], "_"));
        let dir = common::scratch(&name);
        let arg = format!("{};{precision};{steps};zero={zero}{more}", dir.display());
        let out = expect_success(
            start_workers("train_worker", &arg, Layout::default_here()),
            Duration::from_secs(300),
        );
        (dir, out.concat())
    };
    let gathered = |dir: &Path| -> u64 {
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
        summary["gathered_bytes_per_step"]
            .as_u64()
            .expect("a run of processes reports its gathered bytes")
    };
    let wide = ";d_model=256";
    let lr = |precision| train_config(precision, 8, steps).optimizer.lr;
    let what = format!("{fp16}, one GPU against two processes with ZeRO-3");
    let (zero3, _) = run(fp16, 3, "");
    assert_trains_like(&what, &one, &zero3, steps, tolerances(fp16), lr(fp16));

    let fp8 = PrecisionKind::Fp8;
    let (one, _) = run(fp8, 0, wide);
    let (in_bf16, _) = run(fp8, 3, wide);
    let what = format!("{fp8}, two processes without ZeRO against two with ZeRO-3");
    assert_trains_like(&what, &one, &in_bf16, steps, tolerances(fp8), lr(fp8));
    let (as_codes, out) = run(fp8, 3, &format!("{wide};gather_codes=1"));
    let what = format!("{what}, its weights gathered as FP8 codes");
    assert!(
        out.contains("travel as FP8 codes"),
        "{what}: the log says so:\n{out}"
    );
    assert_trains_like(&what, &one, &as_codes, steps, tolerances(fp8), lr(fp8));
    let (codes, bf16) = (gathered(&as_codes), gathered(&in_bf16));
    println!(
        "ZeRO-3 gathers a step at width 256, FP8 recipe: as FP8 codes {codes} bytes, in bf16 {bf16} ({:.3}x)",
        codes as f64 / bf16 as f64
    );
    assert!(
        codes as f64 <= 0.55 * bf16 as f64,
        "{what}: {codes} bytes gathered a step against {bf16} in bf16"
    );
}

/// `fp8.projections = "auto"` on two processes: each times the projections on its own GPU and
/// both decide from the mean timings, so their logs give the same timings and the same decision,
/// which rank 0's `config.toml` records as the list of FP8 projections.
#[test]
#[ignore = "needs a GPU and NCCL"]
fn fp8_auto_projections_agree_between_processes() {
    let _guard = common::serial();
    let fp8 = trainer::config::PrecisionKind::Fp8;
    let dir = common::scratch("mp_fp8_auto");
    let arg = format!("{};{fp8};4;d_model=256;fp8_projections=auto", dir.display());
    let outs = expect_success(
        start_workers("train_worker", &arg, Layout::default_here()),
        Duration::from_secs(300),
    );
    // The heading, a line per projection of a block, and the decision.
    let lines = 2 + model::PROJECTION_PATHS.len();
    let decision = |out: &str| -> Vec<String> {
        out.lines()
            .skip_while(|l| !l.contains("fp8.projections = \"auto\""))
            .take(lines)
            .map(str::to_string)
            .collect()
    };
    let first = decision(&outs[0]);
    assert_eq!(
        first.len(),
        lines,
        "rank 0 logs the timings and the decision:\n{}",
        outs[0]
    );
    assert!(
        first[0].contains("the mean over 2 processes"),
        "{}",
        first[0]
    );
    for (rank, out) in outs.iter().enumerate().skip(1) {
        assert_eq!(decision(out), first, "rank {rank} against rank 0");
    }
    let config = trainer::config::Config::load(&dir.join("config.toml"), &[]).unwrap();
    assert!(
        !config.fp8.projections.is_auto(),
        "config.toml records the decision as a list: {:?}",
        config.fp8.projections
    );
}

/// A ZeRO-2 run of two processes with 4 sequences each, stopped after 10 of 20 steps with its
/// sharded checkpoint, continues on one GPU with 8 sequences (the same sequences per micro-batch):
/// the checkpoint is read whole and the run trains as the uninterrupted one-GPU run does (see
/// [`assert_trains_like`]). A batch size that changes the sequences per micro-batch is refused.
#[test]
#[ignore = "needs a GPU and NCCL"]
fn a_sharded_run_continues_on_another_gpu_count() {
    use trainer::config::PrecisionKind;
    let _guard = common::serial();
    let (steps, precision) = (20, PrecisionKind::Bf16);
    let one = one_gpu_run("mp_regroup_one", precision, steps);
    let dir = common::scratch("mp_regroup");
    let arg = format!(
        "{};{precision};{steps};zero=2;stop_at={}",
        dir.display(),
        steps / 2
    );
    expect_success(
        start_workers("train_worker", &arg, Layout::default_here()),
        Duration::from_secs(300),
    );
    let (_, sharded) = trainer::checkpoint::list(&dir).unwrap().pop().unwrap();
    assert!(sharded.is_dir(), "not sharded: {}", sharded.display());
    let mut wrong = train_config(precision, 4, steps);
    wrong.training.zero = 0;
    let e = trainer::run(&wrong, &cuda(), &common::opts(dir.clone(), true)).unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("sequences per micro-batch"), "{e}");
    let rest = train_config(precision, 8, steps);
    let s = trainer::run(&rest, &cuda(), &common::opts(dir.clone(), true))
        .unwrap_or_else(|e| panic!("resumed on one GPU: {e:#}"));
    assert_eq!(s.resumed_from, Some((steps / 2) as u64));
    let what = format!("{precision}, ZeRO-2 on two processes then one GPU");
    assert_trains_like(
        &what,
        &one,
        &dir,
        steps,
        tolerances(precision),
        rest.optimizer.lr,
    );
}

/// SIGKILL of rank 1 while both train ends rank 0 with an error naming rank 1 within a minute
/// (rank 0 is then waiting in NCCL or on the GPU for rank 1's share).
#[test]
#[ignore = "needs a GPU and NCCL"]
fn a_killed_rank_ends_the_other_naming_it() {
    let dir = common::scratch("mp_killed");
    let mut workers = start_workers(
        "train_worker",
        &format!("{};fp32;1000000", dir.display()),
        Layout::default_here(),
    );
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
#[ignore = "needs a GPU and NCCL"]
fn a_signal_to_one_rank_stops_every_rank_with_a_checkpoint() {
    let dir = common::scratch("mp_sigterm");
    let mut workers = start_workers(
        "train_worker",
        &format!("{};fp32;1000000", dir.display()),
        Layout::default_here(),
    );
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
