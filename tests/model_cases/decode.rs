//! Generation against the full forward: [`Gpt::decode`] on a prompt, then one position at a time,
//! then several positions after earlier ones, and again from position 0 after
//! [`model::DecodeCache::clear`], must give at every position the logits [`Gpt::forward`] gives
//! on the whole text, with the same weights in the same compute dtype.
//!
//! The two differ only in the order of their roundings (other GEMM shapes, key blocks, one
//! position's row instead of all), so the allowance is the module's: the decoded logits may be no
//! further from the forward's than twice the forward's own largest distance from the f32 forward
//! over the whole text (the dtype's rounding; 0 in f32), plus `max(32 u, 1e-4) max|logits|` with
//! `u` the unit roundoff of the device's f32 matmuls. (The distance at the one position checked
//! is a single sample of that rounding: in f16 it fell below half the decoded error at times.)
//! The weights are drawn from a fixed seed, so a run repeats the last.

use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use model::{Gpt, GptConfig};

/// Rows and positions of the text; its vocabulary.
const ROWS: usize = 2;
const LEN: usize = 13;
const VOCAB: usize = 37;

/// The check above for a model of `cfg` computing in `dtype` on `dev`; `f32_unit_roundoff` of
/// the device's f32 matmuls.
pub fn decode_matches_forward<B: kernels::Backend>(
    cfg: &GptConfig,
    dtype: FloatDType,
    f32_unit_roundoff: f64,
    dev: &B::Device,
) {
    assert!(cfg.context >= LEN, "the case needs model.context >= {LEN}");
    B::seed(dev, 23);
    let master = Gpt::<B>::new(cfg, VOCAB, dev);
    let gpt = master.compute_copy(dtype);
    let mut draw = trainer::rng::SplitMix64::new(11);
    let ids: Vec<i64> = (0..ROWS * LEN).map(|_| draw.below(VOCAB) as i64).collect();
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [ROWS, LEN]), dev);
    let values = |t: Tensor<B, 3>| t.into_data().to_vec::<f32>().unwrap();
    let full = values(gpt.forward(ids.clone()));
    let exact = values(master.forward(ids.clone()));
    // Logits of position `p`, row by row, out of a [ROWS, LEN, VOCAB] forward.
    let at = |all: &[f32], p: usize| -> Vec<f32> {
        (0..ROWS)
            .flat_map(|r| all[(r * LEN + p) * VOCAB..(r * LEN + p + 1) * VOCAB].to_vec())
            .collect()
    };
    let scale = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
    let atol = (32.0 * f32_unit_roundoff).max(1e-4) as f32 * scale;
    let dist = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    // The dtype's rounding of these logits: the forward's largest distance from the f32 forward.
    let baseline = dist(&full, &exact);

    let mut cache = gpt.decode_cache(ROWS, LEN, dev);
    let check = |cache: &mut model::DecodeCache<B>, from: usize, to: usize, what: &str| {
        let logits = gpt.decode(ids.clone().slice([0..ROWS, from..to]), cache);
        assert_eq!(logits.dims(), [ROWS, VOCAB], "{what}");
        assert_eq!(cache.len(), to, "{what}: positions cached");
        let got = logits.into_data().to_vec::<f32>().unwrap();
        let err = dist(&got, &at(&full, to - 1));
        eprintln!(
            "{what} ({dtype:?}): {err:e} of {:e} allowed",
            2.0 * baseline + atol
        );
        assert!(
            err.is_finite() && err <= 2.0 * baseline + atol,
            "{what} ({dtype:?}, kernels {:?}, attention {:?}, {} kv heads): position {} differs \
             from the full forward by {err:e}, allowed 2 x {baseline:e} + {atol:e}",
            cfg.kernels,
            cfg.attention,
            cfg.kv_heads(),
            to - 1
        );
    };
    check(&mut cache, 0, 5, "a prompt of 5");
    for p in 5..9 {
        check(&mut cache, p, p + 1, "one new position");
    }
    check(&mut cache, 9, LEN, "4 new positions after 9");
    cache.clear();
    check(&mut cache, 0, LEN, "the whole text after clear()");
}

/// A two-block model of 4 heads of 64 (the tensor-core FlashAttention's head size) over
/// `kv_heads` key/value heads, with room for the case's text.
pub fn config(
    kernels: model::KernelsKind,
    attention: model::AttentionKind,
    mlp: model::MlpKind,
    kv_heads: usize,
) -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 4,
        n_kv_head: kv_heads,
        d_model: 256,
        context: 16,
        mlp,
        // The GELU models untied, so that both heads are decoded.
        tie_embeddings: mlp == model::MlpKind::Swiglu,
        kernels,
        attention,
        ..GptConfig::default()
    }
}

/// A case: the model's kernels, attention, MLP and key/value heads ([`config`]).
pub type Case = (
    model::KernelsKind,
    model::AttentionKind,
    model::MlpKind,
    usize,
);

/// [`decode_matches_forward`] for every case of `cases` in every dtype of `dtypes`.
pub fn each<B: kernels::Backend>(
    cases: &[Case],
    dtypes: &[FloatDType],
    f32_unit_roundoff: f64,
    dev: &B::Device,
) {
    for &(kernels, attention, mlp, kv_heads) in cases {
        let cfg = config(kernels, attention, mlp, kv_heads);
        for &dtype in dtypes {
            decode_matches_forward::<B>(&cfg, dtype, f32_unit_roundoff, dev);
        }
    }
}
