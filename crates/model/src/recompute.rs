//! Activation recomputation (`model.recompute = "full"`): the forward and backward of a training
//! loss in which the recomputed blocks keep only their input.
//!
//! The forward cuts the model into pieces at the recomputed blocks. A recomputed block runs on the
//! inner backend, with no autodiff graph: nothing of it stays but its input, one tensor (with the
//! fused kernels, the residual stream and the previous block's MLP output not yet added to it are
//! added first: the block's first kernel would add them anyway), and its output, likewise joined
//! into one tensor, enters the next piece as a fresh leaf. The other blocks, the embedding and the
//! loss run with autodiff as usual, so a piece keeps the activations of the blocks it holds. The
//! backward then walks the pieces from the loss to the embedding: the last piece's backward gives
//! the gradient of the stream leaving the last recomputed block; that block runs again from its
//! saved input, with autodiff, and the backward of `sum(output * gradient)` gives its weights'
//! gradients and the gradient of its input, which seeds the piece before it; and so on.
//!
//! Why whole blocks outside the autodiff graph, rather than Burn's per-op checkpointing
//! (`BalancedCheckpointing` recomputes the memory-bound ops that opt in through a retro-forward):
//! the model's expensive activations are the outputs of its custom ops (the fused norms,
//! FlashAttention, the FP8 GEMMs), which Burn's strategy keeps; the checkpointing strategy is a
//! type parameter of the autodiff backend, fixed at compile time, while the recompute mode is a
//! config key; and a block run again from its input draws the same dropout masks only when every
//! mask is a function of a seed, which is what the forward's context fixes for both runs.
//!
//! The recomputed forward is the same sequence of kernels on the same input as the first, so the
//! gradients are those of `recompute = "none"` (bit for bit where no stream is joined: the
//! reference kernels; with the fused kernels the join is Burn's add instead of the norm kernel's,
//! and a block's stream gradients add in another order); the weights' gradients of different pieces are
//! returned separately and summed by the caller (only a tied embedding has gradients in two pieces:
//! the lookup's and the LM head's).

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};

use crate::block_hook::BlockHook;
use crate::gpt::{Gpt, Outside, Stream};
use crate::precision::{Precision, Probes};

/// A piece of the forward between two recomputed blocks (or the embedding, or the loss): the
/// leaf it starts from (none for the first piece, which starts at the token ids) and the stream
/// it ends with (`None` when it holds no block: its end is its start).
struct Piece<B: AutodiffBackend> {
    start: Option<Tensor<B, 3>>,
    end: Option<Stream<B>>,
}

impl<B> Gpt<B>
where
    B: AutodiffBackend + kernels::Backend,
    B::InnerBackend: kernels::Backend,
{
    /// The forward and backward of the training loss of `ids` against `targets` (as
    /// [`Gpt::forward_loss_in`] with z-loss weight `z`) with the blocks that `model.recompute`
    /// chooses recomputed. The backward starts from the loss times `loss_factor` (a loss scale
    /// and the share of a micro-batch). Returns the loss, unscaled, and the gradients of each
    /// piece, from the last to the first; every parameter's gradient is in exactly one of them,
    /// except a tied embedding's, which is in the first and the last.
    ///
    /// With `hook` ([`crate::block_hook`]), the parameters outside the blocks are the hook's, and
    /// every run of a block, the recomputed blocks' first (whose result leaves autodiff) and
    /// second, takes the block as the hook hands it over.
    pub fn loss_and_grads_recomputed(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        z: f64,
        loss_factor: f64,
        hook: Option<&dyn BlockHook<B>>,
    ) -> (Tensor<B::InnerBackend, 1>, Vec<B::Gradients>) {
        let fused = self.fused();
        let device = ids.device();
        // One draw of the dropout seed for both runs of every block.
        let masks = self.masks(&device);
        let ctx = self.ctx(&ids, precision, masks);
        // The first run of a recomputed block measures nothing: its second run does.
        let quiet = Precision {
            probes: Probes::default(),
            ..precision.clone()
        };
        let inner = self.valid();
        let inner_ctx = inner.ctx(&ids.clone().inner(), &quiet, masks);

        // The forward, cut at the recomputed blocks.
        let mut pieces: Vec<Piece<B>> = Vec::new();
        let mut saved: Vec<(usize, Tensor<B::InnerBackend, 3>)> = Vec::new();
        let mut start = None;
        let mut s = {
            // Handed over for the lookup alone: the loss's piece takes what it reads again.
            let embedding = hook.and_then(|h| h.outside(self, Outside::Embedding, None));
            embedding.as_ref().unwrap_or(self).embed(ids, &ctx)
        };
        let mut holds_blocks = true;
        for (layer, block) in self.blocks.iter().enumerate() {
            if !self.config.recomputes(layer) {
                let entering = s.pending.as_ref().unwrap_or(&s.x);
                let hooked = hook.map(|h| h.block(layer, block, entering));
                s = hooked.as_ref().unwrap_or(block).step(s, &ctx, layer, fused);
                holds_blocks = true;
                continue;
            }
            let input = joined(inner_stream(&s));
            pieces.push(Piece {
                start: start.take(),
                end: holds_blocks.then(|| s.clone()),
            });
            // The hook's block, out of autodiff: this run keeps nothing for a backward.
            let hooked = hook.map(|h| h.block_untracked(layer, block, &s.x).valid());
            let out = hooked.as_ref().unwrap_or(&inner.blocks[layer]).step(
                alone(input.clone()),
                &inner_ctx,
                layer,
                fused,
            );
            saved.push((layer, input));
            let leaf = Tensor::from_inner(joined(out)).require_grad();
            start = Some(leaf.clone());
            s = alone(leaf);
            holds_blocks = false;
        }
        // The loss's piece takes the hook's final norm and head, and a tied head's embedding
        // again: the hook's op then has a backward in each piece that reads the embedding (one
        // handed-over tensor shared by two pieces would reach the parameter from the first
        // backward alone).
        let tied = match (hook, &self.lm_head) {
            (Some(h), None) => h.outside(self, Outside::Embedding, None),
            _ => None,
        };
        let base = tied.as_ref().unwrap_or(self);
        let entering = s.pending.as_ref().unwrap_or(&s.x);
        let head = hook.and_then(|h| h.outside(base, Outside::Head, Some(entering)));
        let loss = head
            .as_ref()
            .unwrap_or(base)
            .loss_from(s, targets, precision, z);
        let value = loss.clone().inner();
        kernels::memory::trace::<B>(&device, || "recompute: after the forward".into());

        // The backward, from the loss to the embedding.
        let root = if loss_factor == 1.0 {
            loss
        } else {
            loss.mul_scalar(loss_factor)
        };
        let mut grads = vec![root.backward()];
        let mut grad = start.map(|leaf| take_grad(&leaf, &mut grads[0]));
        kernels::memory::trace::<B>(&device, || "recompute: after the loss's backward".into());
        for (layer, input) in saved.into_iter().rev() {
            let g = grad
                .take()
                .expect("a recomputed block's output has a gradient");
            // The block again, from its saved input, with autodiff.
            let leaf = Tensor::from_inner(input).require_grad();
            let block = &self.blocks[layer];
            let hooked = hook.map(|h| h.block(layer, block, &leaf));
            let out =
                hooked
                    .as_ref()
                    .unwrap_or(block)
                    .step(alone(leaf.clone()), &ctx, layer, fused);
            grads.push(weighted_sum(out, g).backward());
            let g = take_grad(&leaf, grads.last_mut().expect("just pushed"));
            // The piece before it.
            let piece = pieces
                .pop()
                .expect("one piece before each recomputed block");
            grad = match piece.end {
                Some(end) => {
                    grads.push(weighted_sum(end, g).backward());
                    let last = grads.last_mut().expect("just pushed");
                    piece.start.map(|leaf| take_grad(&leaf, last))
                }
                // No block between two recomputed blocks: the gradient passes through.
                None => Some(g),
            };
            kernels::memory::trace::<B>(&device, || {
                format!("recompute: after block {layer}'s backward")
            });
        }
        (value, grads)
    }
}

/// The stream's tensors without their autodiff history.
fn inner_stream<B: AutodiffBackend>(s: &Stream<B>) -> Stream<B::InnerBackend> {
    Stream {
        x: s.x.clone().inner(),
        pending: s.pending.clone().map(Tensor::inner),
    }
}

/// The stream as one tensor: the residual stream with the pending MLP output added (what the next
/// block's first kernel computes first).
fn joined<B: Backend>(s: Stream<B>) -> Tensor<B, 3> {
    match s.pending {
        Some(p) => s.x + p,
        None => s.x,
    }
}

/// A stream with nothing pending.
fn alone<B: Backend>(x: Tensor<B, 3>) -> Stream<B> {
    Stream { x, pending: None }
}

/// The gradient that `grads` holds for `leaf`, taken out of it: the containers are returned for
/// the weights' gradients, and would otherwise keep an activation's worth of gradient per
/// recomputed block until the step's end.
fn take_grad<B: AutodiffBackend>(
    leaf: &Tensor<B, 3>,
    grads: &mut B::Gradients,
) -> Tensor<B::InnerBackend, 3> {
    leaf.grad_remove(grads)
        .expect("a recomputed block's stream reaches the loss")
}

/// `sum(joined(out) * g)`: a scalar whose backward hands each of `out`'s tensors the gradient
/// `g`. Its value is not used (the sum of low-precision products may overflow; the backward only
/// multiplies `g` by one).
fn weighted_sum<B: AutodiffBackend>(out: Stream<B>, g: Tensor<B::InnerBackend, 3>) -> Tensor<B, 1> {
    (joined(out) * Tensor::from_inner(g)).sum()
}
