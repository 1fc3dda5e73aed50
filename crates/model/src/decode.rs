//! Generation: a cache of every block's keys and values, allocated once and written in place,
//! and a forward that runs only the new positions against it.
//!
//! [`Gpt::decode_cache`] allocates, per block, keys and values `[rows, n_kv_head, capacity,
//! head_dim]` in the model's compute dtype, and the RoPE tables of all `capacity` positions.
//! [`Gpt::decode`] runs new positions (a prompt, then one token at a time) through the model's own
//! path (the fused kernels, FlashAttention and cuBLASLt where the config selects them), writes
//! their keys and values into the cache at their positions and returns the last position's
//! logits. Shapes do not grow with the length, so no kernel is compiled again as the text grows.
//!
//! Attention over the cache:
//! - FlashAttention reads the cached positions in place (a view of the first `len` rows): a
//!   prompt into an empty cache with the causal mask, a single new position without a mask;
//! - the plain path (and several new positions after earlier ones) scores every capacity
//!   position, masked beyond each query's own (the cache starts zeroed, so the masked ones are
//!   finite and weigh exactly 0).

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, FloatDType, Int, Tensor};

use crate::config::AttentionKind;
use crate::decode_cache::DecodeCache;
use crate::gpt::{repeat_kv, Attention, Ctx, Gpt, RopeTables, MASKED};

impl<B: kernels::Backend> Gpt<B> {
    /// A [`DecodeCache`] for `rows` sequences of up to `capacity` positions (at most
    /// `model.context`), zeroed, on `device`.
    pub fn decode_cache(&self, rows: usize, capacity: usize, device: &B::Device) -> DecodeCache<B> {
        assert!(
            (1..=self.config.context).contains(&capacity),
            "a decode cache holds 1 to model.context = {} positions, not {capacity}",
            self.config.context
        );
        assert!(rows >= 1, "a decode cache holds at least one sequence");
        let (hkv, hd) = (self.config.kv_heads(), self.config.head_dim());
        let zeros =
            || Tensor::<B, 4>::zeros([rows, hkv, capacity, hd], device).cast(self.compute_dtype);
        let layers = (0..self.blocks.len())
            .map(|_| Some((zeros(), zeros())))
            .collect();
        let (cos, sin) =
            kernels::rope::tables_from_freqs::<B>(capacity, &self.rope_freqs(), device);
        DecodeCache::new(layers, (cos, sin), rows, capacity)
    }

    /// Logits [rows, vocab] (f32) of the position after `ids` [rows, T], which continue the
    /// positions in `cache`; their keys and values are added to it. A prompt and then one token
    /// at a time give the logits [`Gpt::forward`] gives on the whole text. No dropout: call it on
    /// a model without autodiff (`model.valid()`). Panics if `ids` has another number of rows
    /// than the cache or more positions than it has room for.
    pub fn decode(&self, ids: Tensor<B, 2, Int>, cache: &mut DecodeCache<B>) -> Tensor<B, 2> {
        let [rows, t] = ids.dims();
        assert_eq!(
            rows,
            cache.rows(),
            "{rows} sequences given to a decode cache of {}",
            cache.rows()
        );
        assert!(
            t >= 1 && cache.len() + t <= cache.capacity(),
            "{} cached and {t} new positions exceed the decode cache's {} (clear it first)",
            cache.len(),
            cache.capacity()
        );
        let precision = self.precision();
        let hd = self.config.head_dim();
        let positions = [cache.len()..cache.len() + t, 0..hd / 2];
        let (cos, sin) = (
            cache.cos.clone().slice(positions.clone()),
            cache.sin.clone().slice(positions),
        );
        let tables = if self.fused() {
            RopeTables::Fused { cos, sin }
        } else {
            let dt = self.compute_dtype;
            RopeTables::Reference {
                cos: cos.reshape([1, 1, t, hd / 2]).cast(dt),
                sin: sin.reshape([1, 1, t, hd / 2]).cast(dt),
            }
        };
        let attention = self.config.attention_resolved();
        let past = cache.len();
        // The plain path's mask (and FlashAttention's where its causal mask cannot say it:
        // several new positions after earlier ones), once for every block: query i (position
        // past + i) sees keys 0..=past + i of all capacity positions.
        let causal_mask = (!flash_reads_cache(attention, past, t)).then(|| {
            let device = ids.device();
            let capacity = cache.capacity();
            let above = Tensor::<B, 2, Bool>::tril_mask([t, capacity], past as i64, &device);
            Tensor::<B, 2>::zeros([t, capacity], &device)
                .mask_fill(above, MASKED)
                .reshape([1, 1, t, capacity])
        });
        let x = {
            let ctx = Ctx {
                tables,
                causal_mask,
                attention,
                precision: &precision,
                masks: None,
                kernel_dropout: false,
                selective: vec![false; self.blocks.len()],
                decode: Some(&*cache),
            };
            let mut s = self.embed(ids, &ctx);
            for (layer, block) in self.blocks.iter().enumerate() {
                s = block.step(s, &ctx, layer, self.fused());
            }
            self.final_norm(s)
        };
        cache.advance(t);
        let d = self.config.d_model;
        let last = x.slice([0..rows, t - 1..t, 0..d]);
        let vocab = self.wte.weight.dims()[0];
        self.head(last, precision.gemm)
            .reshape([rows, vocab])
            .cast(FloatDType::F32)
    }
}

impl<B: kernels::Backend> Attention<B> {
    /// The attention of the packed projection `qkv` [B, T, (H + 2 Hkv) hd] of new positions over
    /// `cache`'s and their own keys and values (written into `cache`), and the output
    /// projection: [B, T, d].
    pub(crate) fn attend_cached(
        &self,
        qkv: Tensor<B, 3>,
        ctx: &Ctx<B>,
        layer: usize,
        cache: &DecodeCache<B>,
    ) -> Tensor<B, 3> {
        let [b, t, _] = qkv.dims();
        let (h, hkv) = (self.n_head, self.n_kv_head);
        let d = self.proj.weight.dims()[1];
        let hd = d / h;
        let scale = (hd as f64).powf(-0.5);
        let (q, k, v) = self.rotated(qkv, &ctx.tables);
        let (past, end) = (cache.len(), cache.len() + t);
        let (keys, values) = cache.write(layer, k, v);
        let y = if flash_reads_cache(ctx.attention, past, t) {
            let seen = [0..b, 0..hkv, 0..end, 0..hd];
            kernels::flash_attention(
                q,
                keys.slice(seen.clone()),
                values.slice(seen),
                t > 1,
                Some(scale),
            )
        } else {
            let mask = ctx
                .causal_mask
                .clone()
                .expect("Gpt::decode builds the mask where FlashAttention does not mask");
            let (keys, values) = (repeat_kv(keys, h / hkv), repeat_kv(values, h / hkv));
            let scores = q
                .mul_scalar(scale)
                .matmul(keys.swap_dims(2, 3))
                .cast(FloatDType::F32)
                + mask;
            softmax(scores, 3).cast(values.dtype()).matmul(values)
        };
        let y = y.swap_dims(1, 2).reshape([b, t, d]);
        self.proj
            .forward_projection(y, &ctx.projection(layer, "attn.proj"))
    }
}

/// Whether FlashAttention attends `t` new positions after `past` cached ones straight from the
/// cache: causal within a prompt (queries and keys both start at position 0), unmasked for a
/// single new position (it sees every cached one). Otherwise the plain path runs with a mask.
fn flash_reads_cache(attention: AttentionKind, past: usize, t: usize) -> bool {
    attention == AttentionKind::Flash && (past == 0 || t == 1)
}
