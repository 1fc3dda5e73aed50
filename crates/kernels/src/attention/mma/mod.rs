//! Tensor-core FlashAttention kernels (CUDA, f16/bf16 inputs, f32 accumulation).
//!
//! Every cube has `planes` warps; each warp owns `mt` tiles of 16 rows (queries in the forward
//! and dQ kernels, keys in the dK/dV kernel) and runs the block products with the warp-level
//! `mma.sync.m16n8k16` instruction (CubeCL's manual MMA), holding accumulators in registers.
//!
//! - **Staging:** tiles of q, k, v, dO are copied from global memory by the whole cube with
//!   vector loads and stored whole into shared memory, rows padded by 8 elements (16 bytes) so
//!   that the eight row addresses of an `ldmatrix` phase fall in different banks.
//! - **Fragments:** A and B operands come out of shared memory with `ldmatrix` (`.x4`: one
//!   instruction gives a 16x16 A fragment or the B fragments of two 8-column tiles; `.trans` when
//!   the tile is stored with the reduction dimension along its rows, as v in `P v`).
//! - **P and dS stay in registers:** the m16n8 accumulator layout of two neighbouring 8-column
//!   tiles is the m16k16 A-operand layout, so a score tile becomes the A operand of the next
//!   product by a cast to the input dtype (as FlashAttention-2 does), with no shared-memory trip.
//! - **Why `mt` row tiles per warp:** a B fragment loaded from shared memory feeds `mt` MMAs. With
//!   one tile per warp, a cube reads `1/16` byte of shared memory per flop, which at the H100's
//!   tensor rate (about 2048 dense f16 flops per SM per clock) is the whole shared-memory
//!   bandwidth (128 bytes per clock); two tiles halve that.
//!
//! Register layout (PTX m16n8k16, lane = 4 * g + t): an accumulator tile holds rows `g` (vector 0)
//! and `g + 8` (vector 1), columns `2t, 2t + 1`; an A fragment holds (row, columns) `(g, 2t..)`,
//! `(g + 8, 2t..)`, `(g, 8 + 2t..)`, `(g + 8, 8 + 2t..)` in its four vectors. The lanes sharing a
//! row are the four of a quad (`lane ^ 1`, `lane ^ 2`).
//!
//! Accumulator arrays are indexed `((m * tiles + t) * 2 + half)` for row tile `m`, 8-column tile
//! `t` and row half `half` (rows `g` or `g + 8`); every index is a compile-time constant after
//! unrolling, so they live in registers.

mod dkdv;
mod dkdv_shared;
mod dkdv_split;
mod dq;
mod forward;
pub(crate) mod fragments;

pub(crate) use dkdv::flash_backward_dkdv_mma;
pub(crate) use dkdv_split::flash_backward_split_mma;
pub(crate) use dq::{dq_from_f32, flash_backward_dq_mma};
pub(crate) use forward::flash_forward_mma;
