//! Cases of the format statistics and the gradient probe.
#![allow(dead_code)]

use super::*;

/// `kernels::format_stats` against counts made on the host from the same values (already rounded
/// to `dtype`), and against its plain-Burn reference: magnitudes spread over six decades with
/// zeros, infinities and NaNs planted, over dense tensors of odd lengths, a transposed view, a
/// column slice, a permuted rank-3 tensor, rows of 4000 bytes in f32 (pitched on CUDA), a strided
/// vector, one large enough for hundreds of cubes, and an empty tensor. Maxima and counts are
/// exact, so they must match exactly. The smallest magnitude (6.3e-5) is a normal number in every
/// dtype, so no platform's handling of subnormals enters.
pub fn format_stats<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let spread = |shape: [usize; 2]| -> Tensor<I<B>, 2> {
        let n = randn::<B>(shape, dev).inner();
        let e = Tensor::<I<B>, 2>::random(shape, Distribution::Uniform(-4.2, 1.5), dev);
        let mut v = (n.sign() * e.mul_scalar(std::f64::consts::LN_10).exp())
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let len = v.len();
        for (k, special) in [0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 0.0]
            .into_iter()
            .enumerate()
        {
            if k * 7 < len {
                v[(k * 7919 + 3) % len] = special;
            }
        }
        Tensor::<I<B>, 2>::from_data(TensorData::new(v, shape), dev).cast(dtype)
    };
    let host = |values: Vec<f32>, min_normal: f32| -> kernels::FormatStats {
        let mut s = kernels::FormatStats {
            amax: 0.0,
            below_normal: 0,
            nonzero: 0,
            not_finite: 0,
            elements: values.len() as u64,
        };
        for v in values {
            if !v.is_finite() {
                s.not_finite += 1;
            } else if v != 0.0 {
                s.nonzero += 1;
                s.amax = s.amax.max(v.abs() as f64);
                if v.abs() < min_normal {
                    s.below_normal += 1;
                }
            }
        }
        s
    };
    let values = |t: Tensor<I<B>, 2>| t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap();
    let rows = |t: Tensor<I<B>, 2>| t.into_data().to_vec::<f32>().unwrap();
    let cube = spread([15, 7]).reshape([3, 5, 7]).permute([2, 0, 1]);
    let cube_values = values(cube.clone().reshape([7, 15]));
    let wide = spread([10, 100]);
    let strided = spread([64, 3]).slice([0..64, 1..2]);
    let cases: Vec<(&str, Tensor<I<B>, 2>)> = vec![
        ("[1, 1]", spread([1, 1])),
        ("[7, 13]", spread([7, 13])),
        ("[33, 65]^T", spread([33, 65]).transpose()),
        ("[10, 100][.., 3..60]", wide.slice([0..10, 3..60])),
        ("[65, 1000]", spread([65, 1000])),
        ("[300, 4001]", spread([300, 4001])),
    ];
    for min_normal in [1e-3f32, 0.05] {
        let check = |what: &str, got: kernels::FormatStats, want: kernels::FormatStats| {
            assert_eq!(
                got, want,
                "format_stats {what} ({dtype:?}, min_normal {min_normal}): kernel against host"
            );
        };
        for (what, t) in &cases {
            let want = host(values(t.clone()), min_normal);
            let n = t.shape().num_elements();
            let got = kernels::format_stats(t.clone(), min_normal as f64);
            check(what, kernels::FormatStats::from_rows(&rows(got), n), want);
            let reference = kernels::format_stats::reference(t.clone(), min_normal as f64);
            check(
                &format!("{what} (reference)"),
                kernels::FormatStats::from_rows(&rows(reference), n),
                want,
            );
        }
        let want = host(cube_values.clone(), min_normal);
        let got = kernels::format_stats(cube.clone(), min_normal as f64);
        check(
            "[3, 5, 7] permuted",
            kernels::FormatStats::from_rows(&rows(got), 105),
            want,
        );
        let vec = strided.clone().reshape([64]);
        let want = host(values(strided.clone()), min_normal);
        let got = kernels::format_stats(vec, min_normal as f64);
        check(
            "[64, 3][.., 1] as a vector",
            kernels::FormatStats::from_rows(&rows(got), 64),
            want,
        );
    }
    // A view of no rows (a new empty tensor would launch fill and cast kernels of no cubes, which
    // CUDA refuses).
    let empty = spread([3, 5]).slice([0..0, 0..5]);
    let got = kernels::FormatStats::from_rows(&rows(kernels::format_stats(empty, 1e-3)), 0);
    assert_eq!(
        (got.amax, got.nonzero, got.not_finite, got.underflow()),
        (0.0, 0, 0, 0.0),
        "format_stats of an empty tensor ({dtype:?})"
    );
}

/// `kernels::format_probe` under `Autodiff`: the forward is the identity, the gradient reaches the
/// input unchanged, and the backward records the statistics of the gradient that flowed through
/// the probe (here `dy`, planted with an infinity and a zero), equal to `kernels::format_stats` of
/// it, under the probe's name and with its element count.
pub fn format_probe<B: AutodiffBackend + kernels::Backend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    assert!(<B as kernels::FormatStatsOps>::format_probe_records());
    let sink = kernels::probe_sink();
    let probe = kernels::FormatProbe {
        name: "p".to_string(),
        min_normal: 1e-2,
        sink: sink.clone(),
    };
    let x = randn::<B>([33, 65], dev).cast(dtype).require_grad();
    let mut dy = randn::<B>([33, 65], dev)
        .inner()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    dy[5] = f32::INFINITY;
    dy[70] = 0.0;
    dy[71] = 1e-3;
    let dy = Tensor::<I<B>, 2>::from_data(TensorData::new(dy, [33, 65]), dev).cast(dtype);
    let y = kernels::format_probe(x.clone(), &probe);
    let out = y
        .clone()
        .inner()
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let xs = x
        .clone()
        .inner()
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(out, xs, "format_probe forward ({dtype:?}): the identity");
    let grads = (y * Tensor::<B, 2>::from_inner(dy.clone()))
        .sum()
        .backward();
    let dx = x.grad(&grads).unwrap().cast(FloatDType::F32);
    let want = dy.clone().cast(FloatDType::F32);
    let (dx, want) = (
        dx.into_data().to_vec::<f32>().unwrap(),
        want.into_data().to_vec::<f32>().unwrap(),
    );
    assert!(
        dx.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "format_probe ({dtype:?}): the gradient passes unchanged"
    );
    let records = kernels::format_stats::take_records::<I<B>>(&sink);
    assert_eq!(records.len(), 1, "format_probe ({dtype:?}): one record");
    let (name, recorded, elements) = records.into_iter().next().unwrap();
    assert_eq!((name.as_str(), elements), ("p", 33 * 65));
    let rows = |t: Tensor<I<B>, 2>| t.into_data().to_vec::<f32>().unwrap();
    let got = kernels::FormatStats::from_rows(&rows(recorded), elements);
    let want = kernels::FormatStats::from_rows(&rows(kernels::format_stats(dy, 1e-2)), elements);
    assert_eq!(
        got, want,
        "format_probe ({dtype:?}): the gradient's statistics"
    );
    assert_eq!((got.not_finite, got.below_normal > 0), (1, true));
    assert!(
        sink.lock().unwrap().is_empty(),
        "take_records empties the sink"
    );
}
