//! Launches of the RMSNorm kernels on `CubeBackend` tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::prelude::*;

use super::kernel::{rms_norm_bwd, rms_norm_fwd};
use crate::check::{check_float, check_same_dtype, fail};
use crate::launch::{
    contiguous, empty, max_cubes_x, max_units, num_sms, reduce_slots, row_split, use_planes,
    vector_width,
};

/// Most vectors of a row one unit keeps in registers. With 1024 units this bounds rows at
/// 16384 vectors: 65536 f32 or 131072 bf16 elements on CUDA, 16384 when the length is odd.
const MAX_PER_UNIT: usize = 16;

/// Rows and row length of a `[.., cols]` tensor.
pub(crate) fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = *shape.as_slice().last().unwrap_or(&1);
    let rows = shape.num_elements().checked_div(cols).unwrap_or(0);
    (rows, cols)
}

/// How a launch splits the rows.
struct Plan {
    /// Vector width.
    n: usize,
    /// Units along a row (the cube's x).
    lanes: usize,
    /// Rows a cube holds at once (the cube's y).
    rows_per_cube: usize,
    /// Vectors of a row per unit.
    per_unit: usize,
    /// A row per plane (`lanes` is the plane size), summed with `plane_sum`.
    row_plane: bool,
    /// Whole-cube sums through planes (one row per cube).
    plane: bool,
}

/// Vectors per unit up to which a row goes to one plane (the forward's passes and the backward's
/// first are unrolled over a unit's vectors, so registers grow with them).
const MAX_PER_LANE: usize = 8;

/// Units of a row-per-plane cube (several rows at once, so that many loads are in flight): the
/// forward's, and the backward's, smaller so that its cubes fill an SM more evenly.
pub(super) const ROW_PLANE_UNITS: usize = 256;
pub(super) const BWD_ROW_PLANE_UNITS: usize = 128;

/// Cubes per SM the backward launches at most (each walks its rows and writes one row of partial
/// weight gradients): row-per-plane cubes, and one-row cubes. At width 768 in bf16 a row-per-plane
/// cube takes 40 registers a unit (128 units), so an SM holds twelve: the whole grid in one wave.
const BWD_CUBES_PER_SM: usize = 12;
const BWD_ROW_CUBES_PER_SM: usize = 4;

/// Shared memory the backward's row-per-plane cube may use for its units' weight-gradient sums
/// (summed over its planes at the end).
const DW_SMEM_BYTES: usize = 32 << 10;

/// `row_plane_units`: the units of a row-per-plane cube.
fn plan<R: CubeRuntime>(
    op: &str,
    x: &CubeTensor<R>,
    w: &CubeTensor<R>,
    cols: usize,
    row_plane_units: usize,
) -> Plan {
    let n = vector_width(x, &[x.dtype, w.dtype], &[cols]);
    let row_vecs = cols / n;
    let plane_size = crate::launch::plane_size(x) as usize;
    if use_planes(x, plane_size) && row_vecs <= plane_size * MAX_PER_LANE {
        let per_unit = row_vecs.div_ceil(plane_size).max(1);
        let plane_bytes = per_unit * plane_size * n * 4;
        return Plan {
            n,
            lanes: plane_size,
            rows_per_cube: (row_plane_units / plane_size)
                .min(DW_SMEM_BYTES / plane_bytes)
                .max(1),
            per_unit,
            row_plane: true,
            plane: true,
        };
    }
    let Some((units, per_unit)) = row_split(row_vecs, max_units(x), MAX_PER_UNIT) else {
        fail(op, format!(
            "rows of {cols} elements are longer than this kernel supports ({} elements at vector width {n}); \
             use the reference implementation for such rows",
            MAX_PER_UNIT * max_units(x).min(1024) * n
        ))
    };
    Plan {
        n,
        lanes: units,
        rows_per_cube: 1,
        per_unit,
        row_plane: false,
        plane: use_planes(x, units),
    }
}

fn check_weight<R: CubeRuntime>(op: &str, x: &CubeTensor<R>, w: &CubeTensor<R>) {
    check_float(op, "x", x.dtype);
    check_float(op, "weight", w.dtype);
    let (_, cols) = rows_cols(&x.shape());
    if w.shape().as_slice() != [cols] {
        fail(
            op,
            format!(
                "weight has shape {:?}; it must be [{cols}], the last dimension of x {:?}",
                w.shape().as_slice(),
                x.shape().as_slice()
            ),
        );
    }
}

/// Forward: `(sum, y, rstd)`; `sum` is `Some` when `residual` is given. `rstd` is f32 [rows].
pub(crate) fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    residual: Option<CubeTensor<R>>,
    w: CubeTensor<R>,
    eps: f64,
) -> (Option<CubeTensor<R>>, CubeTensor<R>, CubeTensor<R>) {
    let op = if residual.is_some() {
        "add_rms_norm"
    } else {
        "rms_norm"
    };
    check_weight(op, &x, &w);
    if let Some(r) = &residual {
        check_same_dtype(op, "x", x.dtype, "residual", r.dtype);
        if r.shape() != x.shape() {
            fail(
                op,
                format!(
                    "residual has shape {:?} but x has {:?}; they must match",
                    r.shape().as_slice(),
                    x.shape().as_slice()
                ),
            );
        }
    }
    let shape = x.shape();
    let (rows, cols) = rows_cols(&shape);
    let x = contiguous(x);
    let w = contiguous(w);
    let y = empty(&x, shape.as_slice().to_vec(), x.dtype);
    let rstd = empty(&x, vec![rows], DType::F32);
    let sum = residual
        .as_ref()
        .map(|_| empty(&x, shape.as_slice().to_vec(), x.dtype));
    if rows == 0 {
        return (sum, y, rstd);
    }
    let p = plan(op, &x, &w, cols, ROW_PLANE_UNITS);
    let n = p.n;
    let cubes = rows.div_ceil(p.rows_per_cube).min(max_cubes_x(&x));
    let client = x.client.clone();
    let dtypes = [x.dtype.into(), w.dtype.into()];
    // Without a residual the kernel never touches `r` and `sum`: x stands in for r (read-only) and
    // a one-element tensor for sum.
    let r = residual.map(contiguous).unwrap_or_else(|| x.clone());
    let sum_arg = sum.clone().unwrap_or_else(|| empty(&x, vec![1], x.dtype));
    rms_norm_fwd::launch::<R>(
        &client,
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_2d(p.lanes as u32, p.rows_per_cube as u32),
        n,
        x.into_array_arg(),
        r.into_array_arg(),
        w.into_array_arg(),
        y.clone().into_array_arg(),
        sum_arg.into_array_arg(),
        rstd.clone().into_array_arg(),
        rows,
        cols / n,
        eps as f32,
        p.per_unit,
        reduce_slots(p.lanes, p.plane),
        sum.is_some(),
        p.plane,
        p.row_plane,
        dtypes,
    );
    (sum, y, rstd)
}

/// Backward: `(dx, dw)` from the normalised input `x`, the gain, the saved `rstd` and `dy`.
pub(crate) fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    rstd: CubeTensor<R>,
    dy: CubeTensor<R>,
    dres: Option<CubeTensor<R>>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let shape = x.shape();
    let (rows, cols) = rows_cols(&shape);
    if let Some(r) = &dres {
        if r.shape() != shape {
            fail(
                "rms_norm backward",
                format!(
                    "the input's other gradient has shape {:?} but the input has {:?}",
                    r.shape().as_slice(),
                    shape.as_slice()
                ),
            );
        }
    }
    let x = contiguous(x);
    let w = contiguous(w);
    let w_dtype = w.dtype;
    // The gradients may arrive in another dtype than x (e.g. f32 into a bf16 norm): bring them
    // to x's (the kernel then adds `dres` to dx in f32, before dx's one rounding).
    let dy = contiguous(burn_cubecl::kernel::cast(dy, x.dtype));
    let dres = dres.map(|r| contiguous(burn_cubecl::kernel::cast(r, x.dtype)));
    let dx = empty(&x, shape.as_slice().to_vec(), x.dtype);
    if rows == 0 {
        let dw = burn_cubecl::ops::numeric::zeros_client(
            x.client.clone(),
            x.device.clone(),
            vec![cols].into(),
            w_dtype,
        );
        return (dx, dw);
    }
    let p = plan("rms_norm backward", &x, &w, cols, BWD_ROW_PLANE_UNITS);
    let n = p.n;
    // A few cubes per SM keep the partial weight gradients small ([cubes, cols] f32, summed
    // after).
    let per_sm = if p.row_plane {
        BWD_CUBES_PER_SM
    } else {
        BWD_ROW_CUBES_PER_SM
    };
    let cubes = rows
        .div_ceil(p.rows_per_cube)
        .min(per_sm * num_sms(&x))
        .min(max_cubes_x(&x));
    let dw_part = empty(&x, vec![cubes, cols], DType::F32);
    let dw_slots = if p.row_plane {
        p.rows_per_cube * p.per_unit * p.lanes
    } else {
        1
    };
    let client = x.client.clone();
    let dtypes = [x.dtype.into(), w.dtype.into()];
    let add_res = dres.is_some();
    // Without another gradient the kernel never reads that argument: one vector stands in.
    let dres = dres.unwrap_or_else(|| empty(&x, vec![n], x.dtype));
    rms_norm_bwd::launch::<R>(
        &client,
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_2d(p.lanes as u32, p.rows_per_cube as u32),
        n,
        x.into_array_arg(),
        w.into_array_arg(),
        rstd.into_array_arg(),
        dy.into_array_arg(),
        dres.into_array_arg(),
        dx.clone().into_array_arg(),
        dw_part.clone().into_array_arg(),
        rows,
        cols / n,
        p.per_unit,
        reduce_slots(p.lanes, p.plane),
        p.plane,
        p.row_plane,
        dw_slots,
        add_res,
        dtypes,
    );
    let dw = crate::launch::sum_rows(dw_part);
    (dx, burn_cubecl::kernel::cast(dw, w_dtype))
}

impl<R, F, I, BT> super::RmsNormKernels for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    #[allow(clippy::type_complexity)]
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (
        Option<FloatTensor<Self>>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        forward(x, residual, weight, eps)
    }
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dres: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        backward(x, weight, rstd, dy, dres)
    }
}

impl<R, F, I, BT> super::RmsNormOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        <Self as super::RmsNormKernels>::rms_norm_forward(x, None, weight, eps).1
    }
    fn fused_add_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (s, y, _) =
            <Self as super::RmsNormKernels>::rms_norm_forward(x, Some(residual), weight, eps);
        (s.expect("the fused forward returns the sum"), y)
    }
}
