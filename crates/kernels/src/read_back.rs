//! Reads of a tensor to the host that start when asked and are waited for later
//! ([`ReadBackOps::start_read`]), so that the host can queue more work before it waits.
//!
//! On CubeCL's backends the copy is queued on the device's stream at once, behind the work queued
//! so far, with an event after it; [`StartedRead::wait`] waits for that event only, not for the
//! work queued since. Burn's `into_data` does the same but queues the copy only when its future
//! is first polled, which is when it is waited for. Other backends read at once.

use std::any::{Any, TypeId};
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend as BurnBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorData;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::ComputeClient;
use cubecl::server::CopyDescriptor;

/// The rest of a started copy: resolves once the copy has run.
type Copying = Pin<Box<dyn Future<Output = Result<TensorData, String>> + Send>>;

/// A read of a tensor to the host, started ([`ReadBackOps::start_read`]).
pub struct StartedRead(Started);

enum Started {
    /// Read already (backends that read at once).
    Done(TensorData),
    /// Queued on the device.
    Copying(Copying),
}

impl StartedRead {
    /// A read that has finished: `data`.
    pub fn done(data: TensorData) -> Self {
        Self(Started::Done(data))
    }

    /// The values: waits for the copy, and so for the work queued before it. A device error
    /// (the step's kernels failed) panics, as Burn's `into_data` does.
    pub fn wait(self) -> TensorData {
        match self.0 {
            Started::Done(data) => data,
            Started::Copying(copying) => cubecl::future::block_on(copying)
                .unwrap_or_else(|e| panic!("reading a tensor back from the device: {e}")),
        }
    }
}

/// Starting a read of a float tensor to the host. The default reads at once; `CubeBackend`
/// queues the copy and returns.
pub trait ReadBackOps: BurnBackend {
    /// Starts reading `tensor` to the host, behind the work queued so far.
    fn start_read(tensor: FloatTensor<Self>) -> StartedRead {
        let data = cubecl::future::block_on(Self::float_into_data(tensor))
            .unwrap_or_else(|e| panic!("reading a tensor back from the device: {e:?}"));
        StartedRead::done(data)
    }
}

impl<R, F, I, BT> ReadBackOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn start_read(tensor: FloatTensor<Self>) -> StartedRead {
        let tensor = burn_cubecl::kernel::into_contiguous_aligned(tensor);
        let (shape, dtype) = (tensor.meta.shape().clone(), tensor.dtype);
        let (strides, elem_size) = (tensor.meta.strides().clone(), tensor.elem_size());
        let descriptor =
            CopyDescriptor::new(tensor.handle.binding(), shape.clone(), strides, elem_size);
        // Queues the copy and its event now; the future only waits for the event. Its type
        // borrows the client, so the client is one that lives as long as the process.
        let copy = lasting_client::<R>(&tensor.device).read_tensor_async(vec![descriptor]);
        StartedRead(Started::Copying(Box::pin(async move {
            let mut bytes = copy.await.map_err(|e| format!("{e}"))?;
            Ok(TensorData::from_bytes(bytes.remove(0), shape, dtype))
        })))
    }
}

/// The compute client of `device`, made once per runtime and device and kept for the process's
/// life (CubeCL keeps its own the same way).
fn lasting_client<R: CubeRuntime>(device: &R::Device) -> &'static ComputeClient<R> {
    type Kept = (TypeId, String, &'static (dyn Any + Send + Sync));
    static KEPT: Mutex<Vec<Kept>> = Mutex::new(Vec::new());
    let key = (TypeId::of::<R>(), format!("{device:?}"));
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    let found = kept
        .iter()
        .find(|(t, d, _)| (*t, d) == (key.0, &key.1))
        .and_then(|(_, _, c)| c.downcast_ref::<ComputeClient<R>>());
    if let Some(client) = found {
        return client;
    }
    let client: &'static ComputeClient<R> = Box::leak(Box::new(R::client(device)));
    kept.push((key.0, key.1, client));
    client
}

impl<R, F, I, BT, C> ReadBackOps for Autodiff<CubeBackend<R, F, I, BT>, C>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    C: CheckpointStrategy,
{
}
