//! Activation recomputation (`model.recompute = "full"`): the forward and backward of a training
//! loss in which the recomputed blocks keep only their input.
//!
//! The forward cuts the model into pieces at the recomputed blocks. A recomputed block runs on the
//! inner backend, with no autodiff graph: nothing of it stays but its input (the residual stream,
//! and with the fused kernels the previous block's MLP output not yet added to it), and its output
//! enters the next piece as fresh leaves. The other blocks, the embedding and the loss run with
//! autodiff as usual, so a piece keeps the activations of the blocks it holds. The backward then
//! walks the pieces from the loss to the embedding: the last piece's backward gives the gradient
//! of the stream leaving the last recomputed block; that block runs again from its saved input,
//! with autodiff, and the backward of `sum(output * gradient)` gives its weights' gradients and
//! the gradient of its input, which seeds the piece before it; and so on.
//!
//! Why whole blocks outside the autodiff graph, rather than Burn's per-op checkpointing
//! (`BalancedCheckpointing` recomputes the memory-bound ops that opt in through a retro-forward):
//! the model's expensive activations are the outputs of its custom ops (the fused norms,
//! FlashAttention, the FP8 GEMMs), which Burn's strategy keeps; the checkpointing strategy is a
//! type parameter of the autodiff backend, fixed at compile time, while the recompute mode is a
//! config key; and a block run again from its input draws the same dropout masks only when every
//! mask is a function of a seed, which is what the forward's context fixes for both runs.
//!
//! The recomputed forward is the same sequence of kernels on the same inputs as the first, so the
//! gradients equal those of `recompute = "none"`; the weights' gradients of different pieces are
//! returned separately and summed by the caller (only a tied embedding has gradients in two pieces:
//! the lookup's and the LM head's).

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};

use crate::gpt::{Gpt, Stream};
use crate::precision::{Precision, Probes};

/// A piece of the forward between two recomputed blocks (or the embedding, or the loss): the
/// leaves it starts from (none for the first piece, which starts at the token ids) and the stream
/// it ends with (`None` when it holds no block: its end is its start).
struct Piece<B: AutodiffBackend> {
    start: Option<Stream<B>>,
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
    pub fn loss_and_grads_recomputed(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        z: f64,
        loss_factor: f64,
    ) -> (Tensor<B::InnerBackend, 1>, Vec<B::Gradients>) {
        let fused = self.fused();
        // One draw of the dropout seed for both runs of every block.
        let masks = self.masks(&ids.device());
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
        let mut saved: Vec<(usize, Stream<B::InnerBackend>)> = Vec::new();
        let mut start = None;
        let mut s = self.embed(ids, &ctx);
        let mut holds_blocks = true;
        for (layer, block) in self.blocks.iter().enumerate() {
            if !self.config.recomputes(layer) {
                s = block.step(s, &ctx, layer, fused);
                holds_blocks = true;
                continue;
            }
            let input = inner_stream(&s);
            pieces.push(Piece {
                start: start.take(),
                end: holds_blocks.then(|| s.clone()),
            });
            let out = inner.blocks[layer].step(input.clone(), &inner_ctx, layer, fused);
            saved.push((layer, input));
            s = leaves(out);
            start = Some(s.clone());
            holds_blocks = false;
        }
        let loss = self.loss_from(s, targets, precision, z);
        let value = loss.clone().inner();

        // The backward, from the loss to the embedding.
        let root = if loss_factor == 1.0 {
            loss
        } else {
            loss.mul_scalar(loss_factor)
        };
        let mut grads = vec![root.backward()];
        let mut grad = start.map(|leaves| stream_grad(&leaves, &mut grads[0]));
        for (layer, input) in saved.into_iter().rev() {
            let g = grad
                .take()
                .expect("a recomputed block's output has a gradient");
            // The block again, from its saved input, with autodiff.
            let leaves = leaves(input);
            let out = self.blocks[layer].step(leaves.clone(), &ctx, layer, fused);
            grads.push(weighted_sum(out, g).backward());
            let g = stream_grad(&leaves, grads.last_mut().expect("just pushed"));
            // The piece before it.
            let piece = pieces
                .pop()
                .expect("one piece before each recomputed block");
            grad = match piece.end {
                Some(end) => {
                    grads.push(weighted_sum(end, g).backward());
                    let last = grads.last_mut().expect("just pushed");
                    piece.start.map(|leaves| stream_grad(&leaves, last))
                }
                // No block between two recomputed blocks: the gradient passes through.
                None => Some(g),
            };
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

/// The stream's tensors as new leaves that collect gradients.
fn leaves<B: AutodiffBackend>(s: Stream<B::InnerBackend>) -> Stream<B> {
    Stream {
        x: Tensor::from_inner(s.x).require_grad(),
        pending: s.pending.map(|p| Tensor::from_inner(p).require_grad()),
    }
}

/// The gradients that `grads` holds for the leaves of `s`, taken out of it: the containers are
/// returned for the weights' gradients, and would otherwise keep two activations' worth of
/// gradient per recomputed block until the step's end.
fn stream_grad<B: AutodiffBackend>(
    s: &Stream<B>,
    grads: &mut B::Gradients,
) -> Stream<B::InnerBackend> {
    Stream {
        x: s.x
            .grad_remove(grads)
            .expect("the stream leaves reach the loss"),
        pending: s.pending.as_ref().map(|p| {
            p.grad_remove(grads)
                .expect("the pending leaves reach the loss")
        }),
    }
}

/// `sum(out.x * g.x) + sum(out.pending * g.pending)`: a scalar whose backward hands each of
/// `out`'s tensors the gradient `g` has for it. Its value is not used (the sum of low-precision
/// products may overflow; the backward only multiplies `g` by one).
fn weighted_sum<B: AutodiffBackend>(out: Stream<B>, g: Stream<B::InnerBackend>) -> Tensor<B, 1> {
    let mut total = (out.x * Tensor::from_inner(g.x)).sum();
    if let (Some(o), Some(d)) = (out.pending, g.pending) {
        total = total + (o * Tensor::from_inner(d)).sum();
    }
    total
}
