//! AdamW with decoupled weight decay (PyTorch semantics), global-norm gradient clipping and a
//! per-parameter decay mask.
//!
//! Burn's own AdamW clips each tensor separately, decays every parameter and uses other defaults,
//! so the trainer carries its own: the global gradient norm is reduced on the device (in f32), the
//! clip factor and the loss-scale division stay on the device, and the only host round trip per
//! step is the trainer's read of the loss and the norm (which also tells it whether the gradients
//! are finite).

use std::collections::{HashMap, HashSet};

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};

use crate::config::OptimizerConfig;

/// First and second moments of one parameter, rank-erased.
#[derive(Clone)]
pub struct Moments<B: Backend> {
    pub m: FloatTensor<B>,
    pub v: FloatTensor<B>,
}

/// A rank-erased moment as a tensor of rank `D`.
pub(crate) fn to_tensor<B: Backend, const D: usize>(p: &FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p.clone()))
}

/// A tensor as a rank-erased primitive.
pub(crate) fn to_prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `t` as a parameter value that requires a gradient when the one it replaces did (`grad`).
pub(crate) fn with_grad<AB: AutodiffBackend, const D: usize>(
    t: Tensor<AB, D>,
    grad: bool,
) -> Tensor<AB, D> {
    if grad {
        t.require_grad()
    } else {
        t
    }
}

/// The optimizer and its state. `B` is the inner (non-autodiff) backend.
#[derive(Clone)]
pub struct AdamW<B: Backend> {
    pub cfg: OptimizerConfig,
    /// Optimizer steps taken (the bias-correction counter).
    pub step: u64,
    pub moments: HashMap<ParamId, Moments<B>>,
    /// Parameters that weight decay skips besides the vectors (norm gains, biases).
    pub no_decay: HashSet<ParamId>,
    /// Use the fused AdamW kernel (`model.kernels = "fused"`) instead of plain Burn ops.
    pub fused: bool,
    /// With `fused`: the parameters whose low-precision compute copy the kernel also writes, and
    /// its dtype. The copies land in `copies` for the next step's
    /// [`model::Gpt::compute_copy_with`].
    pub copy: Option<(FloatDType, HashSet<ParamId>)>,
    pub copies: HashMap<ParamId, FloatTensor<B>>,
    /// ZeRO-1 (`training.zero = 1`): the parameters this rank updates and keeps moments of; the
    /// others' gradients are dropped (their owners update them). `None` updates every parameter.
    pub owned: Option<HashSet<ParamId>>,
}

impl<B: Backend> AdamW<B> {
    pub fn new(cfg: OptimizerConfig, no_decay: HashSet<ParamId>) -> Self {
        Self {
            cfg,
            step: 0,
            moments: HashMap::new(),
            no_decay,
            fused: false,
            copy: None,
            copies: HashMap::new(),
            owned: None,
        }
    }

    /// A copy of this optimizer's state on `device` (another rank's, in a data-parallel run).
    pub fn fork(&self, device: &B::Device) -> Self {
        let to = |t: &FloatTensor<B>| B::float_to_device(t.clone(), device);
        Self {
            cfg: self.cfg.clone(),
            step: self.step,
            moments: self
                .moments
                .iter()
                .map(|(id, m)| {
                    (
                        *id,
                        Moments {
                            m: to(&m.m),
                            v: to(&m.v),
                        },
                    )
                })
                .collect(),
            no_decay: self.no_decay.clone(),
            fused: self.fused,
            copy: self.copy.clone(),
            copies: self.copies.iter().map(|(id, c)| (*id, to(c))).collect(),
            owned: self.owned.clone(),
        }
    }

    /// Switches to the fused kernel; with `copy`, it also writes those parameters in that dtype.
    pub fn with_fused(mut self, copy: Option<(FloatDType, HashSet<ParamId>)>) -> Self {
        self.fused = true;
        self.copy = copy;
        self
    }

    /// Global L2 norm of all gradients, as a device tensor of shape [1]: one read of each
    /// gradient in the dtype it has (bf16, f16 or f32), summed in f32 ([`kernels::SumSquares`]).
    pub fn grad_norm<AB, M>(module: &M, grads: &GradientsParams) -> Tensor<B, 1>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        B: kernels::Backend,
        M: AutodiffModule<AB>,
    {
        match Self::grad_sum_squares::<AB, M>(module, grads) {
            Some(sq) => sq.sqrt(),
            None => panic!("no parameter received a gradient"),
        }
    }

    /// The sum of the squares of every gradient in `grads` (shape [1], on the device), read as
    /// [`AdamW::grad_norm`] reads them; `None` when `grads` holds none of `module`'s parameters.
    pub fn grad_sum_squares<AB, M>(module: &M, grads: &GradientsParams) -> Option<Tensor<B, 1>>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        B: kernels::Backend,
        M: AutodiffModule<AB>,
    {
        let mut v = NormVisitor::<AB> { grads, sum: None };
        module.visit(&mut v);
        v.sum.map(|sq| sq.finish())
    }

    /// One AdamW step at learning rate `lr` on gradients that are `loss_scale` times the true ones
    /// (1 without loss scaling). `scaled_norm` is [`AdamW::grad_norm`] of those gradients (shape
    /// [1], on the device). The gradients are divided by the scale before clipping; both factors
    /// are applied in the update itself, without a pass of their own.
    pub fn step<AB, M>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
        scaled_norm: Tensor<B, 1>,
        loss_scale: f64,
    ) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        B: kernels::Backend,
        M: AutodiffModule<AB>,
    {
        let inv_scale = 1.0 / loss_scale;
        // Gradient factor (1 / scale) * min(1, clip / true_norm), kept on the device as one scalar
        // shared by every parameter's update.
        let factor = if self.cfg.grad_clip > 0.0 {
            let norm = scaled_norm.mul_scalar(inv_scale);
            (norm + 1e-6)
                .recip()
                .mul_scalar(self.cfg.grad_clip)
                .clamp_max(1.0)
                .mul_scalar(inv_scale)
        } else {
            let device = scaled_norm.device();
            Tensor::from_data(
                burn::tensor::TensorData::new(vec![inv_scale as f32], [1]),
                (&device, burn::tensor::DType::F32),
            )
        };
        self.step += 1;
        self.copies.clear();
        let mut upd = Updater::<AB> {
            opt: self,
            grads: &mut grads,
            lr,
            factor,
        };
        module.map(&mut upd)
    }
}

/// Casts every gradient of `module`'s parameters to f32 in place (gradients of low-precision
/// compute copies arrive in bf16 or f16); f32 gradients are left untouched. The optimizer does not
/// need it ([`AdamW::grad_norm`] and [`AdamW::step`] read any float dtype in f32); the
/// data-parallel mean over ranks does.
pub fn grads_to_f32<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &mut GradientsParams,
) {
    struct ToF32<'a> {
        grads: &'a mut GradientsParams,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for ToF32<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
                if g.dtype() != FloatDType::F32.into() {
                    self.grads
                        .register::<AB::InnerBackend, D>(param.id, g.cast(FloatDType::F32));
                }
            }
        }
    }
    module.visit(&mut ToF32 { grads });
}

/// `a + b` for every parameter of `module`, in f32, one pass per parameter
/// ([`kernels::add_as_f32`]: a bf16 or f16 gradient is cast as it is added): the gradients of
/// micro-batches summed. A parameter with a gradient in only one of them keeps that gradient.
pub fn accumulate_grads<AB, M>(
    module: &M,
    a: GradientsParams,
    b: GradientsParams,
) -> GradientsParams
where
    AB: AutodiffBackend,
    AB::InnerBackend: kernels::Backend,
    M: AutodiffModule<AB>,
{
    struct Sum {
        a: GradientsParams,
        b: GradientsParams,
        out: GradientsParams,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Sum
    where
        AB::InnerBackend: kernels::Backend,
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let id = param.id;
            let a = self.a.remove::<AB::InnerBackend, D>(id);
            let b = self.b.remove::<AB::InnerBackend, D>(id);
            let sum = match (a, b) {
                (Some(a), Some(b)) => kernels::add_as_f32(a, b),
                (Some(g), None) | (None, Some(g)) => g,
                (None, None) => return,
            };
            self.out.register::<AB::InnerBackend, D>(id, sum);
        }
    }
    let mut sum = Sum {
        a,
        b,
        out: GradientsParams::new(),
    };
    module.visit(&mut sum);
    sum.out
}

/// Overwrites the first parameter's gradient with non-finite values (inf where it was non-zero, NaN
/// where it was zero), as an overflowing low-precision backward would: a fault-injection aid for
/// checking how a run handles overflow.
pub fn poison_grads<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
    grads: &mut GradientsParams,
) {
    struct Poison<'a> {
        grads: &'a mut GradientsParams,
        done: bool,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Poison<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if self.done {
                return;
            }
            if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
                self.grads
                    .register::<AB::InnerBackend, D>(param.id, g.mul_scalar(f64::INFINITY));
                self.done = true;
            }
        }
    }
    module.visit(&mut Poison { grads, done: false });
}

struct NormVisitor<'a, AB: AutodiffBackend>
where
    AB::InnerBackend: kernels::Backend,
{
    grads: &'a GradientsParams,
    /// Created at the first gradient.
    sum: Option<kernels::SumSquares<AB::InnerBackend>>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for NormVisitor<'_, AB>
where
    AB::InnerBackend: kernels::Backend,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
            self.sum
                .get_or_insert_with(|| kernels::SumSquares::new(&g.device()))
                .add(g);
        }
    }
}

struct Updater<'a, AB: AutodiffBackend> {
    opt: &'a mut AdamW<AB::InnerBackend>,
    grads: &'a mut GradientsParams,
    lr: f64,
    /// [1] f32: multiplies every gradient before the update.
    factor: Tensor<AB::InnerBackend, 1>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Updater<'_, AB>
where
    AB::InnerBackend: kernels::Backend,
{
    /// One parameter's update: the fused AdamW kernel (which may also write the compute copy), or
    /// the same arithmetic in plain Burn ops (`kernels::adamw::reference`).
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<AB::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        if self.opt.owned.as_ref().is_some_and(|o| !o.contains(&id)) {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let require_grad = tensor.is_require_grad();
        let x = tensor.inner();
        let cfg = &self.opt.cfg;
        let decays = D >= 2 && !self.opt.no_decay.contains(&id);
        let hp = kernels::AdamWStep {
            lr: self.lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: if decays { cfg.weight_decay } else { 0.0 },
            t: self.opt.step,
        };
        let (m, v) = match self.opt.moments.get(&id) {
            Some(s) => (to_tensor::<_, D>(&s.m), to_tensor::<_, D>(&s.v)),
            None => (x.zeros_like(), x.zeros_like()),
        };
        let factor = self.factor.clone();
        let out = if self.opt.fused {
            let copy_dtype = self
                .opt
                .copy
                .as_ref()
                .and_then(|(dt, ids)| ids.contains(&id).then_some(*dt));
            kernels::adamw_step(x, grad, m, v, factor, &hp, copy_dtype)
        } else {
            kernels::adamw::reference(x, grad, m, v, factor, &hp, None)
        };
        self.opt.moments.insert(
            id,
            Moments {
                m: to_prim(out.m),
                v: to_prim(out.v),
            },
        );
        if let Some(c) = out.copy {
            self.opt.copies.insert(id, to_prim(c));
        }
        let out = with_grad(Tensor::from_inner(out.param), require_grad);
        Param::from_mapped_value(id, out, mapper)
    }
}
