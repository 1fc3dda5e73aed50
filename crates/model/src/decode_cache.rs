//! The keys and values [`Gpt::decode`](crate::gpt::Gpt::decode) generates against: every
//! block's, allocated once (by `Gpt::decode_cache`) and written in place.

use std::cell::RefCell;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::dtype::debug_assert_dtype;

/// Keys and values of the positions generated so far, for
/// [`Gpt::decode`](crate::gpt::Gpt::decode).
#[derive(Debug)]
pub struct DecodeCache<B: Backend> {
    /// Per block: keys and values, [rows, n_kv_head, capacity, head_dim] each, in the compute
    /// dtype. Taken out while a forward writes them, so that the write happens in place.
    layers: RefCell<Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>>,
    /// RoPE's cosines and sines of every position, [capacity, head_dim / 2] f32.
    pub(crate) cos: Tensor<B, 2>,
    pub(crate) sin: Tensor<B, 2>,
    rows: usize,
    capacity: usize,
    len: usize,
}

impl<B: Backend> DecodeCache<B> {
    /// A cache of `layers` (keys and values per block, [rows, n_kv_head, capacity, head_dim]
    /// each) with RoPE's `tables` of every position, holding no position yet.
    pub(crate) fn new(
        layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
        (cos, sin): (Tensor<B, 2>, Tensor<B, 2>),
        rows: usize,
        capacity: usize,
    ) -> Self {
        Self {
            layers: RefCell::new(layers),
            cos,
            sin,
            rows,
            capacity,
            len: 0,
        }
    }

    /// Counts `t` positions more as cached (after a forward wrote them).
    pub(crate) fn advance(&mut self, t: usize) {
        self.len += t;
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sequences it holds side by side (the batch of every decode).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Forgets every position (the memory stays allocated): the next decode starts a new text
    /// at position 0.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Writes `k`, `v` [rows, n_kv_head, t, head_dim] at positions `len..len + t` of `layer`
    /// and returns the whole cache of that layer.
    pub(crate) fn write(
        &self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let mut layers = self.layers.borrow_mut();
        let (ck, cv) = layers[layer]
            .take()
            .expect("each block writes its cache once per forward");
        let [b, hkv, t, hd] = k.dims();
        let at = [0..b, 0..hkv, self.len..self.len + t, 0..hd];
        debug_assert_dtype(&k, ck.dtype().into(), "keys written to the decode cache");
        let ck = ck.slice_assign(at.clone(), k);
        let cv = cv.slice_assign(at, v);
        layers[layer] = Some((ck.clone(), cv.clone()));
        (ck, cv)
    }
}
