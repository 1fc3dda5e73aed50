//! Reading device tensors to the host in pieces.
//!
//! CubeCL 0.10 stages every read from a CUDA device in page-locked host memory taken from pools
//! that keep their pages until the process exits, and a pool's page grows with the reads it
//! serves: the page is the GPU memory's quarter divided by a power of four. On an H200 (141 GB) a
//! 154 MB read (`gpt2_small`'s embedding in f32) takes a 2.2 GB page and a 9 MB read a 550 MB one,
//! while reads up to 8.6 MB share one 137 MB page (on an H100, up to 4.9 MB share 78 MB). A
//! checkpoint read whole tensor by tensor therefore left gigabytes resident for the rest of the
//! run. Read in pieces of [`PIECE_BYTES`], the host keeps the small page only, whatever the
//! model's size.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// The most bytes one read moves (in the tensor's own dtype).
pub const PIECE_BYTES: usize = 4 << 20;

/// Calls `f` with `t`'s values as f32, in row-major order, one piece at a time; stops at the
/// first error `f` returns.
pub fn read_pieces<B: Backend, const D: usize, E>(
    t: Tensor<B, D>,
    mut f: impl FnMut(&[f32]) -> Result<(), E>,
) -> Result<(), E> {
    for_each_piece(t, |data| f(&as_f32(data)))
}

/// Calls `f` with each piece of `t` (at most [`PIECE_BYTES`] in its own dtype) as host data, in
/// row-major order; stops at the first error `f` returns.
fn for_each_piece<B: Backend, const D: usize, E>(
    t: Tensor<B, D>,
    mut f: impl FnMut(TensorData) -> Result<(), E>,
) -> Result<(), E> {
    let n = t.shape().num_elements();
    let per_piece = (PIECE_BYTES / t.dtype().size()).max(1);
    if n <= per_piece {
        return f(t.into_data());
    }
    let flat = t.reshape([n]);
    let mut start = 0;
    while start < n {
        let end = (start + per_piece).min(n);
        f(flat.clone().slice(start..end).into_data())?;
        start = end;
    }
    Ok(())
}

/// `t`'s values as f32 on the host, read in pieces.
pub fn read_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    let mut out = Vec::with_capacity(t.shape().num_elements());
    read_pieces(t, |piece| {
        out.extend_from_slice(piece);
        Ok::<(), std::convert::Infallible>(())
    })
    .unwrap_or_else(|never| match never {});
    out
}

/// `t` as f32 host data of its shape, read in pieces.
pub fn read_f32_data<B: Backend, const D: usize>(t: Tensor<B, D>) -> TensorData {
    let shape = t.dims().to_vec();
    TensorData::new(read_f32(t), shape)
}

/// Calls `f` with `t`'s bytes as stored (its own dtype), in row-major order, one piece at a time.
pub fn read_bytes<B: Backend, const D: usize>(t: Tensor<B, D>, mut f: impl FnMut(&[u8])) {
    for_each_piece(t, |data| {
        f(&data.bytes);
        Ok::<(), std::convert::Infallible>(())
    })
    .unwrap_or_else(|never| match never {});
}

fn as_f32(data: TensorData) -> Vec<f32> {
    data.convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 tensor data after conversion")
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{DType, Distribution};

    type B = NdArray;

    #[test]
    fn pieces_repeat_the_whole_read_at_awkward_sizes() {
        let device = Default::default();
        // One piece short of, equal to and just past a piece; several pieces with a short tail.
        let per = PIECE_BYTES / 4;
        for rows in [1, per / 7, per / 7 + 1, 3 * per / 7 + 5] {
            let t = Tensor::<B, 2>::random([rows, 7], Distribution::Normal(0.0, 1.0), &device);
            let whole = t.clone().into_data().into_vec::<f32>().unwrap();
            let mut pieces = 0;
            let mut seen = Vec::new();
            read_pieces(t.clone(), |p| {
                assert!(p.len() * 4 <= PIECE_BYTES, "a piece of {} values", p.len());
                pieces += 1;
                seen.extend_from_slice(p);
                Ok::<(), ()>(())
            })
            .unwrap();
            assert_eq!(seen, whole, "{rows} rows");
            assert_eq!(pieces, (rows * 7).div_ceil(per), "{rows} rows");
            assert_eq!(read_f32(t.clone()), whole);
            let data = read_f32_data(t.clone());
            assert_eq!(data.shape.to_vec(), vec![rows, 7]);
            assert_eq!(data.into_vec::<f32>().unwrap(), whole);
            let mut bytes = Vec::new();
            read_bytes(t.clone(), |b| bytes.extend_from_slice(b));
            assert_eq!(bytes, t.into_data().bytes.to_vec());
        }
    }

    #[test]
    fn pieces_count_the_stored_dtype_and_convert_to_f32() {
        let device = Default::default();
        let per_f64 = PIECE_BYTES / 8;
        let t = Tensor::<B, 1>::random([per_f64 + 3], Distribution::Normal(0.0, 1.0), &device)
            .cast(DType::F64);
        let whole = t
            .clone()
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap();
        let mut lens = Vec::new();
        read_pieces(t.clone(), |p| {
            lens.push(p.len());
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(lens, vec![per_f64, 3]);
        assert_eq!(read_f32(t), whole);
    }

    #[test]
    fn the_first_error_stops_the_read() {
        let device = Default::default();
        let t = Tensor::<B, 1>::zeros([3 * PIECE_BYTES / 4], &device);
        let mut calls = 0;
        let r = read_pieces(t, |_| {
            calls += 1;
            if calls == 2 {
                Err("full")
            } else {
                Ok(())
            }
        });
        assert_eq!(r, Err("full"));
        assert_eq!(calls, 2);
    }
}
