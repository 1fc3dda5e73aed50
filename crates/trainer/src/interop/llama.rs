//! This engine's parameters in Hugging Face's `LlamaForCausalLM` layout and back.
//!
//! | here | `transformers` |
//! |---|---|
//! | `wte.weight` [V, d] | `model.embed_tokens.weight` [V, d] |
//! | `blocks.i.norm1.weight` | `model.layers.i.input_layernorm.weight` |
//! | `blocks.i.attn.qkv.weight` [d, (h + 2 kv) hd]: q, k, v side by side | `self_attn.{q,k,v}_proj.weight` [out, d] |
//! | `blocks.i.attn.proj.weight` [d, d] | `self_attn.o_proj.weight` (transposed) |
//! | `blocks.i.norm2.weight` | `post_attention_layernorm.weight` |
//! | `blocks.i.mlp.fc.weight` [d, 2 ff]: gate, then up | `mlp.{gate,up}_proj.weight` [ff, d] |
//! | `blocks.i.mlp.proj.weight` [ff, d] | `mlp.down_proj.weight` [d, ff] |
//! | `norm_f.weight` | `model.norm.weight` |
//! | `lm_head.weight` [d, V] (untied) | `lm_head.weight` [V, d] |
//!
//! A linear layer here computes `x W` with `W` [in, out]; `transformers`' computes `x W^T` with
//! `W` [out, in]: every projection is transposed. Both rotate query and key halves (RoPE's
//! "rotate half" layout), so no row of q or k is permuted.

use anyhow::{bail, Result};
use model::config::{GptConfig, MlpKind, RopeScalingKind};
use serde_json::json;

/// A named tensor: row-major f32 values of `shape`.
#[derive(Debug, Clone, PartialEq)]
pub struct Named {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// Why `cfg` has no `LlamaForCausalLM` equivalent, if it has none.
pub fn check_layout(cfg: &GptConfig) -> Result<()> {
    if cfg.mlp != MlpKind::Swiglu {
        bail!(
            "model.mlp = \"{}\" has no LlamaForCausalLM equivalent: Llama's MLP is SwiGLU (model.mlp = \"swiglu\"); this model cannot be exported in the Llama layout",
            cfg.mlp
        );
    }
    if cfg.bias {
        bail!("model.bias = true: this export writes Llama's layers without biases");
    }
    Ok(())
}

/// `m` [rows, cols] transposed.
fn transposed(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    columns_transposed(m, rows, cols, 0, cols)
}

/// Columns `from .. from + n` of `m` [rows, cols], transposed: [n, rows].
fn columns_transposed(m: &[f32], rows: usize, cols: usize, from: usize, n: usize) -> Vec<f32> {
    let mut t = vec![0f32; n * rows];
    for r in 0..rows {
        for c in 0..n {
            t[c * rows + r] = m[r * cols + from + c];
        }
    }
    t
}

/// The Llama tensors of this engine's parameters `params` (names and shapes as a checkpoint
/// records them) for a model of `cfg`.
pub fn to_llama(cfg: &GptConfig, params: Vec<Named>) -> Result<Vec<Named>> {
    check_layout(cfg)?;
    let hd = cfg.head_dim();
    let (h, kv) = (cfg.n_head * hd, cfg.kv_heads() * hd);
    let mut out = Vec::with_capacity(params.len() + 2 * cfg.n_layer);
    let named = |name: String, shape: Vec<usize>, values: Vec<f32>| Named {
        name,
        shape,
        values,
    };
    for p in params {
        let (rows, cols) = match p.shape[..] {
            [r, c] => (r, c),
            _ => (p.shape[0], 1),
        };
        let parts: Vec<&str> = p.name.split('.').collect();
        match parts.as_slice() {
            ["wte", "weight"] => {
                out.push(named("model.embed_tokens.weight".into(), p.shape, p.values))
            }
            ["norm_f", "weight"] => out.push(named("model.norm.weight".into(), p.shape, p.values)),
            ["lm_head", "weight"] => out.push(named(
                "lm_head.weight".into(),
                vec![cols, rows],
                transposed(&p.values, rows, cols),
            )),
            ["blocks", i, rest @ ..] => {
                let layer = format!("model.layers.{i}");
                match rest {
                    ["norm1", "weight"] => out.push(named(
                        format!("{layer}.input_layernorm.weight"),
                        p.shape,
                        p.values,
                    )),
                    ["norm2", "weight"] => out.push(named(
                        format!("{layer}.post_attention_layernorm.weight"),
                        p.shape,
                        p.values,
                    )),
                    ["attn", "qkv", "weight"] => {
                        for (what, from, n) in [("q", 0, h), ("k", h, kv), ("v", h + kv, kv)] {
                            out.push(named(
                                format!("{layer}.self_attn.{what}_proj.weight"),
                                vec![n, rows],
                                columns_transposed(&p.values, rows, cols, from, n),
                            ));
                        }
                    }
                    ["attn", "proj", "weight"] => out.push(named(
                        format!("{layer}.self_attn.o_proj.weight"),
                        vec![cols, rows],
                        transposed(&p.values, rows, cols),
                    )),
                    ["mlp", "fc", "weight"] => {
                        let ff = cols / 2;
                        for (what, from) in [("gate", 0), ("up", ff)] {
                            out.push(named(
                                format!("{layer}.mlp.{what}_proj.weight"),
                                vec![ff, rows],
                                columns_transposed(&p.values, rows, cols, from, ff),
                            ));
                        }
                    }
                    ["mlp", "proj", "weight"] => out.push(named(
                        format!("{layer}.mlp.down_proj.weight"),
                        vec![cols, rows],
                        transposed(&p.values, rows, cols),
                    )),
                    _ => bail!("parameter {} has no place in the Llama layout", p.name),
                }
            }
            _ => bail!("parameter {} has no place in the Llama layout", p.name),
        }
    }
    Ok(out)
}

/// This engine's parameter `name` of `shape` from the Llama tensors `get` finds by name (an
/// error names the first tensor missing or of the wrong shape).
pub fn from_llama(
    cfg: &GptConfig,
    name: &str,
    shape: &[usize],
    get: &mut dyn FnMut(&str, &[usize]) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    check_layout(cfg)?;
    let hd = cfg.head_dim();
    let (h, kv) = (cfg.n_head * hd, cfg.kv_heads() * hd);
    let parts: Vec<&str> = name.split('.').collect();
    let (rows, cols) = match shape {
        [r, c] => (*r, *c),
        _ => (shape[0], 1),
    };
    // [n, rows] tensors side by side as the columns of [rows, sum n].
    let join = |pieces: Vec<(Vec<f32>, usize)>| -> Vec<f32> {
        let total: usize = pieces.iter().map(|p| p.1).sum();
        let mut m = vec![0f32; rows * total];
        let mut from = 0;
        for (t, n) in pieces {
            for c in 0..n {
                for r in 0..rows {
                    m[r * total + from + c] = t[c * rows + r];
                }
            }
            from += n;
        }
        m
    };
    Ok(match parts.as_slice() {
        ["wte", "weight"] => get("model.embed_tokens.weight", shape)?,
        ["norm_f", "weight"] => get("model.norm.weight", shape)?,
        ["lm_head", "weight"] => transposed(&get("lm_head.weight", &[cols, rows])?, cols, rows),
        ["blocks", i, rest @ ..] => {
            let layer = format!("model.layers.{i}");
            match rest {
                ["norm1", "weight"] => get(&format!("{layer}.input_layernorm.weight"), shape)?,
                ["norm2", "weight"] => {
                    get(&format!("{layer}.post_attention_layernorm.weight"), shape)?
                }
                ["attn", "qkv", "weight"] => {
                    let mut pieces = Vec::new();
                    for (what, n) in [("q", h), ("k", kv), ("v", kv)] {
                        pieces.push((
                            get(&format!("{layer}.self_attn.{what}_proj.weight"), &[n, rows])?,
                            n,
                        ));
                    }
                    join(pieces)
                }
                ["attn", "proj", "weight"] => transposed(
                    &get(&format!("{layer}.self_attn.o_proj.weight"), &[cols, rows])?,
                    cols,
                    rows,
                ),
                ["mlp", "fc", "weight"] => {
                    let ff = cols / 2;
                    let gate = get(&format!("{layer}.mlp.gate_proj.weight"), &[ff, rows])?;
                    let up = get(&format!("{layer}.mlp.up_proj.weight"), &[ff, rows])?;
                    join(vec![(gate, ff), (up, ff)])
                }
                ["mlp", "proj", "weight"] => transposed(
                    &get(&format!("{layer}.mlp.down_proj.weight"), &[cols, rows])?,
                    cols,
                    rows,
                ),
                _ => bail!("parameter {name} has no place in the Llama layout"),
            }
        }
        _ => bail!("parameter {name} has no place in the Llama layout"),
    })
}

/// `config.json` for `LlamaForCausalLM` of `cfg` with `vocab` tokens, weights in `dtype`
/// (`"bfloat16"` or `"float32"`).
pub fn config_json(cfg: &GptConfig, vocab: usize, dtype: &str) -> serde_json::Value {
    let rope_scaling = match cfg.rope_scaling.kind {
        RopeScalingKind::None => serde_json::Value::Null,
        RopeScalingKind::Llama3 => json!({
            "rope_type": "llama3",
            "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_context,
        }),
    };
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff_width(),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim(),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": false,
        "mlp_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "use_cache": true,
    })
}

/// `json` with RoPE's settings where `transformers` 4 writes them (`rope_theta`, `rope_scaling`):
/// `transformers` 5 writes both as one `rope_parameters` object.
fn with_rope_keys(json: &serde_json::Value) -> serde_json::Value {
    let mut json = json.clone();
    let params = json["rope_parameters"].clone();
    if params.is_object() {
        if json["rope_theta"].is_null() {
            json["rope_theta"] = params["rope_theta"].clone();
        }
        if json["rope_scaling"].is_null() {
            json["rope_scaling"] = params;
        }
    }
    json
}

/// The first difference between a `config.json` (`transformers` 4's or 5's) and the model `cfg`
/// with `vocab` tokens that changes the weights' shapes or the forward, named by both keys.
pub fn check_config(json: &serde_json::Value, cfg: &GptConfig, vocab: usize) -> Result<()> {
    let json = &with_rope_keys(json);
    let want = config_json(cfg, vocab, "float32");
    let pairs = [
        ("vocab_size", "model.vocab_size (or the tokenizer's)"),
        ("hidden_size", "model.d_model"),
        ("intermediate_size", "model.d_ff"),
        ("num_hidden_layers", "model.n_layer"),
        ("num_attention_heads", "model.n_head"),
        ("num_key_value_heads", "model.n_kv_head"),
        ("tie_word_embeddings", "model.tie_embeddings"),
        ("rope_theta", "model.rope_theta"),
        ("rms_norm_eps", "model.norm_eps"),
    ];
    for (key, ours) in pairs {
        let (a, b) = (&json[key], &want[key]);
        let same = match (a.as_f64(), b.as_f64()) {
            (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * y.abs().max(1.0),
            _ => a == b || (key == "num_key_value_heads" && a.is_null()),
        };
        if !same {
            bail!("config.json has {key} = {a}, this run's {ours} gives {b}");
        }
    }
    let (theirs, ours) = (&json["rope_scaling"], &want["rope_scaling"]);
    let scaled = |v: &serde_json::Value| !v.is_null() && v["rope_type"].as_str() != Some("default");
    let same_scaling = match (scaled(theirs), scaled(ours)) {
        (false, false) => true,
        (true, true) => [
            "rope_type",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ]
        .iter()
        .all(|k| match (theirs[k].as_f64(), ours[k].as_f64()) {
            (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * b.abs().max(1.0),
            _ => theirs[k] == ours[k],
        }),
        _ => false,
    };
    if !same_scaling {
        bail!(
            "config.json has rope_scaling = {theirs}, this run's [model.rope_scaling] gives {ours}"
        );
    }
    if json["hidden_act"].as_str().is_some_and(|a| a != "silu") {
        bail!(
            "config.json has hidden_act = {}: only silu (SwiGLU) is Llama's",
            json["hidden_act"]
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `transformers` 5 writes RoPE's theta and scaling as one `rope_parameters` object.
    #[test]
    fn a_transformers_5_config_is_read() {
        let cfg = GptConfig {
            n_kv_head: 2,
            ..GptConfig::default()
        };
        let mut json = config_json(&cfg, 97, "float32");
        let obj = json.as_object_mut().unwrap();
        obj.remove("rope_theta");
        obj.remove("rope_scaling");
        obj.insert(
            "rope_parameters".into(),
            json!({ "rope_theta": cfg.rope_theta, "rope_type": "default" }),
        );
        check_config(&json, &cfg, 97).unwrap();
        json["rope_parameters"]["rope_theta"] = json!(500000.0);
        let e = check_config(&json, &cfg, 97).unwrap_err().to_string();
        assert!(
            e.contains("rope_theta") && e.contains("model.rope_theta"),
            "{e}"
        );
        json["rope_parameters"] =
            json!({ "rope_theta": cfg.rope_theta, "rope_type": "llama3", "factor": 8.0 });
        let e = check_config(&json, &cfg, 97).unwrap_err().to_string();
        assert!(e.contains("rope_scaling"), "{e}");
    }
}
