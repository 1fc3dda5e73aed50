//! The elementwise dropout kernel.

use cubecl::prelude::*;

use crate::philox::{factor, half_word, philox, DropScalars};

/// `out = x * Z` over `vectors` vectors of `width` elements: a unit takes one Philox call, eight
/// draws, for eight consecutive entries (`8 / width` vectors), as described in [`super`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dropout_fwd<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    out: &mut Array<Vector<F, N>>,
    vectors: usize,
    drop: DropScalars,
    #[comptime] width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let group = ABSOLUTE_POS;
    let per = comptime!(8 / width);
    if group * per < vectors {
        let w = philox(
            u32::cast_from(group),
            0u32,
            0x6472_6f70u32,
            0u32,
            drop.key0,
            drop.key1,
        );
        #[unroll]
        for v in 0..per {
            let idx = group * per + v;
            if idx < vectors {
                let mut val = Vector::<f32, N>::cast_from(x[idx]);
                #[unroll]
                for e in 0..width {
                    let pos = v * width + e;
                    val[e] = val[e] * factor(half_word(w[pos / 2], pos % 2 == 1), &drop);
                }
                out[idx] = Vector::cast_from(val);
            }
        }
    }
}
