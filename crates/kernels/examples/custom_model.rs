//! Using the fused kernels in a Burn model of your own.
//!
//! A one-block language model (embedding, RMSNorm, attention with RoPE, SwiGLU MLP, cross-entropy
//! with z-loss) written with ordinary Burn modules, where the memory-bound ops are calls into
//! `kernels`. It learns a repeating token pattern in a few dozen steps.
//!
//! ```text
//! cargo run --release -p kernels --example custom_model            # wgpu (any GPU, or lavapipe)
//! cargo run --release -p kernels --example custom_model -- cuda    # NVIDIA GPU
//! ```
//!
//! The only requirement on the backend is `kernels::Backend`: Burn's `Cuda` and `Wgpu` (without the
//! `fusion` feature) and `Autodiff` over them run the kernels, Burn's `NdArray` runs the plain-Burn
//! references, and any other backend gets the references with `kernels::reference_backend!(...)`.

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::activation::softmax;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

const VOCAB: usize = 16;
const D: usize = 64;
const HEADS: usize = 4;
const T: usize = 24;

#[derive(Module, Debug)]
struct TinyLm<B: burn::tensor::backend::Backend> {
    embed: Embedding<B>,
    norm1: Param<Tensor<B, 1>>,
    qkv: Linear<B>,
    out: Linear<B>,
    norm2: Param<Tensor<B, 1>>,
    up: Linear<B>,
    down: Linear<B>,
    norm_f: Param<Tensor<B, 1>>,
    head: Linear<B>,
}

impl<B: kernels::Backend> TinyLm<B> {
    fn new(dev: &B::Device) -> Self {
        let ones = || Param::from_tensor(Tensor::ones([D], dev));
        Self {
            embed: EmbeddingConfig::new(VOCAB, D).init(dev),
            norm1: ones(),
            qkv: LinearConfig::new(D, 3 * D).with_bias(false).init(dev),
            out: LinearConfig::new(D, D).with_bias(false).init(dev),
            norm2: ones(),
            // SwiGLU: gate and up projections in one matrix, split by the kernel.
            up: LinearConfig::new(D, 2 * 4 * D).with_bias(false).init(dev),
            down: LinearConfig::new(4 * D, D).with_bias(false).init(dev),
            norm_f: ones(),
            head: LinearConfig::new(D, VOCAB).with_bias(false).init(dev),
        }
    }

    /// ids [B, T] -> mean next-token loss.
    fn loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [b, t] = ids.dims();
        let hd = D / HEADS;
        let x = self.embed.forward(ids); // [B, T, D]

        // Attention: q and k rotated by one RoPE kernel, read strided out of the qkv projection.
        let h = kernels::rms_norm(x.clone(), self.norm1.val(), 1e-5);
        let qkv = self
            .qkv
            .forward(h)
            .reshape([b, t, 3 * HEADS, hd])
            .swap_dims(1, 2); // [B, 3H, T, hd]
        let (cos, sin) = kernels::rope::tables::<B>(t, hd, 10_000.0, &x.device());
        let qk = kernels::rope(
            qkv.clone().slice([0..b, 0..2 * HEADS, 0..t, 0..hd]),
            cos,
            sin,
        );
        let mut qk = qk.chunk(2, 1);
        let (k, q) = (qk.pop().unwrap(), qk.pop().unwrap());
        let v = qkv.slice([0..b, 2 * HEADS..3 * HEADS, 0..t, 0..hd]);
        let mask = Tensor::<B, 2, burn::tensor::Bool>::tril_mask([t, t], 0, &x.device()); // true above the diagonal
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .div_scalar((hd as f64).sqrt())
            .mask_fill(mask.unsqueeze::<4>(), -1e9);
        let y = softmax(scores, 3)
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, t, D]);
        let attn = self.out.forward(y);

        // Residual add fused with the next norm; SwiGLU on the packed gate/up projection.
        let (x, h) = kernels::add_rms_norm(attn, x, self.norm2.val(), 1e-5);
        let mlp = self
            .down
            .forward(kernels::swiglu_packed(self.up.forward(h)));
        let (_, h) = kernels::add_rms_norm(mlp, x, self.norm_f.val(), 1e-5);

        // Cross-entropy with a small z-loss, per token, then the mean.
        let logits = self.head.forward(h).reshape([b * t, VOCAB]);
        kernels::cross_entropy(logits, targets.reshape([b * t]), 1e-4).mean()
    }
}

/// Sequences of the pattern 0, 1, ..., 7 from random offsets: next-token prediction is learnable.
fn batch<B: burn::tensor::backend::Backend>(
    step: usize,
    dev: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let b = 8;
    let seq = |i: usize, j: usize| (((step * 13 + i * 5) + j) % 8) as i64;
    let x: Vec<i64> = (0..b)
        .flat_map(|i| (0..T).map(move |j| seq(i, j)))
        .collect();
    let y: Vec<i64> = (0..b)
        .flat_map(|i| (0..T).map(move |j| seq(i, j + 1)))
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [b, T]), dev),
        Tensor::from_data(TensorData::new(y, [b, T]), dev),
    )
}

fn train<B: AutodiffBackend + kernels::Backend>(dev: B::Device) {
    let mut model = TinyLm::<B>::new(&dev);
    let mut opt = AdamConfig::new().init::<B, TinyLm<B>>();
    for step in 0..60 {
        let (x, y) = batch::<B>(step, &dev);
        let loss = model.loss(x, y);
        if step % 10 == 0 || step == 59 {
            println!("step {step:>2}  loss {:.4}", loss.clone().into_scalar());
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(3e-3, model, grads);
    }
}

fn main() {
    if std::env::args().any(|a| a == "cuda") {
        train::<burn::backend::Autodiff<burn::backend::Cuda>>(Default::default());
    } else {
        train::<burn::backend::Autodiff<burn::backend::Wgpu>>(Default::default());
    }
}
