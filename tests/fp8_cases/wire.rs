//! What gathering a weight's FP8 codes between ranks rests on (ZeRO-3 with FP8 weights on the wire,
//! `trainer::parallel::fsdp`): with 128 x 128 block scales (powers of two), a weight cut into row
//! shards of a multiple of 128 rows quantizes, shard by shard, to the whole weight's codes and
//! scales, so the shards' codes and scales concatenated in rank order are the whole's and no rank
//! needs another's amax; and the dequantized codes, quantized again as the FP8 linear layer
//! quantizes its weight, stand for the same values (each block's scale the same, or half of it
//! where the block's largest code rounded down to 224, the codes then doubled), so a layer
//! computing from gathered codes computes what it would from the weight.

use burn::tensor::{FloatDType, Tensor, TensorData};
use kernels::fp8::TILE;
use kernels::{fp8_quantize, Fp8Format, Fp8Granularity, QuantSpec};

use super::{normal, Rng};

/// `[rows, cols]` weights in `dtype` whose rows' magnitudes span 2^-6 .. 2^5, so that blocks (and
/// ranks) take different scales; padded with zero rows to `world` shards of a multiple of 128
/// rows, each shard quantized alone against the whole, for every world size in `worlds`.
pub fn weight_shards_gather_exactly<B: kernels::Backend>(
    dtype: FloatDType,
    dev: &B::Device,
    shapes: &[(usize, usize)],
    worlds: &[usize],
) {
    let spec = QuantSpec::new(Fp8Format::E4M3, Fp8Granularity::Block128);
    for (n, &(rows, cols)) in shapes.iter().enumerate() {
        for &world in worlds {
            let share = rows.div_ceil(world).div_ceil(TILE) * TILE;
            let padded = weights::<B>(rows, world * share, cols, 7 + n as u64, dtype, dev);
            let ctx = format!("{dtype:?} [{rows}, {cols}] over {world} ranks of {share} rows");
            let whole = fp8_quantize(padded.clone(), spec);
            let shards: Vec<_> = (0..world)
                .map(|r| fp8_quantize(padded.clone().narrow(0, r * share, share), spec))
                .collect();
            let codes: Vec<u8> = shards.iter().flat_map(|s| s.codes()).collect();
            assert!(
                codes == whole.codes(),
                "{ctx}: the shards' codes are the whole's"
            );
            let scales: Vec<f32> = shards
                .iter()
                .flat_map(|s| floats(s.scales.clone()))
                .collect();
            assert_eq!(scales, floats(whole.scales.clone()), "{ctx}: scales");

            let values = floats(whole.dequantize(FloatDType::F32));
            let again = fp8_quantize(whole.dequantize(dtype), spec);
            let again_values = floats(again.dequantize(FloatDType::F32));
            assert!(
                values == again_values,
                "{ctx}: quantized again, the same values"
            );
            for (i, (s, t)) in floats(whole.scales.clone())
                .into_iter()
                .zip(floats(again.scales.clone()))
                .enumerate()
            {
                assert!(
                    t == s || t == s / 2.0,
                    "{ctx}: block {i}'s scale {s} became {t} (the same or half expected)"
                );
            }
        }
    }
}

/// `[padded_rows, cols]` in `dtype`: `rows` rows of normal values scaled per row, then zeros.
fn weights<B: kernels::Backend>(
    rows: usize,
    padded_rows: usize,
    cols: usize,
    seed: u64,
    dtype: FloatDType,
    dev: &B::Device,
) -> Tensor<B, 2> {
    let mut rng = Rng::new(seed);
    let mut v = vec![0.0f32; padded_rows * cols];
    for r in 0..rows {
        let mag = 2f32.powi((rng.next_u32() % 12) as i32 - 6);
        for x in &mut v[r * cols..(r + 1) * cols] {
            *x = normal(&mut rng) * mag;
        }
    }
    Tensor::<B, 2>::from_data(
        TensorData::new(v, [padded_rows, cols]),
        (dev, burn::tensor::DType::F32),
    )
    .cast(dtype)
}

fn floats<B: kernels::Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.cast(FloatDType::F32)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap()
}
