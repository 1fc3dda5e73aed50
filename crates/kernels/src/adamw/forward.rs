//! The fused AdamW step's launch on `CubeBackend` tensors.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};

use super::kernel::{adamw_kernel, AdamWScalarsLaunch};
use super::AdamWStep;
use crate::check::{check_factor, check_float, fail};
use crate::launch::{contiguous, elementwise, empty};

/// `(param, m, v, copy)` after one step; see [`super::reference`].
pub(crate) fn step<R: CubeRuntime>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
    m: CubeTensor<R>,
    v: CubeTensor<R>,
    factor: CubeTensor<R>,
    hp: &AdamWStep,
    copy_dtype: Option<DType>,
) -> (
    CubeTensor<R>,
    CubeTensor<R>,
    CubeTensor<R>,
    Option<CubeTensor<R>>,
) {
    let op = "adamw_step";
    let shape = param.shape();
    for (name, t) in [("param", &param), ("m", &m), ("v", &v)] {
        if t.dtype != DType::F32 {
            fail(
                op,
                format!(
                    "{name} has dtype {:?}; master weights and moments must be F32",
                    t.dtype
                ),
            );
        }
    }
    check_float(op, "grad", grad.dtype);
    for (name, t) in [("grad", &grad), ("m", &m), ("v", &v)] {
        if t.shape() != shape {
            fail(
                op,
                format!(
                    "{name} has shape {:?} but param has {:?}",
                    t.shape().as_slice(),
                    shape.as_slice()
                ),
            );
        }
    }
    check_factor(op, &factor);
    if let Some(dt) = copy_dtype {
        check_float(op, "copy dtype", dt);
    }
    let (param, grad, m, v) = (
        contiguous(param),
        contiguous(grad),
        contiguous(m),
        contiguous(v),
    );
    let factor = contiguous(burn_cubecl::kernel::cast(factor, DType::F32));
    let dims = shape.as_slice().to_vec();
    let p_out = empty(&param, dims.clone(), DType::F32);
    let m_out = empty(&param, dims.clone(), DType::F32);
    let v_out = empty(&param, dims.clone(), DType::F32);
    let copy = copy_dtype.map(|dt| empty(&param, dims.clone(), dt));
    // Without a copy the kernel never touches that argument: a one-element stand-in fills it.
    let copy_arg = copy
        .clone()
        .unwrap_or_else(|| empty(&param, vec![1], DType::F32));
    let Some(e) = elementwise(&param, &[DType::F32, grad.dtype, copy_arg.dtype]) else {
        return (p_out, m_out, v_out, copy);
    };
    let (bc1, bc2) = hp.bias_corrections();
    let scalars = AdamWScalarsLaunch::new(
        hp.beta1 as f32,
        hp.beta2 as f32,
        hp.eps as f32,
        (hp.lr / bc1) as f32,
        (1.0 / bc2.sqrt()) as f32,
        (1.0 - hp.lr * hp.weight_decay) as f32,
    );
    let dtypes = [grad.dtype.into(), copy_arg.dtype.into()];
    adamw_kernel::launch::<R>(
        &param.client.clone(),
        e.count,
        e.dim,
        e.n,
        param.into_array_arg(),
        grad.into_array_arg(),
        m.into_array_arg(),
        v.into_array_arg(),
        factor.into_array_arg(),
        p_out.clone().into_array_arg(),
        m_out.clone().into_array_arg(),
        v_out.clone().into_array_arg(),
        copy_arg.into_array_arg(),
        scalars,
        e.total,
        copy.is_some(),
        dtypes,
    );
    (p_out, m_out, v_out, copy)
}

impl<R, F, I, BT> super::AdamWOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    #[allow(clippy::type_complexity)]
    fn fused_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        hp: &AdamWStep,
        copy_dtype: Option<burn::tensor::FloatDType>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        step(param, grad, m, v, factor, hp, copy_dtype.map(Into::into))
    }
}
