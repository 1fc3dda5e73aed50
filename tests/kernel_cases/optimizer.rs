//! Cases of the optimizer side's kernels: the AdamW step, the f32 sums of two tensors, the scaled
//! cast, and the sums (of squares) of many tensors.
#![allow(dead_code)]

use super::*;

/// The factor the AdamW cases scale the gradient by.
const FACTOR: f32 = 0.5;

/// The fused AdamW step against the reference arithmetic (f32 master weights; gradient in f32
/// and in `dtype`; compute copy in `dtype`).
pub fn adamw<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    for n in [1usize, 7, 123, 4096 + 3] {
        let r = |s: f64| randn::<B>([3, n], dev).inner().mul_scalar(s);
        let (p, g, m) = (r(1.0), r(1e-2), r(1e-3));
        let v = r(1e-3).powi_scalar(2);
        let factor = Tensor::<I<B>, 1>::from_floats([FACTOR], dev);
        for (wd, t) in [(0.0, 1u64), (0.1, 17)] {
            let hp = kernels::AdamWStep {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
                t,
            };
            for g in [g.clone(), g.clone().cast(dtype)] {
                let k = kernels::adamw_step(
                    p.clone(),
                    g.clone(),
                    m.clone(),
                    v.clone(),
                    factor.clone(),
                    &hp,
                    Some(dtype),
                );
                let e = kernels::adamw::reference(
                    p.clone(),
                    g.clone(),
                    m.clone(),
                    v.clone(),
                    factor.clone(),
                    &hp,
                    Some(dtype),
                );
                // Relative to the largest magnitude each result is summed from: the new moment
                // `beta1 m + (1 - beta1) g factor` may cancel to far below its two terms, whose
                // roundings bound its error (the parameter and the second moment do not cancel).
                let g_max = max_abs::<B>(g.clone().cast(FloatDType::F32)) * FACTOR;
                let m_terms =
                    hp.beta1 as f32 * max_abs::<B>(m.clone()) + (1.0 - hp.beta1 as f32) * g_max;
                for (what, a, b, terms) in [
                    ("param", k.param, e.param, 0.0),
                    ("m", k.m, e.m, m_terms),
                    ("v", k.v, e.v, 0.0),
                ] {
                    let scale = max_abs::<B>(b.clone()).max(terms).max(1e-12);
                    let err = max_abs::<B>(a - b);
                    assert!(
                        err <= 1e-6 * scale,
                        "adamw [3, {n}] {what}: error {err:e} (scale {scale:e})"
                    );
                }
                let (kc, ec) = (
                    k.copy.expect("copy asked for"),
                    e.copy.expect("copy asked for"),
                );
                assert_eq!(kc.dtype(), dtype.into(), "adamw copy dtype");
                let err = max_abs::<B>(kc.cast(FloatDType::F32) - ec.cast(FloatDType::F32));
                // Each copy is its f32 weight rounded once, and the two f32 weights differ only in
                // their last bits, so the copies are at most a rounding step or two apart: allow 4
                // ulps of `dtype` at magnitude 1 (the weights here are below 2).
                let ulp = match dtype {
                    FloatDType::BF16 => 1.0 / 128.0,
                    FloatDType::F16 => 1.0 / 1024.0,
                    _ => 1e-6,
                };
                assert!(err <= ulp * 4.0, "adamw [3, {n}] copy: error {err:e}");
            }
        }
    }
}

/// Random inputs for the element-wise kernels: dense shapes of odd lengths (rows of odd bytes are
/// pitched on CUDA), a transposed view and a column slice. The empty case is [`no_rows`].
fn elementwise_layouts<B: AutodiffBackend>(
    dev: &B::Device,
) -> Vec<(&'static str, Tensor<B::InnerBackend, 2>)> {
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner();
    vec![
        ("[1, 1]", r([1, 1])),
        ("[3, 7]", r([3, 7])),
        ("[5, 123]", r([5, 123])),
        ("[3, 4099]", r([3, 4099])),
        ("[64, 768]", r([64, 768])),
        ("[33, 65]^T", r([33, 65]).transpose()),
        ("[10, 100][.., 3..60]", r([10, 100]).slice([0..10, 3..60])),
    ]
}

/// A `[0, 5]` tensor in `dtype`: a view of no rows of a random one. On CUDA its rows are pitched,
/// so its strides are not row-major and the kernels' dense copy of it must launch nothing: CUDA
/// refuses a launch of no cubes (also why this is not a new empty tensor, or a cast of one).
fn no_rows<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device) -> Tensor<B::InnerBackend, 2> {
    randn::<B>([3, 5], dev)
        .inner()
        .cast(dtype)
        .slice([0..0, 0..5])
}

/// Every pairing of f32 and `dtype` with at least one `dtype` (input and output, or two inputs).
fn dtype_pairs(dtype: FloatDType) -> [(FloatDType, FloatDType); 3] {
    [
        (dtype, dtype),
        (FloatDType::F32, dtype),
        (dtype, FloatDType::F32),
    ]
}

/// `kernels::add_as_f32` (gradient accumulation) against the host's f32 sum of the same values:
/// every pairing of f32 and `dtype` inputs, dense shapes of odd lengths (rows of odd bytes are
/// pitched on CUDA), a transposed view, a column slice, a rank-3 tensor and an empty one. Both
/// inputs are exact in f32, so the one f32 addition must match exactly.
pub fn add_as_f32<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let host = |t: Tensor<I<B>, 2>| -> Vec<f32> {
        t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
    };
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner();
    for (what, a) in elementwise_layouts::<B>(dev) {
        let b = r(a.dims());
        for (da, db) in dtype_pairs(dtype) {
            let (a, b) = (a.clone().cast(da), b.clone().cast(db));
            let want: Vec<f32> = host(a.clone())
                .iter()
                .zip(host(b.clone()))
                .map(|(x, y)| x + y)
                .collect();
            let got = kernels::add_as_f32(a, b);
            assert_eq!(
                got.dtype(),
                burn::tensor::DType::F32,
                "add_as_f32 {what}: output dtype"
            );
            assert_eq!(
                host(got),
                want,
                "add_as_f32 {what} ({da:?} + {db:?}) differs from the host's f32 sum"
            );
        }
    }
    // Rank 3: the kernel reads any rank as flat rows.
    let a = r([6, 35]).reshape([2, 3, 35]).cast(dtype);
    let b = r([6, 35]).reshape([2, 3, 35]);
    let want: Vec<f32> = host(a.clone().reshape([6, 35]))
        .iter()
        .zip(host(b.clone().reshape([6, 35])))
        .map(|(x, y)| x + y)
        .collect();
    let got = kernels::add_as_f32(a, b).reshape([6, 35]);
    assert_eq!(host(got), want, "add_as_f32 [2, 3, 35] ({dtype:?} + F32)");
    for (da, db) in dtype_pairs(dtype) {
        let got = kernels::add_as_f32(no_rows::<B>(da, dev), no_rows::<B>(db, dev));
        assert_eq!(
            (got.dims(), got.dtype()),
            ([0, 5], burn::tensor::DType::F32),
            "add_as_f32 of no elements ({da:?} + {db:?})"
        );
    }
}

/// `kernels::scale` (a gradient scaled by a device scalar and cast in one pass) against its
/// plain-Burn reference, which rounds the same f32 product once: equal bits, for every pairing of
/// f32 and `dtype` in and out, dense shapes of odd lengths (pitched rows on CUDA), a transposed
/// view, a column slice and an empty tensor.
pub fn scale<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let host = |t: Tensor<I<B>, 2>| -> Vec<f32> {
        t.cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap()
    };
    let cases = elementwise_layouts::<B>(dev);
    for factor in [0.37f32, -3.0e-4] {
        let f = Tensor::<I<B>, 1>::from_floats([factor], dev);
        for (what, x) in &cases {
            for (din, dout) in dtype_pairs(dtype) {
                let x = x.clone().cast(din);
                let got = kernels::scale(x.clone(), f.clone(), dout);
                let want = kernels::reduce::scale_reference(x, f.clone(), dout);
                assert_eq!(got.dtype(), dout.into(), "scale {what}: output dtype");
                assert_eq!(
                    host(got),
                    host(want),
                    "scale {what} by {factor} ({din:?} -> {dout:?}) differs from the reference"
                );
            }
        }
        for (din, dout) in dtype_pairs(dtype) {
            let got = kernels::scale(no_rows::<B>(din, dev), f.clone(), dout);
            assert_eq!(
                (got.dims(), got.dtype()),
                ([0, 5], dout.into()),
                "scale of no elements ({din:?} -> {dout:?})"
            );
        }
    }
}

/// `kernels::sum_f32` against the host's f64 sum of the same values (rounded to `dtype` first):
/// several tensors at once (dense, transposed, a column slice, rank 1, odd lengths), one alone,
/// and none; the kernel adds in f32 in another order, so it may differ by f32 rounding: at most
/// 1e-5 of the sum of magnitudes. The same tensors give the same bits twice.
pub fn sum_f32<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner().cast(dtype);
    let values = |t: &Tensor<I<B>, 2>| -> Vec<f32> {
        t.clone()
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let wide = r([10, 100]);
    let tensors: Vec<Tensor<I<B>, 2>> = vec![
        r([1, 1]),
        r([7, 13]),
        r([33, 65]).transpose(),
        wide.slice([0..10, 3..60]),
        r([65, 1000]),
        r([1, 16384]),
    ];
    let check = |what: &str, ts: &[Tensor<I<B>, 2>]| {
        let (mut want, mut mag) = (0f64, 0f64);
        for t in ts {
            for v in values(t) {
                want += v as f64;
                mag += (v as f64).abs();
            }
        }
        let got = kernels::sum_f32(ts.to_vec(), dev);
        let again = kernels::sum_f32(ts.to_vec(), dev);
        let got = got.into_data().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), 1, "sum_f32 {what}: one element");
        let err = (got[0] as f64 - want).abs();
        assert!(
            err <= 1e-5 * mag.max(1e-30),
            "sum_f32 {what} ({dtype:?}): {} against {want} (error {err:e}, magnitudes {mag:e})",
            got[0]
        );
        assert_eq!(
            again.into_data().to_vec::<f32>().unwrap(),
            got,
            "sum_f32 {what} ({dtype:?}): two sums of the same tensors"
        );
    };
    check("all together", &tensors);
    check("[1, 16384]", &tensors[5..]);
    check("[33, 65]^T", &tensors[2..3]);
    let none: Vec<Tensor<I<B>, 2>> = Vec::new();
    assert_eq!(
        kernels::sum_f32(none, dev)
            .into_data()
            .to_vec::<f32>()
            .unwrap(),
        vec![0.0],
        "sum_f32 of nothing"
    );
}

/// `kernels::SumSquares` against the sum of squares in f64 of the same values (already rounded to
/// `dtype`): one tensor at a time and all together, over dense tensors of odd lengths, a
/// transposed view, a column slice, a permuted rank-3 tensor (copied first), rows of 4000 bytes
/// in f32 (pitched on CUDA), a strided vector, and an empty sum; the same sum twice gives the same
/// bits. The kernel sums in f32 in another order than the host, so it may differ by f32 rounding
/// of the total: at most 1e-5 of it.
pub fn sum_squares<B: AutodiffBackend>(dtype: FloatDType, dev: &B::Device)
where
    B::InnerBackend: kernels::Backend,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    let r = |shape: [usize; 2]| randn::<B>(shape, dev).inner().cast(dtype);
    let host = |values: Vec<f32>| -> f64 { values.iter().map(|&v| (v as f64).powi(2)).sum() };
    let host2 = |t: &Tensor<I<B>, 2>| {
        host(
            t.clone()
                .cast(FloatDType::F32)
                .into_data()
                .to_vec::<f32>()
                .unwrap(),
        )
    };
    let wide = r([10, 100]);
    let cube = randn::<B>([15, 7], dev)
        .inner()
        .cast(dtype)
        .reshape([3, 5, 7])
        .permute([2, 0, 1]);
    let cube_sq = host(
        cube.clone()
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap(),
    );
    let vec = r([1, 4099]).reshape([4099]);
    let vec_sq = host2(&vec.clone().reshape([1, 4099]));
    let strided = r([64, 3]).slice([0..64, 1..2]).reshape([64]);
    let strided_sq = host2(&strided.clone().reshape([64, 1]));
    let matrices: Vec<(&str, Tensor<I<B>, 2>)> = vec![
        ("[1, 1]", r([1, 1])),
        ("[7, 13]", r([7, 13])),
        ("[33, 65]^T", r([33, 65]).transpose()),
        ("[10, 100][.., 3..60]", wide.slice([0..10, 3..60])),
        ("[65, 1000]", r([65, 1000])),
    ];
    let check = |what: &str, got: Tensor<I<B>, 1>, want: f64| {
        let got = got.into_data().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), 1, "{what}: one element");
        let err = (got[0] as f64 - want).abs();
        assert!(
            err <= 1e-5 * want.max(1e-30),
            "sum_squares {what} ({dtype:?}): {} against {want} (error {err:e})",
            got[0]
        );
    };
    let mut all = kernels::SumSquares::<I<B>>::new(dev);
    let mut total = 0.0;
    for (what, m) in matrices {
        let want = host2(&m);
        let mut one = kernels::SumSquares::<I<B>>::new(dev);
        one.add(m.clone());
        check(what, one.finish(), want);
        all.add(m);
        total += want;
    }
    for (what, t, want) in [
        ("[4099]", vec, vec_sq),
        ("[64, 3][.., 1]", strided, strided_sq),
    ] {
        let mut one = kernels::SumSquares::<I<B>>::new(dev);
        one.add(t.clone());
        check(what, one.finish(), want);
        all.add(t);
        total += want;
    }
    let mut one = kernels::SumSquares::<I<B>>::new(dev);
    one.add(cube.clone());
    check("[3, 5, 7] permuted", one.finish(), cube_sq);
    all.add(cube);
    total += cube_sq;
    check("all together", all.finish(), total);
    // The partial sums are added in a fixed order: the same tensors give the same bits.
    let many: Vec<Tensor<I<B>, 2>> = (0..6).map(|i| r([40 + i, 3000])).collect();
    let sum_of = || {
        let mut s = kernels::SumSquares::<I<B>>::new(dev);
        for t in &many {
            s.add(t.clone());
        }
        s.finish().into_data().to_vec::<f32>().unwrap()
    };
    assert_eq!(
        sum_of(),
        sum_of(),
        "sum_squares ({dtype:?}): two sums of the same tensors"
    );
    let empty = kernels::SumSquares::<I<B>>::new(dev).finish();
    assert_eq!(
        empty.into_data().to_vec::<f32>().unwrap(),
        vec![0.0],
        "an empty sum"
    );
}
