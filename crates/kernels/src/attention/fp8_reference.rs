//! The reference of the FP8 Hopper forward (`hopper/fp8.rs`, `BURNMIX_FLASH_FP8=on`): what its
//! recipe computes, in f32 with exact FP8 rounding, so that a test can tell the kernel's error
//! from what FP8 itself costs. q is quantized with one scale per 64 rows, k and v per 128 rows, of
//! each (batch, head) (scale = amax / 448, 1 for a block of zeros; values times 1 / scale rounded
//! to e4m3 by [`crate::fp8::reference::encode`]); then attention on the dequantized values with P rounded to
//! e4m3: `exp(s - row max) * 256` rounded, divided by the sum of the unrounded terms. The kernel
//! rounds against the running maximum of the key blocks it has seen, this against the row's
//! final one, so the two round the terms of a row whose maximum grows a little differently. The
//! rounding runs on the host (it materialises the scores there too).

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::{Tensor, TensorData};

use super::{masked_scores, repeat_kv};
use crate::fp8::reference::{decode, encode};
use crate::fp8::Fp8Format;

/// Query rows and keys of each (batch, head) that share a scale: the FP8 Hopper forward's (one
/// consumer warpgroup's rows, one key block), which `hopper/fp8.rs` quantizes with.
pub(crate) const Q_SCALE_ROWS: usize = 64;
pub(crate) const KEY_SCALE_ROWS: usize = 128;
/// P's factor before rounding (the kernel's exp2(. - max + 8)), so that small terms keep e4m3's
/// precision instead of falling among its subnormals.
const P_FACTOR: f32 = 256.0;

/// `x` `[batch, heads, seq, head_dim]` quantized to e4m3 with one scale per `rows` rows of each
/// (batch, head), and dequantized (in f32).
pub fn fp8_blocks<B: BurnBackend>(x: Tensor<B, 4>, rows: usize) -> Tensor<B, 4> {
    assert!(rows > 0, "fp8_blocks: rows must be at least 1");
    let dims = x.dims();
    let dev = x.device();
    let row_len = dims[2] * dims[3];
    let block_len = rows * dims[3];
    let mut data = to_f32(x);
    for pair in data.chunks_mut(row_len.max(1)) {
        for block in pair.chunks_mut(block_len.max(1)) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 {
                amax / Fp8Format::E4M3.max()
            } else {
                1.0
            };
            // As the quantizer kernel: times the reciprocal, each rounded once.
            let inv = 1.0 / scale;
            for v in block.iter_mut() {
                *v = decode(encode(*v * inv, 1.0, Fp8Format::E4M3), Fp8Format::E4M3) * scale;
            }
        }
    }
    Tensor::from_data(TensorData::new(data, dims), &dev)
}

/// `(out, lse)` of the FP8 forward's recipe (see the module's text) for q `[batch, heads, seq_q,
/// head_dim]`, k and v `[batch, kv_heads, seq_k, head_dim]`, in f32; lse is the natural
/// log-sum-exp of the dequantized inputs' scaled, masked scores.
pub fn reference_fp8<B: BurnBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    scale: Option<f64>,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let [_, h, _, hd] = q.dims();
    let scale = scale.unwrap_or_else(|| super::default_scale(hd));
    // In f32 from here: `fp8_blocks` returns its values as f32 data.
    let q = fp8_blocks(q, Q_SCALE_ROWS);
    let k = fp8_blocks(k, KEY_SCALE_ROWS);
    let v = fp8_blocks(v, KEY_SCALE_ROWS);
    let s = masked_scores(q, k, causal, scale);
    let m = s.clone().max_dim(3);
    let p = (s - m.clone()).exp().mul_scalar(P_FACTOR);
    let sum = p.clone().sum_dim(3);
    let lse = (sum.clone().div_scalar(P_FACTOR).log() + m).squeeze_dim::<3>(3);
    let dims = p.dims();
    let dev = p.device();
    let mut rounded = to_f32(p);
    for x in rounded.iter_mut() {
        *x = decode(encode(*x, 1.0, Fp8Format::E4M3), Fp8Format::E4M3);
    }
    let p = Tensor::<B, 4>::from_data(TensorData::new(rounded, dims), &dev);
    (p.matmul(repeat_kv(v, h)) / sum, lse)
}

fn to_f32<B: BurnBackend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data")
}
