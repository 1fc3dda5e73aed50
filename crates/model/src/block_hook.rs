//! A forward that hands each block's parameters to a hook just before the block runs, with the
//! deepest tensor entering it (the stream, or the previous block's output not yet added to it),
//! and the parameters outside the blocks before the embedding: what a data-parallel trainer needs
//! to reduce a block's gradients as soon as the backward has finished with that block, while
//! earlier blocks' backward runs, and what a sharded one (ZeRO-3) needs to gather a block's
//! weights just before it runs.
//!
//! Burn's backward runs its steps from the deepest node of the graph to the shallowest. An op
//! that takes a block's parameter and the deepest tensor entering the block sits one level below
//! that tensor; every use of its output in the block is deeper, so its backward runs once the block's
//! backward has produced the whole gradient of the parameter, and before the backward of the
//! blocks below. The op itself is the hook's to build (the trainer's `parallel::overlap` builds
//! one that hands the gradient to its bucketed reduction).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::gpt::{Block, Outside};
use crate::{Gpt, Precision};

/// What a hooked forward does with each block's parameters.
pub trait BlockHook<B: Backend> {
    /// Block `layer` as the forward is to use it (its parameters passed through ops of the
    /// hook's), given `input`, the deepest tensor entering it: the residual stream, or with the
    /// fused kernels the previous block's MLP output that the block's first norm adds to it.
    fn block(&self, layer: usize, block: &Block<B>, input: &Tensor<B, 3>) -> Block<B>;

    /// Block `layer` for a run whose result leaves autodiff (a recomputed block's first run,
    /// which keeps nothing for a backward): by default as [`BlockHook::block`] hands it over; a
    /// hook may hand over untracked tensors instead, so that the run adds nothing to the graph.
    fn block_untracked(&self, layer: usize, block: &Block<B>, input: &Tensor<B, 3>) -> Block<B> {
        self.block(layer, block, input)
    }

    /// `model` with its parameters of `part` as the forward is to use them (its blocks, and its
    /// other parameters, as they are), just before the forward reads them; `input` is the deepest
    /// tensor entering the final norm for [`Outside::Head`], none for the embedding. `None`, the
    /// default, uses the model's own.
    fn outside(
        &self,
        _model: &Gpt<B>,
        _part: Outside,
        _input: Option<&Tensor<B, 3>>,
    ) -> Option<Gpt<B>> {
        None
    }
}

impl<B: kernels::Backend> Gpt<B> {
    /// [`Gpt::forward_loss_in`] with each block's parameters passed through `hook` just before
    /// the block runs. The loss is the same; what the hook's ops do in the backward is theirs.
    /// Not with `model.recompute = "full"`, whose blocks run in backwards of their own.
    pub fn forward_loss_hooked(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        hook: &dyn BlockHook<B>,
    ) -> Tensor<B, 1> {
        self.forward_loss_through(ids, targets, precision, self.config.z_loss, Some(hook))
    }

    /// [`Gpt::forward_loss_hooked`] with the z-loss weight `z` (0 gives the plain cross-entropy,
    /// as evaluation reports it).
    pub fn forward_loss_hooked_with(
        &self,
        ids: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        precision: &Precision,
        z: f64,
        hook: &dyn BlockHook<B>,
    ) -> Tensor<B, 1> {
        self.forward_loss_through(ids, targets, precision, z, Some(hook))
    }
}
