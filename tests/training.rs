//! End-to-end training on the test device (wgpu, else the CPU): the loss falls, a resumed run repeats the uninterrupted one, and
//! checkpoints are complete or refused.

mod common;

use common::{opts, read_metrics, scratch, tiny_config};
use trainer::checkpoint;

#[test]
fn loss_decreases_on_a_short_run() {
    let _guard = common::serial();
    let dir = scratch("loss_decreases");
    let mut cfg = tiny_config(60);
    cfg.training.eval_interval = 30;
    let s = trainer::run(&cfg, &common::selected(), &opts(dir.clone(), false)).unwrap();
    let m = read_metrics(&dir);
    assert_eq!(m.len(), 60);
    let first: f64 = m[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    let last: f64 = m[55..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    // Uniform guessing over the ~50-character vocabulary is ln(50) = 3.9 nats.
    assert!(first > 3.0, "first losses {first}");
    assert!(last < first - 0.8, "loss went from {first} to {last}");
    assert!(s.best_val_loss.unwrap() < first - 0.5);
    // Every record has the documented fields; evaluations at steps 30 and 60.
    let evals: Vec<u64> = m
        .iter()
        .filter(|r| r.val_loss.is_some())
        .map(|r| r.step)
        .collect();
    assert_eq!(evals, vec![30, 60]);
    assert!(m
        .iter()
        .all(|r| r.lr > 0.0 && r.grad_norm.is_finite() && r.tokens_per_s > 0.0));
    for f in [
        "config.toml",
        "tokenizer.json",
        "loss.svg",
        "summary.json",
        "checkpoints/step_00000060.ckpt",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let svg = std::fs::read_to_string(dir.join("loss.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("polyline"));
    // The resolved config in the run directory reproduces the run's config.
    let saved = trainer::Config::load(&dir.join("config.toml"), &[]).unwrap();
    assert_eq!(saved, cfg);
}

#[test]
fn resumed_run_matches_uninterrupted_run() {
    resumed_run_matches(model::AttentionKind::Plain, "resume");
}

/// The kernels' dropout (fused ops and flash attention, every mask drawn in a kernel) is repeated
/// on resume too.
#[test]
fn resumed_run_with_kernel_dropout_matches_uninterrupted_run() {
    if !common::needs_wgpu() {
        return;
    }
    resumed_run_matches(model::AttentionKind::Flash, "resume_flash");
}

/// FP8 with delayed per-tensor scaling: the amax histories travel in the checkpoint, so the
/// resumed run scales (and so trains) as the uninterrupted one.
#[test]
fn resumed_run_with_fp8_delayed_scaling_matches_uninterrupted_run() {
    if !common::needs_wgpu() {
        return;
    }
    resumed_run_matches_with(model::AttentionKind::Plain, "resume_fp8_delayed", |cfg| {
        cfg.precision = trainer::config::PrecisionKind::Fp8;
        cfg.fp8.compute = trainer::config::Fp8ComputeKind::F32;
        cfg.fp8.scaling = trainer::config::Fp8ScalingKind::Tensor;
        cfg.fp8.amax_history = 3;
    });
    let full =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("resume_fp8_delayed_full");
    let last = full.join("checkpoints").join(checkpoint::file_name(12));
    let (header, _) = checkpoint::read(&last).unwrap();
    let history = header.fp8_amax_history.expect("the amax histories");
    assert_eq!((history.len, history.steps), (3, 12));
    // Four projections a block, each with an input, a weight and an output gradient.
    assert_eq!(history.sites.len(), 12 * tiny_config(12).model.n_layer);
    assert!(history
        .sites
        .iter()
        .all(|(_, amax)| amax.len() == 3 && amax.iter().all(|a| *a > 0.0)));
}

/// A run stopped at step 7, its last checkpoint lost, resumed from step 4, repeats the
/// uninterrupted run: losses, norms, learning rates, evaluations, final weights and moments.
fn resumed_run_matches(attention: model::AttentionKind, tag: &str) {
    resumed_run_matches_with(attention, tag, |_| {});
}

/// [`resumed_run_matches`] with the config changed by `tweak`.
fn resumed_run_matches_with(
    attention: model::AttentionKind,
    tag: &str,
    tweak: impl Fn(&mut trainer::Config),
) {
    let _guard = common::serial();
    let mut cfg = tiny_config(12);
    tweak(&mut cfg);
    cfg.model.attention = attention;
    if attention == model::AttentionKind::Flash {
        cfg.model.kernels = model::KernelsKind::Fused;
    }
    cfg.model.dropout = 0.1; // dropout masks must be reproduced too
    cfg.training.grad_accum = 2;
    cfg.training.checkpoint_interval = 4;
    cfg.training.eval_interval = 6;

    let full = scratch(&format!("{tag}_full"));
    trainer::run(&cfg, &common::selected(), &opts(full.clone(), false)).unwrap();

    let split = scratch(&format!("{tag}_split"));
    let mut first = opts(split.clone(), false);
    first.stop_at = Some(7); // stops with a checkpoint at 7
    trainer::run(&cfg, &common::selected(), &first).unwrap();
    // Simulate a crash after step 7's checkpoint: drop it, so the resume starts from step 4 and
    // metrics.jsonl holds steps the resumed run must replace.
    std::fs::remove_file(split.join("checkpoints").join(checkpoint::file_name(7))).unwrap();
    assert_eq!(read_metrics(&split).len(), 7);
    let s = trainer::run(&cfg, &common::selected(), &opts(split.clone(), true)).unwrap();
    assert_eq!(s.resumed_from, Some(4));

    assert_runs_agree(&full, &split, 12, "resumed");
}

/// The runs in `a` and `b` logged the same `steps` steps (losses, gradient norms, learning rates
/// and evaluations within float rounding) and end with the same weights and AdamW moments.
fn assert_runs_agree(a: &std::path::Path, b: &std::path::Path, steps: u64, what: &str) {
    let (ma, mb) = (read_metrics(a), read_metrics(b));
    assert_eq!(ma.len() as u64, steps);
    assert_eq!(
        mb.len() as u64,
        steps,
        "metrics.jsonl of the {what} run should read as one run"
    );
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x.step, y.step);
        let tol = 1e-5 * x.loss.abs().max(1.0);
        assert!(
            (x.loss - y.loss).abs() <= tol,
            "step {}: loss {} vs {what} {}",
            x.step,
            x.loss,
            y.loss
        );
        assert!(
            (x.grad_norm - y.grad_norm).abs() <= 1e-4 * x.grad_norm.max(1.0),
            "step {} grad norm",
            x.step
        );
        assert_eq!(x.lr, y.lr);
        match (x.val_loss, y.val_loss) {
            (Some(p), Some(q)) => assert!((p - q).abs() <= tol, "step {}: val {p} vs {q}", x.step),
            (None, None) => {}
            other => panic!("step {}: evaluations differ {other:?}", x.step),
        }
    }
    // The final weights and AdamW moments agree too.
    let last = checkpoint::file_name(steps);
    let (ha, va) = checkpoint::read(&a.join("checkpoints").join(&last)).unwrap();
    let (hb, vb) = checkpoint::read(&b.join("checkpoints").join(&last)).unwrap();
    assert_eq!(ha.params, hb.params);
    assert_eq!(ha.optimizer_step, steps);
    assert_eq!(hb.optimizer_step, steps);
    let worst = va
        .iter()
        .zip(&vb)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-5, "weights or moments differ by up to {worst}");
}

/// Reading each step's statistics one step late (the default) and at once give the same run:
/// the same losses, evaluations, checkpoints and final weights, and every step logged once.
#[test]
fn reading_statistics_late_changes_no_result() {
    let _guard = common::serial();
    let mut cfg = tiny_config(11);
    cfg.training.checkpoint_interval = 4;
    cfg.training.keep_checkpoints = 3;
    cfg.training.eval_interval = 5;
    cfg.model.dropout = 0.1;
    assert!(cfg.training.read_back_late, "the default reads late");
    let late = scratch("read_back_late");
    let s = trainer::run(&cfg, &common::selected(), &opts(late.clone(), false)).unwrap();
    // Read at once: the first step, the evaluations (5, 10), checkpoints (4, 8) and the last.
    assert_eq!(s.steps_read_late, 5, "steps 2, 3, 6, 7 and 9 are read late");
    cfg.training.read_back_late = false;
    let at_once = scratch("read_back_at_once");
    let s = trainer::run(&cfg, &common::selected(), &opts(at_once.clone(), false)).unwrap();
    assert_eq!(s.steps_read_late, 0);
    assert_runs_agree(&at_once, &late, 11, "late-read");
    let steps: Vec<u64> = read_metrics(&late).iter().map(|r| r.step).collect();
    assert_eq!(steps, (1..=11).collect::<Vec<_>>());
    for step in [4, 8, 11] {
        let file = late.join("checkpoints").join(checkpoint::file_name(step));
        assert!(file.exists(), "{} missing", file.display());
    }
}

#[test]
fn fresh_run_refuses_a_directory_with_checkpoints() {
    let _guard = common::serial();
    let dir = scratch("refuse_existing");
    let cfg = tiny_config(2);
    trainer::run(&cfg, &common::selected(), &opts(dir.clone(), false)).unwrap();
    let e = format!(
        "{:#}",
        trainer::run(&cfg, &common::selected(), &opts(dir.clone(), false)).unwrap_err()
    );
    assert!(e.contains("--resume"), "{e}");
}

#[test]
fn checkpoints_are_complete_or_refused() {
    let _guard = common::serial();
    let dir = scratch("ckpt_atomic");
    let mut cfg = tiny_config(6);
    cfg.training.checkpoint_interval = 2;
    cfg.training.keep_checkpoints = 2;
    trainer::run(&cfg, &common::selected(), &opts(dir.clone(), false)).unwrap();
    let list = checkpoint::list(&dir).unwrap();
    assert_eq!(
        list.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![4, 6],
        "only the newest two are kept"
    );

    // A temporary file from a save that crashed midway is never taken for a checkpoint.
    let stray = dir
        .join("checkpoints")
        .join(format!(".{}.tmp", checkpoint::file_name(99)));
    std::fs::write(&stray, b"half a checkpoint").unwrap();
    assert_eq!(checkpoint::list(&dir).unwrap().len(), 2);

    let newest = list.last().unwrap().1.clone();
    let good = std::fs::read(&newest).unwrap();
    checkpoint::read(&newest).unwrap();

    // One flipped byte in the payload: refused, with the reason.
    let mut bad = good.clone();
    let i = bad.len() / 2;
    bad[i] ^= 0x40;
    std::fs::write(&newest, &bad).unwrap();
    let e = format!("{:#}", checkpoint::read(&newest).unwrap_err());
    assert!(e.contains("damaged") && e.contains("checksum"), "{e}");
    let e = format!(
        "{:#}",
        trainer::run(&cfg, &common::selected(), &opts(dir.clone(), true)).unwrap_err()
    );
    assert!(e.contains("damaged"), "{e}");

    // Truncated: refused.
    std::fs::write(&newest, &good[..good.len() / 3]).unwrap();
    assert!(format!("{:#}", checkpoint::read(&newest).unwrap_err()).contains("damaged"));

    // With the newest damaged, the error names the older complete checkpoint to fall back on.
    assert!(e.contains(&checkpoint::file_name(4)), "{e}");

    // Intact again, but for a different model: refused, naming what differs.
    std::fs::write(&newest, &good).unwrap();
    let saved_config = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    let mut other = cfg.clone();
    other.model.d_model = 48;
    other.training.steps = 8;
    let e = format!(
        "{:#}",
        trainer::run(&other, &common::selected(), &opts(dir.clone(), true)).unwrap_err()
    );
    assert!(e.contains("does not fit") && e.contains("d_model"), "{e}");
    // Another seed or batch size would read other batches: refused too.
    let mut other = cfg.clone();
    other.seed += 1;
    other.training.batch_size = 4;
    let e = format!(
        "{:#}",
        trainer::run(&other, &common::selected(), &opts(dir.clone(), true)).unwrap_err()
    );
    assert!(
        e.contains("seed") && e.contains("training.batch_size"),
        "{e}"
    );
    // A checkpoint of a run on 2 GPUs continues on one only with the same sequences per
    // micro-batch (each GPU read its own rows of them): twice the batch size here.
    let (_, newest) = checkpoint::list(&dir).unwrap().pop().unwrap();
    let (mut header, _) = checkpoint::read(&newest).unwrap();
    assert_eq!(header.devices, 1);
    header.devices = 2;
    let e = trainer::resume::check_continues(&header, &cfg, 1).unwrap_err();
    assert!(
        e.contains("trained with 2 GPUs x training.batch_size")
            && e.contains(&format!(
                "this run: 1 GPU x {0} = {0}",
                cfg.training.batch_size
            )),
        "{e}"
    );
    header.batch_size = cfg.training.batch_size / 2;
    assert_eq!(header.batch_size * 2, cfg.training.batch_size);
    trainer::resume::check_continues(&header, &cfg, 1).unwrap();
    let mut four = cfg.clone();
    four.training.batch_size = cfg.training.batch_size / 4;
    trainer::resume::check_continues(&header, &four, 4).unwrap();
    let e = trainer::resume::check_continues(&header, &four, 2).unwrap_err();
    assert!(e.contains("this run: 2 GPUs"), "{e}");
    // A refused resume leaves the run's config.toml as it was.
    assert_eq!(
        std::fs::read_to_string(dir.join("config.toml")).unwrap(),
        saved_config
    );

    // And the intact checkpoint resumes: two more steps.
    let mut more = cfg.clone();
    more.training.steps = 8;
    let s = trainer::run(&more, &common::selected(), &opts(dir.clone(), true)).unwrap();
    assert_eq!(s.resumed_from, Some(6));
    assert_eq!(read_metrics(&dir).len(), 8);
    assert!(!stray.exists(), "the next save removes stray temporaries");
}

type CkptB = trainer::CpuBackend;
type CkptInner = burn::backend::NdArray;

/// A model and optimizer state to checkpoint: a tiny model of 40 tokens, AdamW at step 7 with
/// moments for every other parameter (one without them checks `has_moments` per shard).
fn state_to_checkpoint(
    cfg: &trainer::config::Config,
) -> (model::Gpt<CkptB>, trainer::optim::AdamW<CkptInner>) {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    let device = burn::backend::ndarray::NdArrayDevice::Cpu;
    let model = model::Gpt::<CkptB>::new(&cfg.model, 40, &device);
    let mut opt = trainer::optim::AdamW::<CkptInner>::new(
        cfg.optimizer.clone(),
        std::collections::HashSet::new(),
    );
    opt.step = 7;
    struct Fill<'a>(&'a mut trainer::optim::AdamW<CkptInner>, usize);
    impl ModuleVisitor<CkptB> for Fill<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<CkptB, D>>) {
            self.1 += 1;
            if self.1.is_multiple_of(2) {
                let x = p.val().inner();
                let m = x.clone().mul_scalar(0.5).into_primitive().tensor();
                let v = x.powf_scalar(2.0).into_primitive().tensor();
                self.0
                    .moments
                    .insert(p.id, trainer::optim::Moments { m, v });
            }
        }
    }
    model.visit(&mut Fill(&mut opt, 0));
    (model, opt)
}

/// Calls `f` with [`state_to_checkpoint`]'s model and optimizer state and what a checkpoint of
/// step 5 of a run of 3 GPUs records besides them.
/// Every parameter's values, flat, by parameter.
fn values_by_id(
    model: &model::Gpt<CkptB>,
) -> std::collections::HashMap<burn::module::ParamId, Vec<f32>> {
    use burn::module::{Module, ModuleVisitor, Param, ParamId};
    struct Get(std::collections::HashMap<ParamId, Vec<f32>>);
    impl ModuleVisitor<CkptB> for Get {
        fn visit_float<const D: usize>(&mut self, p: &Param<burn::tensor::Tensor<CkptB, D>>) {
            let v = p.val().into_data().convert::<f32>().into_vec().unwrap();
            self.0.insert(p.id, v);
        }
    }
    let mut get = Get(Default::default());
    model.visit(&mut get);
    get.0
}

/// Every parameter's AdamW moments, flat, by parameter.
fn moments_by_id(
    opt: &trainer::optim::AdamW<CkptInner>,
) -> std::collections::HashMap<burn::module::ParamId, (Vec<f32>, Vec<f32>)> {
    let flat = |t: &burn::tensor::ops::FloatTensor<CkptInner>| {
        let t = burn::tensor::Tensor::<CkptInner, 1>::from_primitive(
            burn::tensor::TensorPrimitive::Float(t.clone()),
        );
        t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
    };
    opt.moments
        .iter()
        .map(|(id, m)| (*id, (flat(&m.m), flat(&m.v))))
        .collect()
}

fn with_state_to_checkpoint(
    f: impl FnOnce(&model::Gpt<CkptB>, &trainer::optim::AdamW<CkptInner>, &checkpoint::SaveInfo<'_>),
) {
    let cfg = tiny_config(1);
    let (model, opt) = state_to_checkpoint(&cfg);
    let recipe = cfg.recipe().unwrap();
    let scaler = trainer::precision::LossScaler::new(recipe.loss_scaling().clone());
    let info = checkpoint::SaveInfo {
        cfg: &cfg,
        vocab_size: 40,
        step: 5,
        best_val_loss: Some(1.5),
        elapsed_s: 3.0,
        precision: (&recipe, &scaler.state),
        replica_checksums: &[9, 9, 9],
        world: 3,
        fp8_amax_history: None,
    };
    f(&model, &opt, &info);
}

/// A sharded checkpoint (each of 3 ranks' share of the parameters, then rank 0's manifest) reads
/// as the whole checkpoint of the same state and consolidates into a file that reads the same; it
/// is listed only once sealed; a missing, damaged or misplaced shard is refused, naming the file.
#[test]
fn a_sharded_checkpoint_reads_as_the_whole_one() {
    use checkpoint::shards;
    use std::collections::HashSet;
    type B = CkptB;

    with_state_to_checkpoint(|model, opt, info| {
        let (step, world) = (info.step, info.world);
        let whole_dir = scratch("ckpt_whole");
        let whole = checkpoint::save::<B, _>(&whole_dir, model, opt, info, 10).unwrap();
        let (hw, vw) = checkpoint::read(&whole).unwrap();

        let dir = scratch("ckpt_sharded");
        let params = trainer::parallel::zero::parameters(model);
        let sizes: Vec<usize> = params.iter().map(|p| p.1).collect();
        let owners = trainer::parallel::zero::partition(&sizes, world);
        let owned = |rank: usize| -> HashSet<_> {
            params
                .iter()
                .zip(&owners)
                .filter(|(_, o)| **o == rank)
                .map(|(p, _)| p.0)
                .collect()
        };
        for rank in 0..2 {
            shards::save_shard::<B, _>(&dir, model, opt, info, &owned(rank), None, rank).unwrap();
        }
        // Not complete: neither listed nor read, and rank 0 refuses to seal it.
        assert!(checkpoint::list(&dir).unwrap().is_empty());
        let sharded = checkpoint::dir(&dir).join(shards::dir_name(step));
        let e = format!("{:#}", checkpoint::read(&sharded).unwrap_err());
        assert!(e.contains("unfinished"), "{e}");
        let e = format!(
            "{:#}",
            shards::seal::<B, _>(&dir, model, step, world, 10).unwrap_err()
        );
        assert!(
            e.contains("rank_00002.ckpt") && e.contains("missing"),
            "{e}"
        );
        shards::save_shard::<B, _>(&dir, model, opt, info, &owned(2), None, 2).unwrap();
        shards::seal::<B, _>(&dir, model, step, world, 10).unwrap();
        assert_eq!(
            checkpoint::list(&dir).unwrap(),
            vec![(step, sharded.clone())]
        );

        let (hs, vs) = checkpoint::read(&sharded).unwrap();
        assert_eq!(hs.params, hw.params);
        assert_eq!(vs, vw);
        assert_eq!(
            (hs.step, hs.optimizer_step, hs.devices, hs.shard),
            (step, 7, world, None)
        );
        assert!(
            hs.params.iter().any(|p| p.has_moments) && hs.params.iter().any(|p| !p.has_moments)
        );
        let out = checkpoint::dir(&dir).join("consolidated.ckpt");
        shards::consolidate(&sharded, &out).unwrap();
        let (hc, vc) = checkpoint::read(&out).unwrap();
        assert_eq!((hc.params, vc), (hw.params, vw));

        // Pruning keeps the newest `keep` steps, each in every form it has: step 5 as a file and as
        // shards goes once steps 6 and 7 are saved with keep = 2.
        std::fs::copy(
            &out,
            checkpoint::dir(&dir).join(checkpoint::file_name(step)),
        )
        .unwrap();
        for later in [step + 1, step + 2] {
            let info = checkpoint::SaveInfo {
                step: later,
                ..*info
            };
            for rank in 0..world {
                shards::save_shard::<B, _>(&dir, model, opt, &info, &owned(rank), None, rank)
                    .unwrap();
            }
            shards::seal::<B, _>(&dir, model, later, world, 2).unwrap();
        }
        let kept: Vec<u64> = checkpoint::list(&dir)
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(kept, vec![step + 1, step + 2]);
        assert!(
            !sharded.exists()
                && !checkpoint::dir(&dir)
                    .join(checkpoint::file_name(step))
                    .exists()
        );
        let sharded = checkpoint::dir(&dir).join(shards::dir_name(step + 2));

        // A damaged shard, and a shard in another rank's place, are refused by name.
        let shard1 = sharded.join("rank_00001.ckpt");
        let good = std::fs::read(&shard1).unwrap();
        let mut bad = good.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0xff;
        std::fs::write(&shard1, &bad).unwrap();
        let e = format!("{:#}", checkpoint::read(&sharded).unwrap_err());
        assert!(
            e.contains("rank_00001.ckpt") && e.contains("damaged"),
            "{e}"
        );
        std::fs::copy(sharded.join("rank_00000.ckpt"), &shard1).unwrap();
        let e = format!("{:#}", checkpoint::read(&sharded).unwrap_err());
        assert!(
            e.contains("rank_00001.ckpt") && e.contains("not rank 1's shard"),
            "{e}"
        );
    });
}

/// ZeRO-3's sharded checkpoint (each of 3 ranks' rows of every parameter and of its moments; 40
/// vocabulary rows and 32 model rows leave padding rows) reads as the whole checkpoint of the same
/// state: the rows are put back together. And the whole checkpoint read into a model already cut
/// to a rank's rows (as a ZeRO-3 run resumes) gives that rank its rows, moments included, as
/// cutting the whole state does.
#[test]
fn row_shards_read_as_the_whole_checkpoint() {
    use checkpoint::shards;
    use std::collections::HashSet;
    type B = CkptB;

    with_state_to_checkpoint(|model, opt, info| {
        let (step, world) = (info.step, info.world);
        let whole_dir = scratch("ckpt_rows_whole");
        let whole = checkpoint::save::<B, _>(&whole_dir, model, opt, info, 10).unwrap();
        let (hw, vw) = checkpoint::read(&whole).unwrap();
        let rows_dir = scratch("ckpt_rows");
        let every: HashSet<_> = trainer::parallel::zero::parameters(model)
            .iter()
            .map(|p| p.0)
            .collect();
        for rank in 0..world {
            let rows = trainer::parallel::fsdp::RowShards::new(model, rank, world);
            let mut mine = opt.clone();
            let shard = rows.take_share::<B, _>(model.clone(), &mut mine);
            let ranges = rows.ranges();
            shards::save_shard::<B, _>(&rows_dir, &shard, &mine, info, &every, Some(&ranges), rank)
                .unwrap();

            let (h, v) = checkpoint::read(&whole).unwrap();
            let mut read = opt.clone();
            read.moments.clear();
            let into = (rows.shard(model.clone()), Some(&ranges));
            let (got, _) = checkpoint::apply::<B, _>(
                &whole,
                h,
                v,
                into,
                &mut read,
                &info.cfg.model,
                info.vocab_size,
            )
            .unwrap();
            assert_eq!(
                values_by_id(&got),
                values_by_id(&shard),
                "rank {rank}: the rows read"
            );
            assert_eq!(
                moments_by_id(&read),
                moments_by_id(&mine),
                "rank {rank}: the moments' rows read"
            );
        }
        // Over 12 ranks, the last ranks' rows of 32-row parameters lie past their end: they read
        // as padding only.
        let rows = trainer::parallel::fsdp::RowShards::new(model, 11, 12);
        let (h, v) = checkpoint::read(&whole).unwrap();
        let mut read = opt.clone();
        let into = (rows.shard(model.clone()), Some(&rows.ranges()));
        let vocab = info.vocab_size;
        checkpoint::apply::<B, _>(&whole, h, v, into, &mut read, &info.cfg.model, vocab).unwrap();
        shards::seal::<B, _>(&rows_dir, model, step, world, 10).unwrap();
        let (hr, vr) =
            checkpoint::read(&checkpoint::dir(&rows_dir).join(shards::dir_name(step))).unwrap();
        assert_eq!((hr.params, vr), (hw.params, vw));
    });
}
