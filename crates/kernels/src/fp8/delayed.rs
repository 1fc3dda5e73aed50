//! Delayed per-tensor scaling: each per-tensor FP8 quantization of a run (a projection's input,
//! weight or output gradient: a *site*, named) takes its scale from the largest amax its site
//! recorded over the last `len` optimizer steps, instead of reading the tensor once more for its
//! own amax before quantizing it (current scaling). Values above that amax saturate.
//!
//! [`Fp8AmaxHistory`] holds every site's history on the device:
//! - within a step, every quantization of a site takes the same scale (the history's max as the
//!   step began), so micro-batches and recomputed forwards quantize alike; each raises the site's
//!   amax of the step to its tensor's amax (the CUDA C++ pair kernel from the read it quantizes
//!   from; other paths by an amax pass);
//! - [`Fp8AmaxHistory::advance`], after each optimizer step, moves the step's amaxes into the
//!   history (a ring of `len` steps) and takes the next step's scales, in three small launches
//!   for all sites together;
//! - a site without a recorded step (the first step of a run, or of a site) is scaled by its
//!   tensor's own amax (current scaling), and records it.
//!
//! Forwards that record nothing (evaluation, [`Fp8Record::No`]) take the scales without changing
//! the history, so evaluating does not change training. [`Fp8AmaxHistory::state`] and
//! [`Fp8AmaxHistory::restore`] carry the histories through a checkpoint.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::{s, DType, Tensor, TensorData};

use super::{
    fp8_pair_path, fp8_quantize, fp8_quantize_pair, Fp8Granularity, Fp8Ops, Fp8Tensor, PairSpec,
    QuantSpec,
};
use crate::gemm::GemmOps;

/// The roles of an FP8 linear layer's operands at its site: `{site}.{role}` names the history of
/// one operand ([`Fp8ScaleSite::quantize`]).
pub mod role {
    pub const INPUT: &str = "input";
    pub const WEIGHT: &str = "weight";
    pub const GRAD_OUTPUT: &str = "grad_output";
}

/// `x` quantized as `spec` says: scaled from `site`'s history at `role` where a site is given
/// and `spec` scales per tensor (delayed scaling), else from `x`'s own amaxes.
pub(crate) fn quantize_at<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    spec: QuantSpec,
    site: Option<&Fp8ScaleSite>,
    role: &str,
    record: Fp8Record,
) -> Fp8Tensor<B> {
    match site {
        Some(site) if spec.granularity == Fp8Granularity::Tensor => {
            site.quantize(role, x, spec, record)
        }
        _ => fp8_quantize(x, spec),
    }
}

/// [`fp8_quantize_pair`], scaled as [`quantize_at`] says.
pub(crate) fn quantize_pair_at<B: Fp8Ops + GemmOps>(
    x: Tensor<B, 2>,
    spec: PairSpec,
    site: Option<&Fp8ScaleSite>,
    role: &str,
    record: Fp8Record,
) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
    match site {
        Some(site) if spec.spec.granularity == Fp8Granularity::Tensor => {
            site.quantize_pair(role, x, spec.spec, record)
        }
        _ => fp8_quantize_pair(x, spec),
    }
}

/// The amax histories of a run's per-tensor FP8 quantizations (see the module docs). Clones share
/// the histories; a model replica on another device needs its own.
#[derive(Clone)]
pub struct Fp8AmaxHistory {
    state: Arc<Mutex<History>>,
}

impl std::fmt::Debug for Fp8AmaxHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = self.lock();
        f.debug_struct("Fp8AmaxHistory")
            .field("len", &h.len)
            .field("sites", &h.slots.len())
            .field("steps", &h.steps)
            .finish()
    }
}

struct History {
    /// Steps a site's scale looks back over.
    len: usize,
    /// Each site's row in the device buffers, by name.
    slots: HashMap<String, usize>,
    /// Sites (rows) below this have a recorded step and scale from their history.
    seeded: usize,
    /// [`Fp8AmaxHistory::advance`] calls so far.
    steps: u64,
    /// The device buffers, on the backend and device of the first quantization.
    buffers: Option<Box<dyn Buffers>>,
    /// Restored amaxes (`[sites, len]`, oldest first) waiting for the buffers to be created.
    restored: Option<Vec<f32>>,
}

/// The device buffers of a history, whatever their backend.
trait Buffers: Send {
    fn advance(&mut self);
    /// Row `slot`'s recorded amaxes, oldest first (reads the device).
    fn read_rows(&mut self, slots: &[usize]) -> Vec<Vec<f32>>;
    fn as_any(&mut self) -> &mut dyn Any;
}

/// A history on the host ([`Fp8AmaxHistory::state`], for checkpoints): each site with a recorded
/// step and its amaxes of the last `len` steps, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8AmaxHistoryState {
    pub len: usize,
    /// [`Fp8AmaxHistory::steps`].
    pub steps: u64,
    pub sites: Vec<(String, Vec<f32>)>,
}

/// f32s from one site's amax to the next in [`Device::scale_amax`]: 512 bytes, the alignment of
/// CubeCL's CUDA allocations, so that a site's slice starts and ends on it and is a view of the
/// buffer rather than a copy (a copy is a kernel and an upload for every quantization).
const SLOT_STRIDE: usize = 128;

/// `rows` sites (rows of the buffers, more than are used: they grow by doubling).
struct Device<B: BurnBackend> {
    rows: usize,
    /// `[rows, len]`: each site's amax in each of the last `len` steps; column `next` is the
    /// oldest, overwritten by the next advance.
    history: Tensor<B, 2>,
    next: usize,
    /// `[rows, SLOT_STRIDE]`: in column 0 the amax each site's quantizations take this step (its
    /// history's max), zeros after it.
    scale_amax: Tensor<B, 2>,
    /// `[rows]` f32: the largest amax each site's tensors had this step so far.
    seen: Tensor<B, 1>,
}

/// `[rows, 1]` amaxes as [`Device::scale_amax`] holds them: `SLOT_STRIDE` f32s a site.
fn strided<B: BurnBackend>(amax: Tensor<B, 2>) -> Tensor<B, 2> {
    let [rows, _] = amax.dims();
    let zeros = Tensor::zeros([rows, SLOT_STRIDE - 1], (&amax.device(), DType::F32));
    Tensor::cat(vec![amax, zeros], 1)
}

impl<B: BurnBackend> Device<B> {
    /// Buffers for `rows` sites holding `restored` (`[sites, len]`, oldest first; zeros past it).
    fn new(rows: usize, len: usize, restored: Option<Vec<f32>>, device: &B::Device) -> Self {
        let opts = (device, DType::F32);
        let mut values = restored.unwrap_or_default();
        let rows = rows.max(values.len() / len).next_power_of_two().max(64);
        values.resize(rows * len, 0.0);
        let history = Tensor::from_data(TensorData::new(values, [rows, len]), opts);
        Self {
            rows,
            scale_amax: strided(history.clone().max_dim(1)),
            history,
            // The oldest step is column 0.
            next: 0,
            seen: Tensor::zeros([rows], opts),
        }
    }

    /// Grows the buffers to hold row `slot` (new rows hold zeros).
    fn reserve(&mut self, slot: usize) {
        if slot < self.rows {
            return;
        }
        let rows = (slot + 1).next_power_of_two().max(64);
        let extra = rows - self.rows;
        let device = self.seen.device();
        let opts = (&device, DType::F32);
        let len = self.history.dims()[1];
        self.history = Tensor::cat(
            vec![self.history.clone(), Tensor::zeros([extra, len], opts)],
            0,
        );
        self.scale_amax = Tensor::cat(
            vec![
                self.scale_amax.clone(),
                Tensor::zeros([extra, SLOT_STRIDE], opts),
            ],
            0,
        );
        self.seen = Tensor::cat(vec![self.seen.clone(), Tensor::zeros([extra], opts)], 0);
        self.rows = rows;
    }

    /// Raises `seen[slot]` to `amax` (`[1]`).
    fn record(&mut self, slot: usize, amax: Tensor<B, 1>) {
        let raised = self.seen.clone().slice(s![slot..slot + 1]).max_pair(amax);
        self.seen = self.seen.clone().slice_assign(s![slot..slot + 1], raised);
    }
}

impl<B: BurnBackend> Buffers for Device<B> {
    fn advance(&mut self) {
        let len = self.history.dims()[1];
        let column = self.seen.clone().reshape([self.rows, 1]);
        self.history = self
            .history
            .clone()
            .slice_assign([0..self.rows, self.next..self.next + 1], column);
        self.next = (self.next + 1) % len;
        self.scale_amax = strided(self.history.clone().max_dim(1));
        self.seen = Tensor::zeros([self.rows], (&self.seen.device(), DType::F32));
    }
    fn read_rows(&mut self, slots: &[usize]) -> Vec<Vec<f32>> {
        let len = self.history.dims()[1];
        let all = self
            .history
            .clone()
            .into_data()
            .to_vec::<f32>()
            .expect("f32 amax history");
        slots
            .iter()
            .map(|&slot| {
                let row = &all[slot * len..(slot + 1) * len];
                (0..len).map(|i| row[(self.next + i) % len]).collect()
            })
            .collect()
    }
    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
}

impl Fp8AmaxHistory {
    /// Histories of `len` optimizer steps (at least 1: the previous step's amax alone).
    pub fn new(len: usize) -> Self {
        assert!(
            len >= 1,
            "Fp8AmaxHistory::new: len is 0; keep at least one step"
        );
        Self {
            state: Arc::new(Mutex::new(History {
                len,
                slots: HashMap::new(),
                seeded: 0,
                steps: 0,
                buffers: None,
                restored: None,
            })),
        }
    }

    /// The histories on the host (reads the device; sites that have not finished a step yet are
    /// left out).
    pub fn state(&self) -> Fp8AmaxHistoryState {
        let mut h = self.lock();
        let mut seeded: Vec<(String, usize)> = h
            .slots
            .iter()
            .filter(|(_, &slot)| slot < h.seeded)
            .map(|(name, &slot)| (name.clone(), slot))
            .collect();
        seeded.sort_by_key(|(_, slot)| *slot);
        let slots: Vec<usize> = seeded.iter().map(|(_, slot)| *slot).collect();
        let len = h.len;
        let History {
            buffers, restored, ..
        } = &mut *h;
        let rows = match (buffers.as_mut(), restored.as_ref()) {
            (Some(buffers), _) => buffers.read_rows(&slots),
            (None, Some(values)) => slots
                .iter()
                .map(|&s| values[s * len..(s + 1) * len].to_vec())
                .collect(),
            (None, None) => vec![vec![0.0; len]; slots.len()],
        };
        Fp8AmaxHistoryState {
            len: h.len,
            steps: h.steps,
            sites: seeded.into_iter().map(|(name, _)| name).zip(rows).collect(),
        }
    }

    /// Takes the histories of `state` (a resumed run), before this history's first use. Each
    /// site keeps its most recent `self.len()` steps where `state` kept more; where it kept fewer,
    /// the older steps are empty.
    pub fn restore(&self, state: &Fp8AmaxHistoryState) {
        let mut h = self.lock();
        assert!(
            h.buffers.is_none() && h.slots.is_empty(),
            "Fp8AmaxHistory::restore: the history is already in use"
        );
        let len = h.len;
        let mut values = Vec::with_capacity(state.sites.len() * len);
        for (slot, (name, amaxes)) in state.sites.iter().enumerate() {
            h.slots.insert(name.clone(), slot);
            let kept = &amaxes[amaxes.len().saturating_sub(len)..];
            values.extend(std::iter::repeat_n(0.0, len - kept.len()));
            values.extend_from_slice(kept);
        }
        h.seeded = state.sites.len();
        h.steps = state.steps;
        h.restored = Some(values);
    }

    fn lock(&self) -> MutexGuard<'_, History> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Steps a site's scale looks back over.
    pub fn len(&self) -> usize {
        self.lock().len
    }

    /// Whether no site has quantized yet.
    pub fn is_empty(&self) -> bool {
        self.lock().slots.is_empty()
    }

    /// Ends an optimizer step: every site's amax of the step joins its history, and the next
    /// step's scales are taken (on the device, without waiting for it).
    pub fn advance(&self) {
        let mut h = self.lock();
        h.steps += 1;
        h.seeded = h.slots.len();
        if let Some(buffers) = h.buffers.as_mut() {
            buffers.advance();
        }
    }

    /// [`Self::advance`] calls so far.
    pub fn steps(&self) -> u64 {
        self.lock().steps
    }

    /// The site named `name` of this history.
    pub fn site(&self, name: impl Into<String>) -> Fp8ScaleSite {
        Fp8ScaleSite {
            history: self.clone(),
            name: name.into(),
        }
    }
}

/// Whether a quantization records its tensor's amax into its site's history: training forwards
/// and backwards do, evaluation forwards do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Record {
    Yes,
    No,
}

/// A projection's sites in an [`Fp8AmaxHistory`]: `{name}.input`, `{name}.weight` and
/// `{name}.grad_output`.
#[derive(Clone, Debug)]
pub struct Fp8ScaleSite {
    history: Fp8AmaxHistory,
    name: String,
}

/// What one quantization takes from its site: the amax to scale by, and where its own goes.
struct Taken<B: BurnBackend> {
    /// The amax the quantization scales by, in its first element: `[1]`, or a site's
    /// `[SLOT_STRIDE]` row of the history's buffer.
    amax: Tensor<B, 1>,
    /// `[1]`: the tensor's own amax where it was already taken (a site without history).
    own: Option<Tensor<B, 1>>,
    slot: usize,
    /// `[rows]`: the buffer the step's amaxes are recorded in, where asked for and the site has
    /// a history (a site without one records the amax it already took).
    seen: Option<Tensor<B, 1>>,
}

impl Fp8ScaleSite {
    /// The device buffers for `B`, created on `x`'s device on first use, with room for `slot`.
    fn buffers<'h, B: BurnBackend>(
        h: &'h mut History,
        device: &B::Device,
        slot: usize,
    ) -> &'h mut Device<B> {
        let len = h.len;
        if h.buffers.is_none() {
            let restored = h.restored.take();
            h.buffers = Some(Box::new(Device::<B>::new(slot + 1, len, restored, device)));
        }
        let buffers = h.buffers.as_mut().expect("created above");
        let Some(device_buffers) = buffers.as_any().downcast_mut::<Device<B>>() else {
            panic!(
                "kernels::fp8: an Fp8AmaxHistory is used on two backends; give each model replica its own"
            );
        };
        device_buffers.reserve(slot);
        device_buffers
    }

    /// The amax the quantization of `x` at `role` takes, and where to record its own (`seen`
    /// when `want_seen`).
    fn take<B: Fp8Ops>(&self, role: &str, x: &Tensor<B, 2>, want_seen: bool) -> Taken<B> {
        let slot = match self.take_seeded::<B>(role, &x.device(), want_seen) {
            Ok(taken) => return taken,
            Err(slot) => slot,
        };
        let own =
            crate::primitive::tensor::<B, 1>(B::fp8_tensor_amax(crate::primitive::prim(x.clone())));
        Taken {
            amax: own.clone(),
            own: Some(own),
            slot,
            seen: None,
        }
    }

    /// [`Self::take`] where the site's history at `role` has an amax (every step after its
    /// first); else its slot.
    fn take_seeded<B: Fp8Ops>(
        &self,
        role: &str,
        device: &B::Device,
        want_seen: bool,
    ) -> Result<Taken<B>, usize> {
        let mut h = self.history.lock();
        let key = format!("{}.{role}", self.name);
        let next = h.slots.len();
        let slot = *h.slots.entry(key).or_insert(next);
        let seeded = slot < h.seeded;
        let buffers = Self::buffers::<B>(&mut h, device, slot);
        if !seeded {
            return Err(slot);
        }
        Ok(Taken {
            amax: buffers
                .scale_amax
                .clone()
                .slice(s![slot..slot + 1, 0..SLOT_STRIDE])
                .reshape([SLOT_STRIDE]),
            own: None,
            slot,
            seen: want_seen.then(|| buffers.seen.clone()),
        })
    }

    /// Raises the site's amax of the step to `x`'s (`own` where already taken).
    fn record<B: Fp8Ops>(&self, slot: usize, x: Tensor<B, 2>, own: Option<Tensor<B, 1>>) {
        let amax = own.unwrap_or_else(|| {
            crate::primitive::tensor::<B, 1>(B::fp8_tensor_amax(crate::primitive::prim(x)))
        });
        let device = amax.device();
        let mut h = self.history.lock();
        Self::buffers::<B>(&mut h, &device, slot).record(slot, amax);
    }

    /// `x` quantized as the per-tensor `spec` says (panics for another granularity), scaled from
    /// the site's history at `role` (`"input"`, `"weight"`, `"grad_output"` in the FP8 linear
    /// layer; any name in layers of one's own).
    pub fn quantize<B: Fp8Ops + GemmOps>(
        &self,
        role: &str,
        x: Tensor<B, 2>,
        spec: QuantSpec,
        record: Fp8Record,
    ) -> Fp8Tensor<B> {
        check_spec(&spec);
        let taken = self.take(role, &x, false);
        let dims = x.dims();
        let parts = B::fp8_quantize_given(
            x.clone().into_primitive().tensor(),
            &spec,
            crate::primitive::prim(taken.amax),
        );
        if record == Fp8Record::Yes {
            self.record(taken.slot, x, taken.own);
        }
        Fp8Tensor::from_parts(parts, dims, spec)
    }

    /// [`super::fp8_quantize_pair`] under the per-tensor `spec`, scaled from the site's history at
    /// `role` as [`Self::quantize`] is; where the pair kernel can record `x`'s amax from its own
    /// read, it does.
    pub fn quantize_pair<B: Fp8Ops + GemmOps>(
        &self,
        role: &str,
        x: Tensor<B, 2>,
        spec: QuantSpec,
        record: Fp8Record,
    ) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
        check_spec(&spec);
        let taken = self.take(role, &x, record == Fp8Record::Yes);
        let dims = x.dims();
        let in_kernel = taken
            .seen
            .map(|seen| (crate::primitive::prim(seen), taken.slot));
        let (parts, recorded) = B::fp8_quantize_pair_given(
            x.clone().into_primitive().tensor(),
            &spec,
            fp8_pair_path(&spec),
            crate::primitive::prim(taken.amax),
            in_kernel,
        );
        if record == Fp8Record::Yes && !recorded {
            self.record(taken.slot, x, taken.own);
        }
        Fp8Tensor::pair_from_parts(parts, dims, spec.into())
    }
}

impl Fp8ScaleSite {
    /// `act` of `h` (with `dy`, its gradient with respect to `h`) quantized in both orientations
    /// as [`Self::quantize_pair`] quantizes it: by the kernel that computes it
    /// ([`super::fp8_act_quantize_pair`]'s), which records the amax from its own values, where
    /// the history at `role` has an amax to scale by and that kernel runs; otherwise the
    /// activation's kernel and then [`Self::quantize_pair`].
    pub fn quantize_act_pair<B: Fp8Ops + GemmOps + crate::activation::ActivationKernels>(
        &self,
        role: &str,
        h: Tensor<B, 2>,
        dy: Option<Tensor<B, 2>>,
        act: super::Fp8MlpActivation,
        spec: QuantSpec,
        record: Fp8Record,
    ) -> (Fp8Tensor<B>, Fp8Tensor<B>) {
        check_spec(&spec);
        let dims = act.out_dims(h.dims(), dy.is_some());
        if fp8_pair_path(&spec) == super::Fp8PairPath::Native {
            if let Ok(taken) = self.take_seeded::<B>(role, &h.device(), record == Fp8Record::Yes) {
                let in_kernel = taken
                    .seen
                    .map(|seen| (crate::primitive::prim(seen), taken.slot));
                let fused = B::fp8_act_quantize_pair(
                    crate::primitive::prim(h.clone()),
                    dy.clone().map(crate::primitive::prim),
                    act,
                    &spec.into(),
                    Some((crate::primitive::prim(taken.amax), in_kernel)),
                );
                if let Some((parts, recorded)) = fused {
                    if record == Fp8Record::Yes && !recorded {
                        let values = super::producer::act_values(h, dy, act);
                        self.record(taken.slot, values, None);
                    }
                    return Fp8Tensor::pair_from_parts(parts, dims, spec.into());
                }
            }
        }
        let values = super::producer::act_values(h, dy, act);
        self.quantize_pair(role, values, spec, record)
    }
}

fn check_spec(spec: &QuantSpec) {
    assert_eq!(
        spec.granularity,
        Fp8Granularity::Tensor,
        "kernels::fp8: delayed scaling applies to per-tensor scaling only"
    );
}
