//! Collectives between processes, one GPU each: an NCCL communicator joined from a unique id that
//! the caller hands every process (the trainer's TCP rendezvous carries it), and all-reduce,
//! reduce-scatter, all-gather, reduce (to one rank) and broadcast on CubeCL's CUDA tensors.
//!
//! The calls are queued on CubeCL's device thread, behind the work queued before them, and issued
//! on CubeCL's own CUDA stream (found as the GEMMs find it, `crate::cuda_stream`): they run on
//! the GPU in order with the kernels and GEMMs around them, and the caller does not wait. Where
//! that stream cannot be found, a call synchronises CubeCL's stream, runs on the communicator's
//! own stream and waits for it (warned once).
//!
//! All-gathers also carry integer tensors ([`Flat::Int`]: FP8 codes packed four to an element, say),
//! bytes for bytes; the reductions take float tensors only. [`ProcessGroup::all_gather_group`]
//! gathers several tensors, of either kind, as one NCCL launch.
//!
//! [`ProcessGroup::all_reduce_overlapped`] and [`ProcessGroup::all_gather_overlapped`] run instead
//! on the group's own stream, behind an event that CubeCL's stream records, so that the kernels
//! queued after them run meanwhile (a gradient bucket's reduction beside the rest of the backward,
//! the next layer's weights gathered beside this one's forward; the latter's calls go to NCCL as
//! one group, one launch); [`ProcessGroup::wait_overlapped`] makes CubeCL's stream wait for them
//! before their results are read. The caller keeps overlapped calls from running beside calls in
//! CubeCL's order: it waits for them before it issues one of those.
//!
//! A call that NCCL refuses is not retried: the error is kept ([`ProcessGroup::error`]), the
//! communicator is aborted so that the other processes' calls fail instead of waiting, and later
//! calls are not issued. Callers check [`ProcessGroup::error`] where a step ends.
//!
//! - `comm.rs`: the communicator (joining, abort, NCCL's error text);
//! - `call.rs`: one call, issued on the device thread.
//!
//! ```no_run
//! # fn run(device: burn::backend::cuda::CudaDevice, rank: usize, world: usize) -> Result<(), String> {
//! use burn::backend::Cuda;
//! use burn::tensor::Tensor;
//! // Rank 0 draws the id and hands it to every rank (over TCP, say).
//! let id = kernels::collective::unique_id()?;
//! let group = kernels::collective::ProcessGroup::join::<Cuda>(&device, &id, rank, world)?;
//! let grads = Tensor::<Cuda, 1>::ones([1000], &device);
//! let mean = group.all_reduce(grads, kernels::collective::ReduceOp::Mean);
//! group.check()?;
//! # Ok(()) }
//! ```

mod call;
mod comm;

use std::any::Any;
use std::sync::Arc;

use std::sync::atomic::Ordering;

use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;

use call::{Call, Kind};
use comm::Comm;

pub use comm::{library, unique_id, UNIQUE_ID_BYTES};

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the number of ranks (NCCL's `ncclAvg`).
    Mean,
}

/// A backend whose float tensors the collectives take: CubeCL's backends (on CUDA only; a tensor
/// of another runtime panics, naming the call).
pub trait CollectiveBackend: burn::tensor::backend::Backend {
    /// The tensor as CubeCL's CUDA tensor, or `None` on another runtime.
    #[doc(hidden)]
    fn as_cuda(t: burn::tensor::ops::FloatTensor<Self>) -> Option<CubeTensor<CudaRuntime>>;
    /// The inverse of [`CollectiveBackend::as_cuda`].
    #[doc(hidden)]
    fn from_cuda(t: CubeTensor<CudaRuntime>) -> burn::tensor::ops::FloatTensor<Self>;
    /// The integer tensor as CubeCL's CUDA tensor, or `None` on another runtime.
    #[doc(hidden)]
    fn int_as_cuda(t: burn::tensor::ops::IntTensor<Self>) -> Option<CubeTensor<CudaRuntime>>;
    /// The inverse of [`CollectiveBackend::int_as_cuda`].
    #[doc(hidden)]
    fn int_from_cuda(t: CubeTensor<CudaRuntime>) -> burn::tensor::ops::IntTensor<Self>;
    /// The CUDA device's index, or `None` for a device of another runtime.
    #[doc(hidden)]
    fn cuda_index(device: &Self::Device) -> Option<usize>;
}

/// A flat tensor that an all-gather carries: float values, or integers (which the gather moves
/// as they are, bytes for bytes).
pub enum Flat<B: burn::tensor::backend::Backend> {
    Float(Tensor<B, 1>),
    Int(Tensor<B, 1, Int>),
}

impl<B: burn::tensor::backend::Backend> Flat<B> {
    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            Flat::Float(t) => t.dims()[0],
            Flat::Int(t) => t.dims()[0],
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The float tensor.
    ///
    /// # Panics
    /// If it holds integers.
    pub fn float(self) -> Tensor<B, 1> {
        match self {
            Flat::Float(t) => t,
            Flat::Int(_) => panic!("an integer tensor where a float one was expected"),
        }
    }

    /// The integer tensor.
    ///
    /// # Panics
    /// If it holds floats.
    pub fn int(self) -> Tensor<B, 1, Int> {
        match self {
            Flat::Int(t) => t,
            Flat::Float(_) => panic!("a float tensor where an integer one was expected"),
        }
    }
}

impl<R, F, I, BT> CollectiveBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn as_cuda(t: CubeTensor<R>) -> Option<CubeTensor<CudaRuntime>> {
        (Box::new(t) as Box<dyn Any>)
            .downcast::<CubeTensor<CudaRuntime>>()
            .ok()
            .map(|t| *t)
    }
    fn from_cuda(t: CubeTensor<CudaRuntime>) -> CubeTensor<R> {
        *(Box::new(t) as Box<dyn Any>)
            .downcast::<CubeTensor<R>>()
            .expect("a CUDA tensor came from this backend")
    }
    fn int_as_cuda(t: CubeTensor<R>) -> Option<CubeTensor<CudaRuntime>> {
        Self::as_cuda(t)
    }
    fn int_from_cuda(t: CubeTensor<CudaRuntime>) -> CubeTensor<R> {
        Self::from_cuda(t)
    }
    fn cuda_index(device: &R::Device) -> Option<usize> {
        (device as &dyn Any)
            .downcast_ref::<cubecl::cuda::CudaDevice>()
            .map(|d| d.index)
    }
}

/// Burn's CPU backend: no tensor of it reaches a process group (runs of processes train on CUDA);
/// it implements the trait so that code generic over training backends compiles for it.
impl CollectiveBackend for burn::backend::NdArray {
    fn as_cuda(_: burn::tensor::ops::FloatTensor<Self>) -> Option<CubeTensor<CudaRuntime>> {
        None
    }
    fn from_cuda(_: CubeTensor<CudaRuntime>) -> burn::tensor::ops::FloatTensor<Self> {
        unreachable!("no NdArray tensor is on CUDA")
    }
    fn int_as_cuda(_: burn::tensor::ops::IntTensor<Self>) -> Option<CubeTensor<CudaRuntime>> {
        None
    }
    fn int_from_cuda(_: CubeTensor<CudaRuntime>) -> burn::tensor::ops::IntTensor<Self> {
        unreachable!("no NdArray tensor is on CUDA")
    }
    fn cuda_index(_: &Self::Device) -> Option<usize> {
        None
    }
}

/// This process's membership of a group of processes, one GPU each: an NCCL communicator. Clones
/// share it. Every rank must make the same calls, in the same order, on tensors of the same
/// dtype and number of elements.
#[derive(Clone)]
pub struct ProcessGroup {
    comm: Arc<Comm>,
}

impl ProcessGroup {
    /// Joins the group of `world` processes as `rank`, on `device` (a CUDA device of backend
    /// `B`), from the unique id that [`unique_id`] drew on one rank. Blocks until every rank has
    /// joined (NCCL's `ncclCommInitRank`).
    pub fn join<B: CollectiveBackend>(
        device: &B::Device,
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world: usize,
    ) -> Result<Self, String> {
        let index = B::cuda_index(device).ok_or_else(|| {
            "kernels::collective: a process group needs a CUDA device (NCCL); this device is on another runtime".to_string()
        })?;
        if world == 0 || rank >= world {
            return Err(format!(
                "kernels::collective: rank {rank} is not in a group of {world} processes (ranks 0..{world})"
            ));
        }
        let comm = Comm::join(index, id, rank, world)?;
        Ok(Self {
            comm: Arc::new(comm),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank
    }

    /// How many processes the group has.
    pub fn world(&self) -> usize {
        self.comm.world
    }

    /// The sum or mean (`op`) of `t` over the ranks, in `t`'s shape and dtype.
    ///
    /// # Panics
    /// If `t` is not a CUDA tensor.
    pub fn all_reduce<B: CollectiveBackend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        op: ReduceOp,
    ) -> Tensor<B, D> {
        let shape = t.shape();
        let buf = dense::<B, D>(t, "all_reduce");
        self.issue(Kind::AllReduce(op), buf.clone(), buf.clone());
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::from_cuda(buf))).reshape(shape)
    }

    /// Reduce-scatter: the sum or mean (`op`) over the ranks of `t`'s elements (in row-major
    /// order, `world * n` of them), of which this rank keeps elements `rank * n .. (rank + 1) *
    /// n`, as a tensor of `n`.
    ///
    /// # Panics
    /// If `t` is not a CUDA tensor, or its element count is not a multiple of the world size.
    pub fn reduce_scatter<B: CollectiveBackend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        op: ReduceOp,
    ) -> Tensor<B, 1> {
        let total = t.shape().num_elements();
        let world = self.world();
        assert!(
            total.is_multiple_of(world),
            "kernels::collective::reduce_scatter: {total} elements (shape {:?}) do not split into {world} equal shares",
            t.dims()
        );
        let out = Tensor::<B, 1>::empty([total / world], (&t.device(), t.dtype()));
        let send = dense::<B, D>(t, "reduce_scatter");
        let recv = cuda::<B>(out.clone().into_primitive().tensor(), "reduce_scatter");
        self.issue(Kind::ReduceScatter(op), send, recv);
        out
    }

    /// All-gather: every rank's `t` (`n` elements each, the same `n` on every rank), rank 0's
    /// first, as one tensor of `world * n`.
    ///
    /// # Panics
    /// If `t` is not a CUDA tensor.
    pub fn all_gather<B: CollectiveBackend, const D: usize>(
        &self,
        t: Tensor<B, D>,
    ) -> Tensor<B, 1> {
        let n = t.shape().num_elements();
        let out = Tensor::<B, 1>::empty([n * self.world()], (&t.device(), t.dtype()));
        let send = dense::<B, D>(t, "all_gather");
        let recv = cuda::<B>(out.clone().into_primitive().tensor(), "all_gather");
        self.issue(Kind::AllGather, send, recv);
        out
    }

    /// Reduce to one rank: on rank `root`, the sum or mean (`op`) of `t` over the ranks, in `t`'s
    /// shape and dtype; on the other ranks the result holds nothing to read (NCCL writes it on
    /// `root` only).
    ///
    /// # Panics
    /// If `t` is not a CUDA tensor, or `root` is not a rank of the group.
    pub fn reduce<B: CollectiveBackend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        op: ReduceOp,
        root: usize,
    ) -> Tensor<B, D> {
        self.check_root(root, "reduce");
        let shape = t.shape();
        let buf = dense::<B, D>(t, "reduce");
        self.issue(Kind::Reduce { op, root }, buf.clone(), buf.clone());
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::from_cuda(buf))).reshape(shape)
    }

    /// Broadcast: rank `root`'s `t` on every rank, in `t`'s shape and dtype (the other ranks' `t`
    /// gives only the shape and dtype; its values are overwritten).
    ///
    /// # Panics
    /// If `t` is not a CUDA tensor, or `root` is not a rank of the group.
    pub fn broadcast<B: CollectiveBackend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        root: usize,
    ) -> Tensor<B, D> {
        self.check_root(root, "broadcast");
        let shape = t.shape();
        let buf = dense::<B, D>(t, "broadcast");
        self.issue(Kind::Broadcast { root }, buf.clone(), buf.clone());
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::from_cuda(buf))).reshape(shape)
    }

    fn check_root(&self, root: usize, what: &str) {
        assert!(
            root < self.world(),
            "kernels::collective::{what}: root {root} is not a rank of this group of {} processes",
            self.world()
        );
    }

    /// The first error of the group's calls (NCCL's refusal, a tensor not on CUDA, an abort), or
    /// `Ok`. Once there is one, no later call is issued.
    pub fn check(&self) -> Result<(), String> {
        match self.comm.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Aborts the communicator (NCCL's `ncclCommAbort`): calls in flight on this rank end, the
    /// other ranks' calls fail instead of waiting for this one, and no later call is issued.
    /// For a rank that leaves a run because another rank failed or a signal asked it to stop.
    pub fn abort(&self, why: &str) {
        self.comm.abort(why);
    }

    /// [`ProcessGroup::all_reduce`] beside CubeCL's later work: the call runs on the group's own
    /// stream once CubeCL's stream has produced `t`, while kernels queued after it run. Its result
    /// may be read only after [`ProcessGroup::wait_overlapped`]. Every rank issues the same
    /// overlapped calls in the same order, as for the others.
    ///
    /// # Panics
    /// If `t` is not a CUDA tensor.
    pub fn all_reduce_overlapped<B: CollectiveBackend, const D: usize>(
        &self,
        t: Tensor<B, D>,
        op: ReduceOp,
    ) -> Tensor<B, D> {
        let shape = t.shape();
        let buf = dense::<B, D>(t, "all_reduce_overlapped");
        let call = Call {
            kind: Kind::AllReduce(op),
            send: buf.clone(),
            recv: buf.clone(),
            overlapped: true,
        };
        call::issue(&self.comm, call);
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::from_cuda(buf))).reshape(shape)
    }

    /// [`ProcessGroup::all_gather`] of every tensor of `ts` (each gathered on its own, in its
    /// dtype, floats and integers alike) as one NCCL launch, in CubeCL's order: for the parts of
    /// one value that travel apart (FP8 codes and their scales).
    ///
    /// # Panics
    /// If a tensor is not a CUDA tensor.
    pub fn all_gather_group<B: CollectiveBackend>(&self, ts: Vec<Flat<B>>) -> Vec<Flat<B>> {
        let (outs, calls) = self.gather_calls(ts, false, "all_gather_group");
        call::issue_group(&self.comm, calls);
        outs
    }

    /// [`ProcessGroup::all_gather_group`] beside CubeCL's later work: the calls run on the
    /// group's own stream once CubeCL's stream has produced the inputs. The results may be read
    /// only after [`ProcessGroup::wait_overlapped`]. For gathering the next layer's weights while
    /// this one computes.
    ///
    /// # Panics
    /// If a tensor is not a CUDA tensor.
    pub fn all_gather_overlapped<B: CollectiveBackend>(&self, ts: Vec<Flat<B>>) -> Vec<Flat<B>> {
        let (outs, calls) = self.gather_calls(ts, true, "all_gather_overlapped");
        call::issue_group(&self.comm, calls);
        outs
    }

    /// Bytes that this rank's all-gathers have received so far (every rank's shares, its own
    /// included), counted as they are issued.
    pub fn gathered_bytes(&self) -> u64 {
        self.comm.gathered_bytes.load(Ordering::Relaxed)
    }

    /// The outputs and calls of an all-gather of each of `ts`.
    fn gather_calls<B: CollectiveBackend>(
        &self,
        ts: Vec<Flat<B>>,
        overlapped: bool,
        what: &str,
    ) -> (Vec<Flat<B>>, Vec<Call>) {
        let world = self.world();
        let mut outs = Vec::with_capacity(ts.len());
        let mut calls = Vec::with_capacity(ts.len());
        for t in ts {
            let n = t.len();
            let (send, recv, out) = match t {
                Flat::Float(t) => {
                    let out = Tensor::<B, 1>::empty([n * world], (&t.device(), t.dtype()));
                    let recv = cuda::<B>(out.clone().into_primitive().tensor(), what);
                    (dense::<B, 1>(t, what), recv, Flat::Float(out))
                }
                Flat::Int(t) => {
                    let out = Tensor::<B, 1, Int>::empty([n * world], (&t.device(), t.dtype()));
                    let recv = int_cuda::<B>(out.clone().into_primitive(), what);
                    (dense_int::<B>(t, what), recv, Flat::Int(out))
                }
            };
            calls.push(Call {
                kind: Kind::AllGather,
                send,
                recv,
                overlapped,
            });
            outs.push(out);
        }
        (outs, calls)
    }

    /// Makes CubeCL's stream on `device` wait for the overlapped calls issued so far: work queued
    /// after this reads their results. The caller does not wait.
    pub fn wait_overlapped<B: CollectiveBackend>(&self, device: &B::Device) {
        let Some(index) = B::cuda_index(device) else {
            return;
        };
        let like = Tensor::<B, 1>::empty([1], device);
        let like = cuda::<B>(like.into_primitive().tensor(), "wait_overlapped");
        debug_assert_eq!(index, like.device.index);
        call::wait_overlapped(&self.comm, like);
    }

    fn issue(&self, kind: Kind, send: CubeTensor<CudaRuntime>, recv: CubeTensor<CudaRuntime>) {
        let overlapped = false;
        call::issue(
            &self.comm,
            Call {
                kind,
                send,
                recv,
                overlapped,
            },
        );
    }
}

/// `t` as CubeCL's CUDA tensor.
///
/// # Panics
/// If it is on another runtime, naming the call (`what`).
fn cuda<B: CollectiveBackend>(
    t: burn::tensor::ops::FloatTensor<B>,
    what: &str,
) -> CubeTensor<CudaRuntime> {
    on_cuda(B::as_cuda(t), what)
}

/// The integer tensor `t` as CubeCL's CUDA tensor.
///
/// # Panics
/// If it is on another runtime, naming the call (`what`).
fn int_cuda<B: CollectiveBackend>(
    t: burn::tensor::ops::IntTensor<B>,
    what: &str,
) -> CubeTensor<CudaRuntime> {
    on_cuda(B::int_as_cuda(t), what)
}

/// A tensor's CUDA form, or a panic naming the call (`what`) where it has none.
fn on_cuda(t: Option<CubeTensor<CudaRuntime>>, what: &str) -> CubeTensor<CudaRuntime> {
    t.unwrap_or_else(|| {
        panic!("kernels::collective::{what}: the tensor is not on CUDA; a process group's calls take CUDA tensors (NCCL)")
    })
}

/// [`dense`] for a flat integer tensor.
fn dense_int<B: CollectiveBackend>(t: Tensor<B, 1, Int>, what: &str) -> CubeTensor<CudaRuntime> {
    unique_dense(int_cuda::<B>(t.into_primitive(), what))
}

/// `t`'s elements as a unique, dense, one-dimensional CUDA buffer of exactly those elements (a
/// copy where `t` shares, pads or strides its buffer), which a call may write in place.
fn dense<B: CollectiveBackend, const D: usize>(
    t: Tensor<B, D>,
    what: &str,
) -> CubeTensor<CudaRuntime> {
    unique_dense(cuda::<B>(t.into_primitive().tensor(), what))
}

/// CubeCL's tensor `t` as a unique, dense, one-dimensional buffer of its elements.
fn unique_dense(t: CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
    let n = t.meta.shape().num_elements();
    // Row-major first (a copy of a pitched or strided tensor), so that the reshape is a view.
    let t = burn_cubecl::kernel::into_contiguous(t);
    let flat = burn_cubecl::ops::reshape(t, burn::tensor::Shape::new([n]));
    if flat.can_mut() {
        flat
    } else {
        flat.copy()
    }
}
