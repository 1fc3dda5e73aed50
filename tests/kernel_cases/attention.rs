//! Cases of FlashAttention: plain, with dropout, grouped-query, of a packed projection, strided,
//! and its log-sum-exp.
#![allow(dead_code)]

use super::*;

/// FlashAttention output and dQ, dK, dV against the naive formula, full and causal, for every
/// `(batch, heads, seq, head_dim)` in `shapes`, plus a case with fewer queries than keys. Full
/// attention uses a custom scale (0.3), causal the default `1 / sqrt(head_dim)`. The floor is
/// `4e-5 * sqrt(seq_k / 32)` (3.2e-4 at 2048 keys): in f32 the baseline *is* the exact run, and
/// summing seq_k terms in another order (online softmax, blocks), with the cancellation in
/// `dS = P * (dP - delta)`, leaves f32 rounding noise that grows like the square root of the number
/// of terms (seen on CUDA at 2048 keys: 1.2e-4 on a dQ of max 9.4, 2.1e-4 on a dK of max 10.5).
///
/// `exact_by_sums`: compute the f32 runs of the reference with broadcast products and sums instead
/// of matmuls. On CUDA, Burn's f32 matmul runs on TF32 tensor cores (~1e-3 relative error), which
/// is no exact reference for an f32 kernel.
pub fn flash_attention<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
) {
    attention_cases::<B>(
        dtype,
        dev,
        shapes,
        exact_by_sums,
        &[(false, None), (true, None)],
    );
}

/// [`flash_attention`]'s checks for each `(causal, dropout p)` of `variants` (with dropout,
/// [`kernels::flash_attention_dropout`] against the naive formula with the host's mask, a seed per
/// case, and the floor divided by the keep probability).
fn attention_cases<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
    variants: &[(bool, Option<f64>)],
) {
    let mut cases: Vec<Gqa> = shapes
        .iter()
        .map(|&(b, h, s, hd)| (b, h, h, s, s, hd))
        .collect();
    cases.push((1, 2, 2, 17, 40, 64));
    grouped_cases::<B>(dtype, dev, &cases, exact_by_sums, variants);
}

/// An attention case with its own k/v head count: `(batch, heads, kv_heads, seq_q, seq_k,
/// head_dim)`.
pub type Gqa = (usize, usize, usize, usize, usize, usize);

/// Grouped-query attention (`kv_heads` dividing `heads`; k and v not repeated in memory):
/// output and dQ, dK, dV (the sums over each group) against the naive formula on k and v
/// repeated over the group, full (scale 0.3) and causal, without and with dropout (p = 0.2), at
/// every `(batch, heads, kv_heads, seq_q, seq_k, head_dim)` of `cases`.
pub fn flash_attention_gqa<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    cases: &[Gqa],
    exact_by_sums: bool,
) {
    grouped_cases::<B>(
        dtype,
        dev,
        cases,
        exact_by_sums,
        &[
            (false, None),
            (true, None),
            (false, Some(0.2)),
            (true, Some(0.2)),
        ],
    );
}

/// [`attention_cases`] at explicit k/v head counts.
fn grouped_cases<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    cases: &[Gqa],
    exact_by_sums: bool,
    variants: &[(bool, Option<f64>)],
) {
    for (n, &(b, h, hkv, sq, sk, hd)) in cases.iter().enumerate() {
        for &(causal, p) in variants {
            let drop = p.map(|p| {
                let seed = 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(n as u64 * 4 + 1 + causal as u64)
                    ^ (p * 1e3) as u64;
                kernels::Dropout::new(p, seed)
            });
            let (op, tag) = match p {
                Some(p) => ("flash_attention_dropout", format!(" p {p}")),
                None => ("flash_attention", String::new()),
            };
            let started = std::time::Instant::now();
            let scale = if causal { None } else { Some(0.3) };
            let (rq, rk) = (b * h * sq, b * hkv * sk);
            check::<B>(
                &format!(
                    "{op} q [{b}, {h}, {sq}, {hd}] k/v [{b}, {hkv}, {sk}, {hd}] causal {causal}{tag}"
                ),
                dtype,
                4e-5 * (sk as f32 / 32.0).sqrt().max(1.0) / (1.0 - p.unwrap_or(0.0) as f32),
                vec![
                    Input::act([rq, hd], dev),
                    Input::act([rk, hd], dev),
                    Input::act([rk, hd], dev),
                ],
                |v| {
                    let q = v[0].clone().reshape([b, h, sq, hd]);
                    let k = v[1].clone().reshape([b, hkv, sk, hd]);
                    let val = v[2].clone().reshape([b, hkv, sk, hd]);
                    match drop {
                        Some(d) => kernels::flash_attention_dropout(q, k, val, causal, scale, d),
                        None => kernels::flash_attention(q, k, val, causal, scale),
                    }
                    .reshape([rq, hd])
                },
                |v| {
                    let q = v[0].clone().reshape([b, h, sq, hd]);
                    let k = v[1].clone().reshape([b, hkv, sk, hd]);
                    let val = v[2].clone().reshape([b, hkv, sk, hd]);
                    if exact_by_sums && q.dtype() == burn::tensor::DType::F32 {
                        attention_by_sums_dropout(q, k, val, causal, scale, drop).reshape([rq, hd])
                    } else {
                        match drop {
                            Some(d) => {
                                kernels::attention::reference_dropout(q, k, val, causal, scale, d)
                            }
                            None => kernels::attention::reference(q, k, val, causal, scale),
                        }
                        .reshape([rq, hd])
                    }
                },
            );
            eprintln!(
                "{op} [{b}, {h}/{hkv}, {sq}/{sk}, {hd}] causal {causal}{tag} {dtype:?}: {:.1?}",
                started.elapsed()
            );
        }
    }
}

/// FlashAttention with dropout inside the kernels against the naive formula with the host's mask
/// ([`kernels::attention::dropout::keep_mask`]): output and dQ, dK, dV, full and causal, p = 0.2
/// and 0.5, a fresh seed per case, for every `(batch, heads, seq, head_dim)` in `shapes` plus 17
/// queries against 40 keys. A kernel whose mask differed from the host's in one entry in a
/// thousand would fail: a dropped probability changes its row's output by about `p / seq` of the
/// row's scale, far above the floor. Then: one seed gives the same output twice, bit for bit, and
/// another seed another output.
pub fn flash_attention_dropout<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
) {
    use kernels::Dropout;
    attention_cases::<B>(
        dtype,
        dev,
        shapes,
        exact_by_sums,
        &[(false, Some(0.2)), (true, Some(0.2)), (true, Some(0.5))],
    );

    // Same seed, same bits; another seed, another output.
    let (b, h, s, hd) = (1, 2, 40, 64);
    let r = || {
        randn::<B>([b * h * s, hd], dev)
            .reshape([b, h, s, hd])
            .cast(dtype)
    };
    let (q, k, v) = (r(), r(), r());
    let run = |seed: u64| {
        kernels::flash_attention_dropout(
            q.clone(),
            k.clone(),
            v.clone(),
            true,
            None,
            Dropout::new(0.3, seed),
        )
        .cast(FloatDType::F32)
        .into_data()
        .to_vec::<f32>()
        .expect("f32 output")
    };
    let (a, again, other) = (run(11), run(11), run(12));
    assert!(
        a.iter()
            .zip(&again)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "flash_attention_dropout ({dtype:?}): one seed gave two different outputs"
    );
    let differ = a.iter().zip(&other).filter(|(x, y)| x != y).count();
    assert!(
        differ > a.len() / 2,
        "flash_attention_dropout ({dtype:?}): seeds 11 and 12 gave outputs differing in only {differ} of {} values",
        a.len()
    );
}

/// RoPE + FlashAttention of a packed qkv projection ([`kernels::flash_attention_qkv`]) against
/// slicing, [`kernels::rope::reference`] and the naive attention, output and the projection's
/// gradient: full (scale 0.3) and causal, without and with dropout (p = 0.2), at each `(batch,
/// seq, heads, head_dim)` of `shapes`.
pub fn flash_attention_qkv<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize)],
    exact_by_sums: bool,
) {
    let shapes: Vec<_> = shapes
        .iter()
        .map(|&(b, t, h, hd)| (b, t, h, h, hd))
        .collect();
    flash_attention_qkv_gqa::<B>(dtype, dev, &shapes, exact_by_sums);
}

/// [`flash_attention_qkv`] with `kv_heads` key and value heads in the projection (`[batch, seq,
/// (heads + 2 x kv_heads) x head_dim]`), at each `(batch, seq, heads, kv_heads, head_dim)` of
/// `shapes`: the projection's gradient of k and v is the sum over each group.
pub fn flash_attention_qkv_gqa<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize, usize, usize, usize)],
    exact_by_sums: bool,
) {
    for (n, &(b, t, h, hkv, hd)) in shapes.iter().enumerate() {
        let width = (h + 2 * hkv) * hd;
        let (cos, sin) = kernels::rope::tables::<B>(t + 3, hd, 10_000.0, dev);
        for (causal, p) in [(false, None), (true, None), (true, Some(0.2))] {
            let started = std::time::Instant::now();
            let scale = if causal { None } else { Some(0.3) };
            let dropout = p.map(|p| kernels::Dropout::new(p, 0xabc0 + n as u64));
            check::<B>(
                &format!(
                    "flash_attention_qkv [{b}, {t}, ({h} + 2 x {hkv}) x {hd}] causal {causal} dropout {p:?}"
                ),
                dtype,
                4e-5 * (t as f32 / 32.0).sqrt().max(1.0) / (1.0 - p.unwrap_or(0.0) as f32),
                vec![
                    Input::act([b * t, width], dev),
                    Input::constant(cos.clone()),
                    Input::constant(sin.clone()),
                ],
                |v| {
                    // q and k are rotated in the projection's own buffer when nothing else holds
                    // it: in the causal cases a fresh tensor (the product by 1), else the input,
                    // which the check holds, so that it is rotated in a copy.
                    let qkv = if causal {
                        v[0].clone().mul_scalar(1.0)
                    } else {
                        v[0].clone()
                    };
                    let qkv = qkv.reshape([b, t, width]);
                    let (c, s) = (v[1].clone(), v[2].clone());
                    kernels::flash_attention_qkv(qkv, h, hkv, c, s, causal, scale, dropout)
                        .reshape([b * t, h * hd])
                },
                |v| {
                    let qkv = v[0].clone().reshape([b, t, width]);
                    let (c, s) = (v[1].clone(), v[2].clone());
                    if exact_by_sums && qkv.dtype() == burn::tensor::DType::F32 {
                        // [b, t, all heads, hd] -> [b, all heads, t, hd]: q's, then k's, v's.
                        let x = qkv.reshape([b, t, h + 2 * hkv, hd]).swap_dims(1, 2);
                        let part =
                            |from: usize, n: usize| x.clone().slice([0..b, from..from + n, 0..t, 0..hd]);
                        let q = kernels::rope::reference(part(0, h), c.clone(), s.clone());
                        let k = kernels::rope::reference(part(h, hkv), c, s);
                        attention_by_sums_dropout(q, k, part(h + hkv, hkv), causal, scale, dropout)
                            .swap_dims(1, 2)
                            .reshape([b * t, h * hd])
                    } else {
                        kernels::attention::reference_qkv(qkv, h, hkv, c, s, causal, scale, dropout)
                            .reshape([b * t, h * hd])
                    }
                },
            );
            eprintln!(
                "flash_attention_qkv [{b}, {t}, {h}/{hkv}, {hd}] causal {causal} dropout {p:?} {dtype:?}: {:.1?}",
                started.elapsed()
            );
        }
    }
}

/// The naive attention formula with every product as a broadcast multiply and a sum (f32
/// accumulation in Burn's reductions, no matmul).
pub fn attention_by_sums<B: burn::tensor::backend::Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
) -> Tensor<B, 4> {
    attention_by_sums_dropout(q, k, v, causal, scale, None)
}

/// The most elements a broadcast product of [`attention_by_sums_dropout`] holds (1 GiB in f32):
/// far below 2^32, so that Burn's kernels index it with 32-bit offsets (with 64-bit offsets
/// CubeCL 0.10 panics while expanding a broadcast kernel over some dimension lengths, such as
/// 2100: its fast division's multiplier does not fit an i64), and small beside the GPU's memory
/// when the CUDA suite runs many tests at once.
const MAX_PRODUCT_ELEMENTS: usize = 1 << 28;

/// [`attention_by_sums`] with the probabilities multiplied by the host's dropout mask. k and v may
/// have fewer heads than q (repeated over the group). Computed in blocks of query rows, each
/// broadcast product at most [`MAX_PRODUCT_ELEMENTS`].
pub fn attention_by_sums_dropout<B: burn::tensor::backend::Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
    dropout: Option<kernels::Dropout>,
) -> Tensor<B, 4> {
    let [b, h, sq, hd] = q.dims();
    let (k, v) = (
        kernels::attention::repeat_kv(k, h),
        kernels::attention::repeat_kv(v, h),
    );
    let sk = k.dims()[2];
    let scale = scale.unwrap_or_else(|| kernels::attention::default_scale(hd));
    let dev = q.device();
    let mask =
        dropout.map(|d| kernels::attention::dropout::keep_mask::<B>(d, [b, h, sq, sk], &dev));
    let rows = (MAX_PRODUCT_ELEMENTS / (b * h * sk * hd).max(1)).clamp(1, sq.max(1));
    let blocks: Vec<Tensor<B, 4>> = (0..sq)
        .step_by(rows)
        .map(|r0| {
            let r1 = (r0 + rows).min(sq);
            let q = q.clone().slice([0..b, 0..h, r0..r1, 0..hd]);
            let n = r1 - r0;
            let scores: Tensor<B, 4> = (q.unsqueeze_dim::<5>(3) * k.clone().unsqueeze_dim::<5>(2))
                .sum_dim(4)
                .reshape([b, h, n, sk])
                * scale;
            let scores = if causal {
                let rows = Tensor::<B, 1, Int>::arange(r0 as i64..r1 as i64, &dev).reshape([n, 1]);
                let cols = Tensor::<B, 1, Int>::arange(0..sk as i64, &dev).reshape([1, sk]);
                scores.mask_fill(cols.greater(rows).reshape([1, 1, n, sk]), f32::NEG_INFINITY)
            } else {
                scores
            };
            let mut p = burn::tensor::activation::softmax(scores, 3);
            if let Some(mask) = &mask {
                let keep = mask.clone().slice([0..b, 0..h, r0..r1, 0..sk]);
                p = p.clone() * keep.cast(p.dtype());
            }
            (p.unsqueeze_dim::<5>(4) * v.clone().unsqueeze_dim::<5>(2))
                .sum_dim(3)
                .reshape([b, h, n, hd])
        })
        .collect();
    if blocks.is_empty() {
        return Tensor::zeros([b, h, sq, hd], (&dev, q.dtype()));
    }
    Tensor::cat(blocks, 2)
}

/// FlashAttention on q, k, v sliced out of one packed `[B, S, 3H, hd]` projection (strided views,
/// as the model produces them). `exact_by_sums`: as in [`flash_attention`] (the f32 reference on
/// CUDA must not go through TF32 matmuls).
pub fn flash_attention_strided<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
) {
    flash_attention_strided_with::<B>(dtype, dev, false)
}

/// [`flash_attention_strided`] with the choice of exact reference.
pub fn flash_attention_strided_with<B: AutodiffBackend + kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    exact_by_sums: bool,
) {
    let (b, h, s, hd) = (2, 3, 77, 64);
    let heads = move |v: &Tensor<B, 2>, i: usize| {
        v.clone().reshape([b, s, 3 * h, hd]).swap_dims(1, 2).slice([
            0..b,
            i * h..(i + 1) * h,
            0..s,
            0..hd,
        ])
    };
    for causal in [false, true] {
        check::<B>(
            &format!("flash_attention on strided q/k/v [{b}, {h}, {s}, {hd}] causal {causal}"),
            dtype,
            1e-5,
            vec![Input::act([b * s, 3 * h * hd], dev)],
            |v| {
                kernels::flash_attention(
                    heads(&v[0], 0),
                    heads(&v[0], 1),
                    heads(&v[0], 2),
                    causal,
                    None,
                )
                .reshape([b * h * s, hd])
            },
            |v| {
                let (q, k, val) = (heads(&v[0], 0), heads(&v[0], 1), heads(&v[0], 2));
                if exact_by_sums && q.dtype() == burn::tensor::DType::F32 {
                    attention_by_sums(q, k, val, causal, None).reshape([b * h * s, hd])
                } else {
                    kernels::attention::reference(q, k, val, causal, None).reshape([b * h * s, hd])
                }
            },
        );
    }
}

/// The forward's log-sum-exp against the naive one on the same (rounded) values in f32
/// (`exact_by_sums`: with broadcast products and sums instead of matmuls, see [`flash_attention`]).
pub fn flash_attention_lse<B: AutodiffBackend>(
    dtype: FloatDType,
    dev: &B::Device,
    exact_by_sums: bool,
) where
    B::InnerBackend: kernels::KernelOps,
{
    type I<B> = <B as AutodiffBackend>::InnerBackend;
    for (b, h, s, hd) in [(2, 3, 1, 64), (2, 3, 17, 128), (1, 2, 1000, 64)] {
        for causal in [false, true] {
            let r = || {
                randn::<B>([b * h * s, hd], dev)
                    .inner()
                    .reshape([b, h, s, hd])
                    .cast(dtype)
                    .cast(FloatDType::F32)
            };
            let (q, k, v) = (r(), r(), r());
            let (_, lse) = kernels::flash_attention_with_lse(
                q.clone().cast(dtype),
                k.clone().cast(dtype),
                v.cast(dtype),
                causal,
                None,
            );
            let scale = kernels::attention::default_scale(hd);
            let mut scores: Tensor<I<B>, 4> = if exact_by_sums {
                (q.unsqueeze_dim::<5>(3) * k.unsqueeze_dim::<5>(2))
                    .sum_dim(4)
                    .reshape([b, h, s, s])
                    * scale
            } else {
                q.matmul(k.swap_dims(2, 3)) * scale
            };
            if causal {
                let rows = Tensor::<I<B>, 1, Int>::arange(0..s as i64, dev).reshape([s, 1]);
                let cols = Tensor::<I<B>, 1, Int>::arange(0..s as i64, dev).reshape([1, s]);
                scores =
                    scores.mask_fill(cols.greater(rows).reshape([1, 1, s, s]), f32::NEG_INFINITY);
            }
            let m = scores.clone().max_dim(3);
            let exact = ((scores - m.clone()).exp().sum_dim(3).log() + m).reshape([b, h, s]);
            let n = b * h * s;
            let mag = max_abs::<B>(to2::<B, 3>(exact.clone()));
            let err = max_abs::<B>(to2::<B, 3>(lse - exact));
            assert!(
                err <= 1e-5 * mag + 1e-5,
                "flash_attention lse [{b}, {h}, {s}, {hd}] causal {causal} ({dtype:?}): error {err:e} over {n} rows (max |lse| {mag:e})"
            );
        }
    }
}
