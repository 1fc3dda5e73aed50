//! FP8 quantizer, GEMM and linear layer on wgpu (lavapipe in CI), plus the CPU reference codec
//! against an independent implementation (the `float8` crate, a port of CUDA's conversions).
//! The same kernel cases run on CUDA in `tests/cuda/kernels.rs`.

mod common;
mod fp8_cases;

use burn::tensor::FloatDType;
use common::{device, Inner, B};
use float8::{F8E4M3, F8E5M2};
use kernels::fp8::reference::{decode, encode, scales_for};
use kernels::Fp8Format;

fn oracle(x: f32, format: Fp8Format) -> u8 {
    match format {
        Fp8Format::E4M3 => F8E4M3::from_f32(x).to_bits(),
        Fp8Format::E5M2 => F8E5M2::from_f32(x).to_bits(),
    }
}

/// Every code decodes to the oracle's value; encoding matches the oracle (round to nearest even,
/// saturating) on every code value, every midpoint between neighbouring codes (ties), one f32 ulp
/// either side of them, and a million random values across the whole range.
#[test]
fn reference_codec_matches_float8_crate() {
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let mut values = Vec::new();
        for code in 0u8..=255 {
            let v = decode(code, format);
            let want = match format {
                Fp8Format::E4M3 => F8E4M3::from_bits(code).to_f32(),
                Fp8Format::E5M2 => F8E5M2::from_bits(code).to_f32(),
            };
            assert!(
                v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                "{format:?} decode {code:#04x}: {v} vs {want}"
            );
            if v.is_finite() {
                values.push(v);
            }
        }
        values.sort_by(f32::total_cmp);
        let mut probes = values.clone();
        for pair in values.windows(2) {
            let mid = ((pair[0] as f64 + pair[1] as f64) / 2.0) as f32;
            for p in [
                mid,
                f32::from_bits(mid.to_bits().wrapping_add(1)),
                f32::from_bits(mid.to_bits().wrapping_sub(1)),
            ] {
                probes.push(p);
            }
        }
        let mut rng = fp8_cases::Rng::new(5);
        for _ in 0..1_000_000 {
            // exponents from far below the smallest subnormal to beyond the max
            let bits = (rng.next_u32() & 0x807F_FFFF) | ((90 + rng.next_u32() % 60) << 23);
            probes.push(f32::from_bits(bits));
        }
        probes.extend([
            format.max() * 1.01,
            -format.max() * 4.0,
            1e30,
            -1e30,
            0.0,
            -0.0,
        ]);
        for x in probes {
            if x.abs() < f32::MIN_POSITIVE && x != 0.0 {
                continue; // f32 subnormals are flushed on purpose (the oracle keeps their sign)
            }
            assert_eq!(
                encode(x, 1.0, format),
                oracle(x, format),
                "{format:?} encode {x:e} ({:#010x})",
                x.to_bits()
            );
        }
        // Non-finite inputs, on purpose: NaN -> NaN, inf -> inf (E5M2) or NaN (E4M3).
        assert!(decode(encode(f32::NAN, 1.0, format), format).is_nan());
        let inf = decode(encode(f32::NEG_INFINITY, 1.0, format), format);
        match format {
            Fp8Format::E4M3 => assert!(inf.is_nan()),
            Fp8Format::E5M2 => assert_eq!(inf, f32::NEG_INFINITY),
        }
        assert_eq!(
            encode(1e-40, 1.0, format),
            0,
            "f32 subnormals quantize to +0"
        );
    }
}

/// Power-of-two scales: the largest power of two that keeps the amax within the format's max;
/// the dequantization scale is its exact inverse; zero tiles get 1.
#[test]
fn reference_scales() {
    let mut rng = fp8_cases::Rng::new(9);
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        assert_eq!(scales_for(0.0, format, true), (1.0, 1.0));
        for _ in 0..100_000 {
            let amax =
                f32::from_bits((rng.next_u32() & 0x7F_FFFF) | ((20 + rng.next_u32() % 200) << 23));
            let (s, d) = scales_for(amax, format, true);
            assert_eq!(s.to_bits() & 0x7F_FFFF, 0, "power of two");
            assert_eq!(s as f64 * d as f64, 1.0);
            let k = s.log2();
            if (-126.0..126.0).contains(&k) {
                assert!(
                    amax as f64 * s as f64 <= format.max() as f64,
                    "{amax:e} * {s:e} exceeds the max"
                );
                assert!(
                    amax as f64 * 2.0 * s as f64 > format.max() as f64,
                    "{amax:e}: scale {s:e} is not the largest"
                );
            }
            let (s2, _) = scales_for(amax, format, false);
            assert!(
                (amax * s2 - format.max()).abs() <= format.max() * 1e-6
                    || s2 >= 2f32.powi(126)
                    || s2 <= 2f32.powi(-126)
            );
        }
    }
}

/// Empty matrices quantize to empty payloads; a per-tensor scale of nothing is 1. The clip
/// thresholds are the max plus half an ulp of the top binade.
#[test]
fn quantizer_empty_inputs_and_clip_thresholds() {
    if !common::needs_wgpu() {
        return;
    }
    use burn::tensor::Tensor;
    use kernels::{fp8_quantize, Fp8Granularity, QuantSpec};
    for shape in [[0, 5], [3, 0]] {
        for granularity in [
            Fp8Granularity::Tile1x128,
            Fp8Granularity::Block128,
            Fp8Granularity::Tensor,
        ] {
            let x = Tensor::<Inner, 2>::zeros(shape, &device());
            let q = fp8_quantize(x, QuantSpec::new(Fp8Format::E4M3, granularity));
            assert_eq!(q.payload.dims()[0], q.rows);
            if granularity == Fp8Granularity::Tensor {
                assert_eq!(
                    q.scales.into_data().to_vec::<f32>().unwrap(),
                    vec![1.0],
                    "{shape:?}"
                );
            }
        }
    }
    assert_eq!(Fp8Format::E4M3.clip_threshold(), 464.0);
    assert_eq!(Fp8Format::E5M2.clip_threshold(), 61440.0);
}

#[test]
fn quantizer_bit_identical() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(1, 1), (37, 300), (130, 128), (257, 129)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        fp8_cases::quantizer_bit_identical::<Inner>(dtype, &device(), &shapes);
    }
}

#[test]
fn quantize_pair_bit_identical() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(1, 1), (37, 300), (130, 128), (257, 129)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        fp8_cases::quantize_pair_bit_identical::<Inner>(
            dtype,
            &device(),
            &shapes,
            kernels::Fp8PairPath::Fused,
        );
    }
}

/// Row shards of a weight (multiples of 128 rows) quantize with 128 x 128 blocks to the whole
/// weight's codes and scales, and its dequantized codes quantize again to the same values: what
/// ZeRO-3's all-gather of FP8 weight codes rests on (`trainer::parallel::fsdp`).
#[test]
fn weight_shards_gather_exactly() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(300, 200), (256, 384), (1000, 130)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        fp8_cases::wire::weight_shards_gather_exactly::<Inner>(
            dtype,
            &device(),
            &shapes,
            &[1, 2, 3],
        );
    }
}

/// Delayed per-tensor scaling (amax histories) against the CPU reference.
#[test]
fn delayed_scaling() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(3, 5), (37, 300), (257, 129)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        fp8_cases::delayed_scaling::<Inner>(dtype, &device(), &shapes);
    }
}

/// FP8 health on the device (and through `Autodiff`) against the CPU reference.
#[test]
fn health_matches_reference() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(1, 1), (37, 300), (257, 129)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        fp8_cases::health_matches_reference::<Inner>(dtype, &device(), &shapes);
    }
    fp8_cases::health_matches_reference::<B>(FloatDType::F32, &device(), &shapes[1..2]);
}

#[test]
fn gemm_against_dequantized() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(1, 1, 1), (33, 17, 300), (130, 70, 256)];
    for out in [FloatDType::F32, FloatDType::F16] {
        fp8_cases::gemm_against_dequantized::<Inner>(
            &device(),
            out,
            &shapes,
            kernels::Fp8GemmPath::Dequantize,
        );
    }
}

#[test]
fn linear_forward_and_gradients() {
    if !common::needs_wgpu() {
        return;
    }
    let shapes = [(64, 256, 96), (100, 130, 200)];
    for dtype in [FloatDType::F32, FloatDType::F16] {
        fp8_cases::linear::<B>(dtype, &device(), &shapes);
    }
}

/// The FP8 MLP as one op (GELU, and SwiGLU of a packed gate and up) is its composition of
/// separate ops bit for bit here (the activation's kernel runs in both on wgpu; the kernel that
/// quantizes inside the activation is CUDA's), and the activation quantized through
/// `fp8_act_quantize_pair` is the activation's output quantized.
#[test]
fn fp8_mlp_is_the_composition() {
    use kernels::Fp8MlpActivation::{Gelu, SwigluPacked};
    for act in [Gelu, SwigluPacked] {
        let shapes = [(37, 300), (130, 128), (257, 129)];
        let dev = device();
        fp8_cases::mlp::act_quantize_pair_matches::<Inner>(
            act,
            FloatDType::F32,
            &dev,
            &shapes,
            true,
        );
        let shapes = [(64, 128, 256, 96), (100, 130, 200, 72)];
        fp8_cases::mlp::mlp_matches_composition::<B>(act, FloatDType::F32, &dev, &shapes, true);
    }
}

/// `precision = "fp8"` (f32 elsewhere, as lavapipe has no bf16) trains a tiny model with every
/// projection GEMM in FP8: the loss falls like fp32's, the health metrics are logged, and the
/// recipe is recorded.
#[test]
fn fp8_recipe_trains() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    let steps = 30;
    let mut fp32 = common::tiny_config(steps);
    fp32.training.eval_interval = steps;
    let mut fp8 = tiny_fp8_config(steps, 10);
    fp8.training.eval_interval = steps;
    let (s32, _) = train_on_wgpu(&fp32, "fp8_recipe_fp32");
    let (s8, dir8) = train_on_wgpu(&fp8, "fp8_recipe_fp8");
    let (v32, v8) = (s32.best_val_loss.unwrap(), s8.best_val_loss.unwrap());
    eprintln!("best validation loss after {steps} steps: fp32 {v32:.4}, fp8 {v8:.4}");
    assert!(s8.final_loss.is_finite() && v8.is_finite());
    assert!(
        (v8 - v32).abs() <= 0.05 * v32,
        "fp8 validation loss {v8} vs fp32 {v32}"
    );
    let m = common::read_metrics(&dir8);
    assert!(
        m[0].loss > m[steps - 1].loss + 0.3,
        "fp8 loss did not fall: {} -> {}",
        m[0].loss,
        m[steps - 1].loss
    );
    assert!(m.iter().all(|r| r.precision == "fp8"));
    let health: Vec<_> = m
        .iter()
        .filter(|r| r.fp8.is_some())
        .map(|r| r.step)
        .collect();
    assert_eq!(health, vec![1, 10, 20, 30]);
    let h = m[0].fp8.as_ref().unwrap();
    assert_eq!(
        h.len(),
        12 * fp8.model.n_layer,
        "one entry per projection weight, input and output gradient"
    );
    for kind in [".weight", ".input", ".grad_output"] {
        assert_eq!(
            h.iter().filter(|l| l.layer.ends_with(kind)).count(),
            4 * fp8.model.n_layer,
            "{kind}: {h:?}"
        );
    }
    assert!(
        h.iter().any(|l| l.layer == "blocks.1.mlp.proj.grad_output"),
        "{h:?}"
    );
    assert!(
        h.iter()
            .all(|l| l.amax > 0.0 && (0.0..0.5).contains(&l.underflow) && l.saturated == 0.0),
        "{h:?}"
    );
    assert_eq!(s8.precision.kind(), trainer::precision::PrecisionKind::Fp8);
}

/// `fp8.bf16_edge_blocks = 1` keeps the first and last blocks' projections out of FP8: only the
/// middle block's projections record FP8 health, and the run trains.
#[test]
fn fp8_edge_blocks_stay_out_of_fp8() {
    if !common::needs_wgpu() {
        return;
    }
    let _guard = common::serial();
    let mut cfg = tiny_fp8_config(3, 1);
    cfg.model.n_layer = 3;
    cfg.fp8.bf16_edge_blocks = 1;
    let (s, dir) = train_on_wgpu(&cfg, "fp8_edge_blocks");
    assert!(s.final_loss.is_finite());
    let m = common::read_metrics(&dir);
    let h = m[0].fp8.as_ref().expect("FP8 health on step 1");
    assert_eq!(
        h.len(),
        12,
        "the middle block's 4 projections x 3 tensors: {h:?}"
    );
    assert!(h.iter().all(|l| l.layer.starts_with("blocks.1.")), "{h:?}");

    let mut all = cfg.clone();
    all.fp8.bf16_edge_blocks = 2;
    let e = all.validate().unwrap_err();
    assert!(
        e.contains("fp8.bf16_edge_blocks") && e.contains("at most 1"),
        "{e}"
    );
}

/// `fp8.gather_codes` is refused, naming what it needs, without ZeRO-3, with scales the ranks
/// would have to agree on (per-tensor) or that are not powers of two, and with a GEMM that takes
/// the weight in the compute dtype; accepted with ZeRO-3 and block scales.
#[test]
fn fp8_gather_codes_needs_zero_3_and_block_scales() {
    let mut cfg = tiny_fp8_config(2, 1);
    cfg.fp8.gather_codes = true;
    let e = cfg.validate().unwrap_err();
    assert!(
        e.contains("fp8.gather_codes") && e.contains("training.zero = 3"),
        "{e}"
    );
    cfg.training.zero = 3;
    cfg.validate().expect("ZeRO-3 with block scales");
    for tensor in [true, false] {
        let mut bad = cfg.clone();
        match tensor {
            true => bad.fp8.scaling = trainer::config::Fp8ScalingKind::Tensor,
            false => bad.fp8.pow2_scales = false,
        }
        let e = bad.validate().unwrap_err();
        assert!(
            e.contains("fp8.gather_codes") && e.contains("pow2_scales = true"),
            "{e}"
        );
    }
    let mut bf16_fprop = cfg.clone();
    bf16_fprop.fp8.fprop = false;
    let e = bf16_fprop.validate().unwrap_err();
    assert!(
        e.contains("fp8.gather_codes") && e.contains("fp8.fprop and fp8.dgrad"),
        "{e}"
    );
}

/// `fp8.projections` as a list runs only those projections in FP8 (only they record FP8 health);
/// `"auto"` times the projections when the run starts and records its decision in the run's
/// config as such a list, which the run then follows.
#[test]
fn fp8_projections_listed_or_timed() {
    if !common::needs_wgpu() {
        return;
    }
    use trainer::config::Fp8Projections;
    let _guard = common::serial();
    let mut cfg = tiny_fp8_config(2, 1);
    // The FP8 health's projections (`blocks.N.attn.qkv.input` -> `attn.qkv`).
    let fp8_paths = |dir: &std::path::Path| -> std::collections::BTreeSet<String> {
        let m = common::read_metrics(dir);
        m[0].fp8
            .iter()
            .flatten()
            .map(|l| {
                let rest = l.layer.splitn(3, '.').nth(2).unwrap();
                rest.rsplit_once('.').unwrap().0.to_string()
            })
            .collect()
    };

    cfg.fp8.projections = Fp8Projections::Paths(vec!["mlp.proj".into(), "attn.qkv".into()]);
    let (s, dir) = train_on_wgpu(&cfg, "fp8_projections_list");
    assert!(s.final_loss.is_finite());
    let want: std::collections::BTreeSet<String> =
        ["attn.qkv", "mlp.proj"].map(String::from).into();
    assert_eq!(fp8_paths(&dir), want);
    let h = common::read_metrics(&dir)[0].fp8.clone().unwrap();
    assert_eq!(h.len(), 2 * 3 * cfg.model.n_layer, "{h:?}");

    cfg.fp8.projections = Fp8Projections::Rule("auto".into());
    let (s, dir) = train_on_wgpu(&cfg, "fp8_projections_auto");
    assert!(s.final_loss.is_finite());
    let saved = trainer::Config::load(&dir.join("config.toml"), &[]).unwrap();
    let Fp8Projections::Paths(chosen) = &saved.fp8.projections else {
        panic!(
            "config.toml keeps {:?}, not the decision",
            saved.fp8.projections
        );
    };
    let chosen: std::collections::BTreeSet<String> = chosen.iter().cloned().collect();
    assert_eq!(
        fp8_paths(&dir),
        chosen,
        "the run follows its recorded decision"
    );
}

/// Config errors name the key and what is valid.
#[test]
fn fp8_config_errors() {
    let e = trainer::Config::from_toml_str("[fp8]\nformat = \"hybrid\"\n", &[], "test")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[fp8]") && e.contains("precision = \"fp8\""),
        "{e}"
    );
    let e = trainer::Config::from_toml_str("precision = \"fp8\"\n[fp8]\ntile = 64\n", &[], "test")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fp8.tile = 64") && e.contains("128"), "{e}");
    let e = trainer::Config::from_toml_str(
        "precision = \"fp8\"\n[fp8]\nformat = \"e5m2\"\n",
        &[],
        "test",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("fp8.format") && e.contains("e5m2") && e.contains("hybrid"),
        "{e}"
    );
    let ok = trainer::Config::from_toml_str(
        "precision = \"fp8\"\n[fp8]\nformat = \"hybrid\"\nscaling = \"tensor\"\n",
        &[],
        "test",
    )
    .unwrap();
    let lin = ok.recipe().unwrap().fp8_linear().unwrap();
    assert_eq!(lin.grad_format, kernels::Fp8Format::E5M2);
    assert!(lin.per_tensor);
    let e = trainer::Config::from_toml_str(
        "precision = \"fp8\"\n[fp8]\namax_history = 16\n",
        &[],
        "test",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("fp8.amax_history = 16") && e.contains("scaling = \"tensor\""),
        "{e}"
    );
    let e = trainer::Config::from_toml_str(
        "precision = \"fp8\"\n[fp8]\nscaling = \"tensor\"\namax_history = 5000\n",
        &[],
        "test",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("fp8.amax_history = 5000") && e.contains("1 to 1024"),
        "{e}"
    );
    let delayed = trainer::Config::from_toml_str(
        "precision = \"fp8\"\n[fp8]\nscaling = \"tensor\"\namax_history = 16\n",
        &[],
        "test",
    )
    .unwrap();
    assert_eq!(delayed.fp8.amax_history().map(|h| h.len()), Some(16));
    for (value, words) in [
        (
            "\"some\"",
            &["fp8.projections = \"some\"", "\"auto\"", "\"mlp.fc\""][..],
        ),
        (
            "[\"mlp.up\"]",
            &["\"mlp.up\"", "not a projection", "\"attn.qkv\""],
        ),
        ("[\"mlp.fc\", \"mlp.fc\"]", &["\"mlp.fc\" twice"]),
    ] {
        let e = trainer::Config::from_toml_str(
            &format!("precision = \"fp8\"\n[fp8]\nprojections = {value}\n"),
            &[],
            "test",
        )
        .unwrap_err()
        .to_string();
        assert!(words.iter().all(|w| e.contains(w)), "{value}: {e}");
    }
    let listed = trainer::Config::from_toml_str(
        "precision = \"fp8\"\n[fp8]\nprojections = [\"mlp.fc\"]\n",
        &["fp8.projections=[\"mlp.fc\", \"mlp.proj\"]".into()],
        "test",
    )
    .unwrap();
    assert_eq!(
        listed.fp8.projections.compute_paths(),
        vec!["attn.qkv", "attn.proj"]
    );
    let toml = listed.to_toml();
    let again = trainer::Config::from_toml_str(&toml, &[], "round trip").unwrap();
    assert_eq!(again.fp8.projections, listed.fp8.projections);
}

/// `fp8.scaling = "tensor"` with `fp8.amax_history` (delayed scaling) trains a tiny model to the
/// loss of current per-tensor scaling, with every projection's scales from its history after the
/// first step.
#[test]
fn fp8_delayed_scaling_trains() {
    if !common::needs_wgpu() {
        return;
    }
    use trainer::config::Fp8ScalingKind;
    let _guard = common::serial();
    let steps = 30;
    let mut current = tiny_fp8_config(steps, 10);
    current.training.eval_interval = steps;
    current.fp8.scaling = Fp8ScalingKind::Tensor;
    let mut delayed = current.clone();
    delayed.fp8.amax_history = 4;
    let (sc, _) = train_on_wgpu(&current, "fp8_tensor_current");
    let (sd, dir_d) = train_on_wgpu(&delayed, "fp8_tensor_delayed");
    let (vc, vd) = (sc.best_val_loss.unwrap(), sd.best_val_loss.unwrap());
    eprintln!("best validation loss after {steps} steps: current {vc:.4}, delayed {vd:.4}");
    assert!(sd.final_loss.is_finite() && vd.is_finite());
    assert!(
        (vd - vc).abs() <= 0.03 * vc,
        "delayed scaling's validation loss {vd} vs current scaling's {vc}"
    );
    let m = common::read_metrics(&dir_d);
    assert!(
        m[0].loss > m[steps - 1].loss + 0.3,
        "the loss did not fall: {} -> {}",
        m[0].loss,
        m[steps - 1].loss
    );
    let h = m[9].fp8.as_ref().expect("health at step 10");
    assert!(h.iter().all(|l| l.amax > 0.0), "{h:?}");
}

/// A tiny config trained in FP8 on wgpu: f32 compute (lavapipe has no bf16), FP8 health every
/// `health_interval` steps.
fn tiny_fp8_config(steps: usize, health_interval: u64) -> trainer::Config {
    let mut cfg = common::tiny_config(steps);
    cfg.precision = trainer::config::PrecisionKind::Fp8;
    cfg.fp8.compute = trainer::config::Fp8ComputeKind::F32;
    cfg.fp8.health_interval = health_interval;
    cfg
}

/// Trains `cfg` on wgpu into a fresh scratch directory named `name`: its summary and the run
/// directory.
fn train_on_wgpu(cfg: &trainer::Config, name: &str) -> (trainer::Summary, std::path::PathBuf) {
    let dir = common::scratch(name);
    let summary = trainer::run(
        cfg,
        &trainer::device::Selected::Wgpu,
        &common::opts(dir.clone(), false),
    )
    .unwrap();
    (summary, dir)
}
