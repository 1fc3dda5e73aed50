//! What the ranks of a data-parallel run exchange, and what needs no GPU to decide: which rows of
//! the global batch a rank reads, the collective operations the step uses (between threads of one
//! process, Burn's `DistributedBackend`; between processes, the NCCL communicator of
//! `kernels::collective`), the weights checksum that catches replicas drifting apart, and the
//! checks that run before a multi-GPU run starts (GPU count, NCCL).

use std::ops::Range;

use anyhow::{bail, Result};
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::distributed::DistributedBackend;
pub use burn_backend::distributed::ReduceOperation;
use burn_backend::{DeviceId, DeviceOps};
use burn_cubecl::tensor::CubeTensor;

use crate::host_copy;

/// The rows of a global batch of `ranks * batch` sequences that rank `rank` computes: rank 0 the
/// first `batch`, rank 1 the next, and so on. With windows drawn in order from one stream, a run on
/// `ranks` GPUs therefore reads exactly the batches of a one-GPU run with `ranks` times the batch.
pub fn rows(rank: usize, batch: usize) -> Range<usize> {
    rank * batch..(rank + 1) * batch
}

/// The other ranks of a data-parallel run, as the collectives reach them.
#[derive(Clone, Copy)]
pub enum Peers<'a> {
    /// Ranks in threads of this process, one device each (every rank's device, rank order).
    Threads(&'a [DeviceId]),
    /// Ranks in processes of their own, one GPU each, joined in an NCCL communicator.
    Processes(&'a kernels::collective::ProcessGroup),
}

impl Peers<'_> {
    /// How many ranks the run has.
    pub fn world_size(&self) -> usize {
        match self {
            Peers::Threads(ids) => ids.len(),
            Peers::Processes(g) => g.world(),
        }
    }
}

/// Collective operations of a backend, as the data-parallel step uses them. Between processes the
/// step also calls `kernels::collective::ProcessGroup`'s own operations (reduce to one rank,
/// broadcast), which take any [`kernels::collective::CollectiveBackend`].
pub trait Collective: Backend + kernels::collective::CollectiveBackend {
    /// The mean or sum (`op`) of `tensor` over the ranks (every rank calls it, in the same order
    /// of tensors). The result may only be read after [`Collective::sync`].
    fn reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        peers: Peers<'_>,
    ) -> FloatTensor<Self>;

    /// Makes the device's compute stream wait for the collectives queued on it.
    fn sync(device: &Self::Device);
}

/// The process group's reduce operation of `op`.
fn process_op(op: ReduceOperation) -> kernels::collective::ReduceOp {
    match op {
        ReduceOperation::Sum => kernels::collective::ReduceOp::Sum,
        ReduceOperation::Mean => kernels::collective::ReduceOp::Mean,
    }
}

impl<R, F, I, BT> Collective for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    /// CubeCL's NCCL call takes the element count from the byte size of the buffer it is given.
    /// Burn's `all_reduce` gives it the tensor's own buffer when that is unique and row-major, and
    /// otherwise a copy in the device's preferred layout, whose rows CUDA pads (pitches) unless
    /// their bytes are a multiple of 512 (or of a smaller power of two). Ranks that hold the same
    /// tensor in different layouts would then pass NCCL different counts, and it would wait
    /// forever: under ZeRO-1 the owner of a weight hands over the dense bf16 copy the optimizer
    /// wrote while the other ranks hand over pitched zeros (`[64, 192]` bf16: rows of 384 bytes
    /// padded to 512). So every rank reduces, in place, a unique dense buffer of exactly the
    /// tensor's elements.
    fn reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        peers: Peers<'_>,
    ) -> FloatTensor<Self> {
        let devices = match peers {
            Peers::Threads(ids) => ids,
            // On CubeCL's stream, in its order: `sync` has nothing to wait for.
            Peers::Processes(group) => {
                return on_flat::<R, F, I, BT>(tensor, |t| group.all_reduce(t, process_op(op)));
            }
        };
        let shape = tensor.meta.shape().clone();
        let n = shape.num_elements();
        // Row-major (a copy of a pitched or strided tensor), then one dimension (a new view).
        let dense = burn_cubecl::kernel::into_contiguous(tensor);
        let flat = burn_cubecl::ops::reshape(dense, burn::tensor::Shape::new([n]));
        // Unique, as the reduction writes in place (one-dimensional buffers are not pitched).
        let flat = if flat.can_mut() { flat } else { flat.copy() };
        let bytes = (n * flat.dtype.size()) as u64;
        // Exactly the elements: a buffer may end in padding.
        let used = flat.handle.size_in_used();
        let handle = flat.handle.clone().offset_end(used - bytes);
        let op = match op {
            ReduceOperation::Sum => burn_cubecl::cubecl::server::ReduceOperation::Sum,
            ReduceOperation::Mean => burn_cubecl::cubecl::server::ReduceOperation::Mean,
        };
        R::client(&flat.device).all_reduce(
            handle.clone(),
            handle,
            flat.dtype.into(),
            devices.to_vec(),
            op,
        );
        // `flat` holds the buffer until the caller's `Collective::sync`, after which it is read.
        burn_cubecl::ops::reshape(flat, shape)
    }

    fn sync(device: &Self::Device) {
        <Self as DistributedBackend>::sync_collective(device);
    }
}

/// `call` on `tensor`'s elements as one row-major dimension, its result in `tensor`'s shape.
fn on_flat<R, F, I, BT>(
    tensor: CubeTensor<R>,
    call: impl FnOnce(
        Tensor<burn_cubecl::CubeBackend<R, F, I, BT>, 1>,
    ) -> Tensor<burn_cubecl::CubeBackend<R, F, I, BT>, 1>,
) -> CubeTensor<R>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    let shape = tensor.meta.shape().clone();
    let flat = burn_cubecl::ops::reshape(
        burn_cubecl::kernel::into_contiguous(tensor),
        burn::tensor::Shape::new([shape.num_elements()]),
    );
    let out = call(Tensor::from_primitive(TensorPrimitive::Float(flat)));
    burn_cubecl::ops::reshape(out.into_primitive().tensor(), shape)
}

impl Collective for burn::backend::NdArray {
    fn reduce(_: FloatTensor<Self>, _: ReduceOperation, _: Peers<'_>) -> FloatTensor<Self> {
        unreachable!("the config refuses training.devices above 1 off CUDA")
    }

    fn sync(_: &Self::Device) {
        unreachable!("the config refuses training.devices above 1 off CUDA")
    }
}

/// The devices' ids, as the collectives name them.
pub fn device_ids<B: Backend>(devices: &[B::Device]) -> Vec<DeviceId> {
    devices.iter().map(|d| d.id()).collect()
}

/// Averages every gradient of `module`'s parameters over the ranks, in place, in the module's
/// parameter order (the same on every rank, as NCCL requires); read them after
/// [`Collective::sync`]. Every rank calls it from its own thread: the first collective of a group
/// initialises NCCL's communicator, which blocks until every rank has joined.
pub fn mean_grads<AB, M>(module: &M, grads: &mut GradientsParams, peers: Peers<'_>)
where
    AB: AutodiffBackend,
    AB::InnerBackend: Collective,
    M: AutodiffModule<AB>,
{
    struct Mean<'a> {
        grads: &'a mut GradientsParams,
        peers: Peers<'a>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Mean<'_>
    where
        AB::InnerBackend: Collective,
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id) {
                let mean = reduce(g, ReduceOperation::Mean, self.peers);
                self.grads.register::<AB::InnerBackend, D>(param.id, mean);
            }
        }
    }
    module.visit(&mut Mean { grads, peers });
}

/// [`Collective::reduce`] of a tensor; read it after [`Collective::sync`].
pub fn reduce<B: Collective, const D: usize>(
    t: Tensor<B, D>,
    op: ReduceOperation,
    peers: Peers<'_>,
) -> Tensor<B, D> {
    let reduced = B::reduce(t.into_primitive().tensor(), op, peers);
    Tensor::from_primitive(TensorPrimitive::Float(reduced))
}

/// CRC-32 of a module's parameter values (as stored, in parameter order): replicas that stayed
/// identical have equal checksums.
pub fn weights_checksum<B: Backend, M: burn::module::Module<B>>(module: &M) -> u32 {
    struct Crc(crc32fast::Hasher);
    impl<B: Backend> ModuleVisitor<B> for Crc {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            host_copy::read_bytes(param.val(), |b| self.0.update(b));
        }
    }
    let mut c = Crc(crc32fast::Hasher::new());
    module.visit(&mut c);
    c.0.finalize()
}

/// Number of CUDA GPUs this process can use (as `CUDA_VISIBLE_DEVICES` leaves them).
pub fn cuda_device_count() -> Result<usize> {
    cudarc::driver::result::init()
        .map_err(|e| anyhow::anyhow!("the CUDA driver did not initialise: {e:?}"))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| anyhow::anyhow!("the CUDA driver could not count the GPUs: {e:?}"))?;
    Ok(n.max(0) as usize)
}

/// Checks that NCCL, which the collectives load at run time, is there.
pub fn check_nccl(devices: usize) -> Result<()> {
    // SAFETY: only tries to open the library by its candidate names.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    let names = cudarc::get_lib_name_candidates("nccl");
    bail!(
        "training.devices asks for {devices} GPUs, which exchange gradients through NCCL, but no NCCL library was found \
         (looked for {} on the library path). Install NCCL (the libnccl2 package, or the nvidia-nccl wheel) and make it \
         visible under one of those names, e.g. a link libnccl.so -> libnccl.so.2 in a directory on LD_LIBRARY_PATH; \
         or train on one GPU (training.devices = 1)",
        names.join(", ")
    )
}
