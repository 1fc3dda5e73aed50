//! The same end-to-end checks on CUDA. Run on a GPU machine with `cargo test -- --include-ignored`.

mod common;

use burn::backend::cuda::CudaDevice;
use burn::backend::Cuda;
use burn::tensor::{Int, Tensor, TensorData};
use common::{opts, read_metrics, scratch, tiny_config};
use model::{Gpt, GptConfig};
use trainer::config::DeviceKind;
use trainer::device::Selected;

fn cuda() -> Selected {
    Selected::Cuda { index: 0, name: "test".into() }
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_causality_at_awkward_lengths() {
    let dev = CudaDevice::new(0);
    let cfg = GptConfig { n_layer: 2, n_head: 3, d_model: 48, context: 130, ..GptConfig::default() };
    let gpt = Gpt::<Cuda>::new(&cfg, 71, &dev);
    let mut r = trainer::rng::SplitMix64::new(9);
    for t in [1usize, 7, 123] {
        let ids: Vec<i64> = (0..2 * t).map(|_| r.below(71) as i64).collect();
        let mut changed = ids.clone();
        changed[2 * t - 1] = (changed[2 * t - 1] + 1) % 71; // last token of the second row
        let run = |v: Vec<i64>| -> Vec<f32> {
            let x = Tensor::<Cuda, 2, Int>::from_data(TensorData::new(v, [2, t]), &dev);
            gpt.forward(x).into_data().into_vec().unwrap()
        };
        let (a, c) = (run(ids), run(changed));
        assert_eq!(a.len(), 2 * t * 71);
        assert!(a.iter().all(|x| x.is_finite()));
        // Row 0 and the first t-1 positions of row 1 are unchanged; the last position changes.
        let cut = (2 * t - 1) * 71;
        let before = a[..cut].iter().zip(&c[..cut]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let at = a[cut..].iter().zip(&c[cut..]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(before < 1e-5, "T={t}: earlier logits moved by {before}");
        assert!(at > 1e-4, "T={t}: the changed position's logits did not move");
    }
}

#[test]
#[ignore = "needs CUDA"]
fn cuda_training_loss_decreases_and_resume_matches() {
    let _guard = common::serial();
    let mut cfg = tiny_config(40);
    cfg.device = DeviceKind::Cuda;
    cfg.model.dropout = 0.1;
    cfg.training.checkpoint_interval = 10;
    cfg.training.eval_interval = 20;

    let full = scratch("cuda_full");
    trainer::run(&cfg, &cuda(), &opts(full.clone(), false)).unwrap();
    let a = read_metrics(&full);
    let first: f64 = a[..5].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    let last: f64 = a[35..].iter().map(|r| r.loss).sum::<f64>() / 5.0;
    assert!(last < first - 0.8, "loss went from {first} to {last}");

    let split = scratch("cuda_split");
    let mut o = opts(split.clone(), false);
    o.stop_at = Some(20);
    trainer::run(&cfg, &cuda(), &o).unwrap();
    let s = trainer::run(&cfg, &cuda(), &opts(split.clone(), true)).unwrap();
    assert_eq!(s.resumed_from, Some(20));
    let b = read_metrics(&split);
    assert_eq!(b.len(), 40);
    for (x, y) in a.iter().zip(&b) {
        let tol = 1e-4 * x.loss.abs().max(1.0);
        assert!((x.loss - y.loss).abs() <= tol, "step {}: {} vs resumed {}", x.step, x.loss, y.loss);
    }
}
