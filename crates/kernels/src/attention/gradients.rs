//! Launches of the FlashAttention backward kernels on `CubeBackend` tensors: the delta pre-pass,
//! then dQ and dK/dV in the Hopper kernel (`hopper/`), on tensor cores or on the portable kernels,
//! and under grouped-query attention the sums of the per-query-head dK and dV over each group.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::calculate_cube_count_elemwise;
use cubecl::ir::features::AtomicUsage;
use cubecl::ir::{ElemType, FloatKind, Type};
use cubecl::prelude::*;

use super::forward::{
    check_inputs, drop_args, empty_bshd, mma_width, portable_block, row_width, rows_readable, Dims,
};
use super::kernel::{flash_backward_dkdv, flash_backward_dq, flash_delta, sum_groups};
use super::mma::{
    dq_from_f32, flash_backward_dkdv_mma, flash_backward_dq_mma, flash_backward_split_mma,
};
use super::tiles::{path, FlashPath, MmaTiles};
use crate::check::{check_same_dtype, check_scale, fail};
use crate::dropout::{DropArgs, Dropout};
use crate::launch::{contiguous, empty, plane_size, use_planes};

/// What the dQ and dK/dV launches read: the inputs as the kernels read them, the output
/// gradient, the forward's log-sum-exp and the pre-pass's `delta`.
struct Saved<R: CubeRuntime> {
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    grad: CubeTensor<R>,
    lse: CubeTensor<R>,
    delta: CubeTensor<R>,
}

/// What they write: dQ, dK, dV, and the fused dQ's f32 accumulator (a stand-in otherwise). Under
/// grouped-query attention `dk` and `dv` are f32 `[batch, heads, seq_k, hd]`, one row block per
/// query head, which [`sum_over_groups`] reduces.
struct Grads<R: CubeRuntime> {
    dq: CubeTensor<R>,
    dk: CubeTensor<R>,
    dv: CubeTensor<R>,
    dq_acc: CubeTensor<R>,
}

/// The call's sizes and scalars.
struct Call {
    d: Dims,
    causal: bool,
    scale: f32,
    drop: DropArgs,
    dtype: StorageType,
}

/// `(dq, dk, dv)` from the inputs, the forward's output and log-sum-exp, and the output gradient.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad: CubeTensor<R>,
    causal: bool,
    scale: f32,
    dropout: Option<Dropout>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let op = "flash_attention backward";
    let d = check_inputs(op, &q, &k, &v);
    check_scale(op, scale as f64);
    let drop = drop_args(op, dropout);
    check_same_dtype(op, "q", q.dtype, "output gradient", grad.dtype);
    if grad.shape().as_slice() != q.shape().as_slice() {
        fail(
            op,
            format!(
                "output gradient has shape {:?}; expected {:?}",
                grad.shape().as_slice(),
                q.shape().as_slice()
            ),
        );
    }
    let (q, k, v) = (rows_readable(q), rows_readable(k), rows_readable(v));
    let (out, grad, lse) = (rows_readable(out), rows_readable(grad), contiguous(lse));
    let dq = empty_bshd(&q, &d, d.heads, d.seq_q);
    if d.seq_q == 0 || d.batch * d.heads == 0 {
        // No queries: k and v received no attention, so their gradients are zero.
        let zeros = |t: &CubeTensor<R>| {
            burn_cubecl::ops::numeric::zeros::<R>(t.device.clone(), t.shape(), t.dtype)
        };
        return (dq, zeros(&k), zeros(&v));
    }
    // Without grouping the kernels write dK and dV as they are. With it, each query head's share
    // goes to f32 rows of its own (no atomics, deterministic), summed over the group below.
    let per_head = |like: &CubeTensor<R>| {
        if d.group == 1 {
            empty_bshd(like, &d, d.kv_heads, d.seq_k)
        } else {
            empty(like, vec![d.batch, d.heads, d.seq_k, d.hd], DType::F32)
        }
    };
    let (dk, dv) = (per_head(&k), per_head(&v));
    let (k_dtype, v_dtype) = (k.dtype, v.dtype);
    let dtype: StorageType = q.dtype.into();

    let flash_path = path(&q);
    if flash_path == FlashPath::TensorCores
        && hopper_backward(
            [&q, &k, &v],
            &out,
            &lse,
            &grad,
            [&dq, &dk, &dv],
            None,
            &d,
            (causal, scale, drop.on),
        )
    {
        return finish(dq, dk, dv, &d, k_dtype, v_dtype);
    }
    let tiles = MmaTiles::get(d.hd, causal);
    let fused_dq = flash_path == FlashPath::TensorCores && tiles.fused_dq;
    // The fused dQ accumulates in f32 through atomics from every key block's cube; the delta
    // pre-pass clears it.
    let dq_acc = if fused_dq {
        empty(&q, vec![d.batch, d.heads, d.seq_q, d.hd], DType::F32)
    } else {
        empty(&q, vec![4], DType::F32)
    };

    let delta = launch_delta(&q, out, &grad, &d, fused_dq.then_some(&dq_acc), dtype);
    let call = Call {
        d,
        causal,
        scale,
        drop,
        dtype,
    };
    let saved = Saved {
        q,
        k,
        v,
        grad,
        lse,
        delta,
    };
    let grads = Grads {
        dq: dq.clone(),
        dk: dk.clone(),
        dv: dv.clone(),
        dq_acc,
    };
    match flash_path {
        FlashPath::TensorCores => backward_mma(op, saved, grads, &call, tiles),
        FlashPath::Portable => backward_portable(saved, grads, &call),
    }
    finish(dq, dk, dv, &call.d, k_dtype, v_dtype)
}

/// The Hopper backward of a packed projection whose q and k the forward rotated with RoPE
/// (`packed.rs`): dQ, dK and dV written straight into `parts` (the q, k and v views of the
/// projection's gradient), dQ and dK rotated back by the angles of the `tables` (`cos`, `sin`) as
/// they are stored, so that no pass packs and rotates them afterwards. `false`, with nothing
/// written, where that kernel does not take the call (not a Hopper GPU, not f16/bf16 at head_dim
/// 64 or 128, dropout, grouped-query attention, tables not in f32) or the driver refused it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_rotated_into<R: CubeRuntime>(
    [q, k, v]: [&CubeTensor<R>; 3],
    out: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    parts: [&CubeTensor<R>; 3],
    tables: [&CubeTensor<R>; 2],
    causal: bool,
    scale: f32,
) -> bool {
    let d = check_inputs("flash_attention_qkv backward", q, k, v);
    let (q, k, v) = (
        rows_readable(q.clone()),
        rows_readable(k.clone()),
        rows_readable(v.clone()),
    );
    let (out, grad, lse) = (
        rows_readable(out.clone()),
        rows_readable(grad.clone()),
        contiguous(lse.clone()),
    );
    d.group == 1
        && d.seq_q > 0
        && d.batch * d.heads > 0
        && grad.shape().as_slice() == q.shape().as_slice()
        && tables.iter().all(|t| t.dtype == DType::F32)
        && path(&q) == FlashPath::TensorCores
        && hopper_backward(
            [&q, &k, &v],
            &out,
            &lse,
            &grad,
            parts,
            Some(tables),
            &d,
            (causal, scale, false),
        )
}

/// The Hopper backward (`hopper/`) where it takes the call (`hopper::applies_backward`, given
/// `(causal, scale, dropout)`), after the delta pre-pass, which it queues once the tensor maps are
/// accepted and which clears the kernel's dQ sums where that kernel hands them over: dQ, dK and
/// dV into `grads` (with RoPE's `tables`, dQ and dK rotated back as they are stored). `false` with
/// nothing queued where it does not apply or the driver refused it (said once, counted).
#[allow(clippy::too_many_arguments)]
fn hopper_backward<R: CubeRuntime>(
    [q, k, v]: [&CubeTensor<R>; 3],
    out: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    grads: [&CubeTensor<R>; 3],
    tables: Option<[&CubeTensor<R>; 2]>,
    d: &Dims,
    (causal, scale, dropout): (bool, f32, bool),
) -> bool {
    if !super::hopper::applies_backward(q, k, v, grad, d, dropout) {
        return false;
    }
    let dtype: StorageType = q.dtype.into();
    let delta =
        |dq_acc: Option<&CubeTensor<R>>| launch_delta(q, out.clone(), grad, d, dq_acc, dtype);
    match super::hopper::backward(q, k, v, grad, lse, delta, grads, tables, d, causal, scale) {
        Ok(()) => true,
        Err(why) => {
            super::hopper::refused(super::hopper::Kernel::Backward, &why);
            false
        }
    }
}

/// The gradients as returned: under grouping, dK and dV summed over each group's query heads.
fn finish<R: CubeRuntime>(
    dq: CubeTensor<R>,
    dk: CubeTensor<R>,
    dv: CubeTensor<R>,
    d: &Dims,
    k_dtype: DType,
    v_dtype: DType,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    if d.group == 1 {
        (dq, dk, dv)
    } else {
        (
            dq,
            sum_over_groups(dk, d, k_dtype),
            sum_over_groups(dv, d, v_dtype),
        )
    }
}

/// dK or dV of the k/v heads, `[batch, kv_heads, seq_k, hd]` in `dtype` (laid out as `[batch,
/// seq_k, kv_heads, hd]`, as without grouping), from the dK/dV kernels' f32 rows per query head
/// (dense `[batch, heads, seq_k, hd]`): each group's heads added in f32, in order.
fn sum_over_groups<R: CubeRuntime>(
    per_head: CubeTensor<R>,
    d: &Dims,
    dtype: DType,
) -> CubeTensor<R> {
    let out = empty(&per_head, vec![d.batch, d.seq_k, d.kv_heads, d.hd], dtype);
    let out = burn_cubecl::ops::permute(out, &[0, 2, 1, 3]);
    let width = row_width(&[&out], &[dtype, DType::F32], d.hd);
    let per_row = d.hd / width;
    let total = d.batch * d.kv_heads * d.seq_k * per_row;
    if total == 0 {
        return out;
    }
    let client = out.client.clone();
    let dim = CubeDim::new_1d(256);
    unsafe {
        sum_groups::launch_unchecked::<R>(
            &client,
            calculate_cube_count_elemwise(&client, total, dim),
            dim,
            width,
            per_head.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            d.kv_heads,
            d.seq_k,
            d.group,
            total,
            per_row,
            dtype.into(),
        );
    }
    out
}

/// The pre-pass: `delta = rowsum(dO * O)`, f32 `[batch, heads, seq_q]`; given `clear`, it also
/// clears that dQ accumulator (`batch x heads x seq_q x head_dim` f32 values, in whatever layout
/// its kernel adds to it).
fn launch_delta<R: CubeRuntime>(
    q: &CubeTensor<R>,
    out: CubeTensor<R>,
    grad: &CubeTensor<R>,
    d: &Dims,
    clear: Option<&CubeTensor<R>>,
    dtype: StorageType,
) -> CubeTensor<R> {
    let client = q.client.clone();
    // Without a clear the kernel never touches the accumulator: a stand-in.
    let dq_acc = clear
        .cloned()
        .unwrap_or_else(|| empty(q, vec![4], DType::F32));
    let rows = d.batch * d.heads * d.seq_q;
    let delta = empty(q, vec![d.batch, d.heads, d.seq_q], DType::F32);
    let width = row_width(&[&out, grad], &[q.dtype, DType::F32], d.hd);
    let per_row = d.hd / width;
    let plane = plane_size(q) as usize;
    let split = if use_planes(q, 256) {
        (1usize << per_row.trailing_zeros()).min(plane)
    } else {
        1
    };
    // Strides in vectors: `row_width` divides each of them.
    let (so, sg) = (out.meta.strides().to_vec(), grad.meta.strides().to_vec());
    unsafe {
        flash_delta::launch_unchecked::<R>(
            &client,
            CubeCount::Static((rows * split).div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            width,
            out.into_array_arg(),
            grad.clone().into_array_arg(),
            delta.clone().into_array_arg(),
            dq_acc.into_array_arg(),
            rows,
            d.heads,
            d.seq_q,
            so[0] / width,
            so[1] / width,
            so[2] / width,
            sg[0] / width,
            sg[1] / width,
            sg[2] / width,
            per_row,
            split,
            clear.is_some(),
            dtype,
        );
    }
    delta
}

/// dQ (unless the dK/dV kernel computes it), dK and dV on tensor cores.
fn backward_mma<R: CubeRuntime>(
    op: &str,
    saved: Saved<R>,
    grads: Grads<R>,
    call: &Call,
    tiles: MmaTiles,
) {
    let Saved {
        q,
        k,
        v,
        grad,
        lse,
        delta,
    } = saved;
    let Grads { dq, dk, dv, dq_acc } = grads;
    let Call {
        ref d,
        causal,
        scale,
        drop,
        dtype,
    } = *call;
    let client = q.client.clone();
    let bh = (d.batch * d.heads) as u32;
    let (q, k, v, grad) = if mma_width(&q, &k, &v, Some(&grad), d) < 2 {
        (
            contiguous(q),
            contiguous(k),
            contiguous(v),
            contiguous(grad),
        )
    } else {
        (q, k, v, grad)
    };
    let width = mma_width(&q, &k, &v, Some(&grad), d);
    if let Some(problem) = tiles.backward_problem(d.hd) {
        fail(
            op,
            format!(
                "flash tiles setting ({}): {problem} (tiles {tiles:?})",
                crate::settings::FLASH_TILES_ENV
            ),
        );
    }
    let (mt, block_k) = tiles.dq;
    if !tiles.fused_dq {
        unsafe {
            flash_backward_dq_mma::launch_unchecked::<R>(
                &client,
                CubeCount::Static(d.seq_q.div_ceil(tiles.dq_planes * mt * 16) as u32, bh, 1),
                CubeDim::new_2d(32, tiles.dq_planes as u32),
                width,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                d.heads,
                d.group,
                d.seq_q,
                d.seq_k,
                scale,
                d.hd,
                tiles.dq_planes,
                mt,
                block_k,
                width,
                causal,
                drop.scalars(),
                drop.on,
                dtype,
            );
        }
    }
    let (mt, block_q) = tiles.dkdv;
    let planes = tiles.dkdv_planes;
    let count = CubeCount::Static(d.seq_k.div_ceil(planes * mt * 16) as u32, bh, 1);
    let dim = CubeDim::new_2d(32, planes as u32);
    // The fused dQ adds a lane's pair of f32 columns with one vector atomic where the
    // device has them (sm_90).
    let pair_atomics =
        Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32))).with_vector_size(2);
    let nq = if client
        .properties()
        .features
        .atomic_type_usage(pair_atomics)
        .contains(AtomicUsage::Add)
    {
        2
    } else {
        1
    };
    // The inputs' dtype and dK/dV's (f32 per query head under grouped-query attention).
    let dkdv_dtypes: [StorageType; 2] = [dtype, dk.dtype.into()];
    // Both dK/dV kernels take the same arguments.
    macro_rules! launch_dkdv {
        ($kernel:ident) => {
            unsafe {
                $kernel::launch_unchecked::<R>(
                    &client,
                    count,
                    dim,
                    width,
                    nq,
                    q.into_tensor_arg(),
                    k.into_tensor_arg(),
                    v.into_tensor_arg(),
                    grad.into_tensor_arg(),
                    lse.into_tensor_arg(),
                    delta.into_tensor_arg(),
                    dk.clone().into_tensor_arg(),
                    dv.clone().into_tensor_arg(),
                    dq_acc.clone().into_tensor_arg(),
                    d.heads,
                    d.group,
                    d.seq_q,
                    d.seq_k,
                    scale,
                    d.hd,
                    planes,
                    mt,
                    block_q,
                    width,
                    causal,
                    tiles.fused_dq,
                    drop.scalars(),
                    drop.on,
                    dkdv_dtypes,
                )
            }
        };
    }
    if tiles.split_bwd {
        launch_dkdv!(flash_backward_split_mma);
    } else {
        launch_dkdv!(flash_backward_dkdv_mma);
    }
    if tiles.fused_dq {
        cast_fused_dq(dq_acc, &dq, d, dtype);
    }
}

/// dQ in the input dtype from the fused dQ's f32 accumulator.
fn cast_fused_dq<R: CubeRuntime>(
    dq_acc: CubeTensor<R>,
    dq: &CubeTensor<R>,
    d: &Dims,
    dtype: StorageType,
) {
    let width = row_width(&[dq], &[dq.dtype, DType::F32], d.hd);
    let n = d.batch * d.heads * d.seq_q * d.hd / width;
    unsafe {
        dq_from_f32::launch_unchecked::<R>(
            &dq.client.clone(),
            CubeCount::Static(n.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            width,
            dq_acc.into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            d.heads,
            d.seq_q,
            d.hd / width,
            dtype,
        );
    }
}

/// dQ, then dK and dV, on the portable kernels.
fn backward_portable<R: CubeRuntime>(saved: Saved<R>, grads: Grads<R>, call: &Call) {
    let Saved {
        q,
        k,
        v,
        grad,
        lse,
        delta,
    } = saved;
    let Grads { dq, dk, dv, .. } = grads;
    let Call {
        ref d,
        causal,
        scale,
        drop,
        dtype,
    } = *call;
    let client = q.client.clone();
    let bh = (d.batch * d.heads) as u32;
    let (block, split) = portable_block(&q, d.hd);
    unsafe {
        flash_backward_dq::launch_unchecked::<R>(
            &client,
            CubeCount::Static(d.seq_q.div_ceil(block) as u32, bh, 1),
            CubeDim::new_1d((block * split) as u32),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            d.group,
            d.hd,
            split,
            block,
            block,
            causal as u32,
            drop.scalars(),
            drop.on,
            dtype,
        );
    }
    unsafe {
        flash_backward_dkdv::launch_unchecked::<R>(
            &client,
            CubeCount::Static(d.seq_k.div_ceil(block) as u32, bh, 1),
            CubeDim::new_1d((block * split) as u32),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            grad.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scale,
            d.group,
            d.hd,
            split,
            block,
            block,
            causal as u32,
            drop.scalars(),
            drop.on,
            [dtype, dk.dtype.into()],
        );
    }
}
