//! What a comparison trains: the built-in recipes, a recipe given on the command line, the plan
//! (every recipe at every learning rate and seed) and its entries, each an ordinary run directory.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::config::Config;

/// The built-in recipes: name, what it is, and the config overrides it applies.
pub const RECIPES: &[(&str, &str, &[&str])] = &[
    ("fp32", "f32 everywhere", &["precision=fp32"]),
    (
        "bf16",
        "bf16 matmuls and activations, f32 master weights (CUDA)",
        &["precision=bf16"],
    ),
    (
        "fp16",
        "f16 matmuls and activations, f32 master weights, dynamic loss scaling",
        &["precision=fp16", "loss_scale.mode=dynamic"],
    ),
    (
        "fp16-noscale",
        "fp16 without loss scaling",
        &["precision=fp16", "loss_scale.mode=off"],
    ),
    (
        "fp8",
        "projection GEMMs in FP8 (E4M3, 1x128 / 128x128 scales), bf16 elsewhere (CUDA)",
        &["precision=fp8"],
    ),
    (
        "fp8-hybrid",
        "fp8 with E5M2 output gradients",
        &["precision=fp8", "fp8.format=hybrid"],
    ),
    (
        "fp8-tensor",
        "fp8 with one scale per tensor",
        &["precision=fp8", "fp8.scaling=tensor"],
    ),
];

/// One recipe of a comparison: a name and the overrides that make it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecipeSpec {
    pub name: String,
    pub overrides: Vec<String>,
}

impl RecipeSpec {
    /// `NAME` (a built-in recipe) or `NAME:key=value,key=value` (a built-in recipe with extra
    /// overrides, or a new name defined by its overrides alone).
    pub fn parse(text: &str) -> Result<Self> {
        let (name, extra) = match text.split_once(':') {
            Some((n, rest)) => (n.trim(), Some(rest)),
            None => (text.trim(), None),
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            bail!("recipe '{text}': a name is letters, digits, '-', '_' or '.', optionally followed by ':key=value,...'");
        }
        let mut overrides: Vec<String> = match RECIPES.iter().find(|r| r.0 == name) {
            Some(r) => r.2.iter().map(|s| s.to_string()).collect(),
            None if extra.is_none() => bail!(
                "unknown recipe '{name}'; built-in recipes: {} (or define one as NAME:key=value,...; `compare --list` shows what each sets)",
                RECIPES.iter().map(|r| r.0).collect::<Vec<_>>().join(", ")
            ),
            None => Vec::new(),
        };
        if let Some(extra) = extra {
            for ov in extra.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                if !ov.contains('=') {
                    bail!("recipe '{text}': override '{ov}' is not key=value");
                }
                overrides.push(ov.to_string());
            }
            if overrides.is_empty() {
                bail!("recipe '{text}': no overrides after ':'");
            }
        }
        Ok(Self {
            name: name.to_string(),
            overrides,
        })
    }
}

/// What a comparison trains: every recipe at every learning rate and seed (saved as
/// `compare.json` in the comparison directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    /// The config every entry starts from, as TOML text, and where it came from.
    pub base_toml: String,
    pub origin: String,
    /// Overrides applied to every entry (before the recipe's).
    pub sets: Vec<String>,
    pub recipes: Vec<RecipeSpec>,
    /// Empty: the config's learning rate.
    pub lrs: Vec<f64>,
    /// Empty: the config's seed.
    pub seeds: Vec<u64>,
    pub steps: Option<u64>,
}

/// One run of a comparison.
#[derive(Debug, Clone)]
pub struct Entry {
    pub recipe: String,
    pub lr: f64,
    pub seed: u64,
    pub dir_name: String,
    pub config: Config,
}

impl Plan {
    /// Every entry's config (each validated, so that a bad override stops the comparison before
    /// anything trains).
    pub fn entries(&self) -> Result<Vec<Entry>> {
        if self.recipes.is_empty() {
            bail!("--recipes lists no recipe");
        }
        let mut names: Vec<&str> = self.recipes.iter().map(|r| r.name.as_str()).collect();
        names.sort();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            bail!("recipe '{}' is listed twice", w[0]);
        }
        let lrs: Vec<Option<f64>> = if self.lrs.is_empty() {
            vec![None]
        } else {
            self.lrs.iter().copied().map(Some).collect()
        };
        let seeds: Vec<Option<u64>> = if self.seeds.is_empty() {
            vec![None]
        } else {
            self.seeds.iter().copied().map(Some).collect()
        };
        let mut out = Vec::new();
        for r in &self.recipes {
            for &lr in &lrs {
                for &seed in &seeds {
                    let mut sets = self.sets.clone();
                    sets.extend(r.overrides.iter().cloned());
                    if let Some(lr) = lr {
                        sets.push(format!("optimizer.lr={lr:e}"));
                    }
                    if let Some(seed) = seed {
                        sets.push(format!("seed={seed}"));
                    }
                    if let Some(steps) = self.steps {
                        sets.push(format!("training.steps={steps}"));
                    }
                    let mut dir_name = r.name.clone();
                    if let Some(lr) = lr {
                        let _ = write!(dir_name, "-lr{lr:e}");
                    }
                    if let Some(seed) = seed {
                        let _ = write!(dir_name, "-seed{seed}");
                    }
                    let config = Config::from_toml_str(&self.base_toml, &sets, &self.origin)
                        .with_context(|| {
                            format!(
                                "recipe '{}' (overrides: {})",
                                r.name,
                                r.overrides.join(", ")
                            )
                        })?;
                    out.push(Entry {
                        recipe: r.name.clone(),
                        lr: config.optimizer.lr,
                        seed: config.seed,
                        dir_name,
                        config,
                    });
                }
            }
        }
        Ok(out)
    }
}

/// The run directory of an entry.
pub fn entry_dir(dir: &Path, entry: &Entry) -> PathBuf {
    dir.join("runs").join(&entry.dir_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipes_parse_or_name_what_is_wrong() {
        assert_eq!(
            RecipeSpec::parse("fp16-noscale").unwrap().overrides,
            ["precision=fp16", "loss_scale.mode=off"]
        );
        let r = RecipeSpec::parse("fp16:loss_scale.init=1024").unwrap();
        assert_eq!(
            r.overrides,
            [
                "precision=fp16",
                "loss_scale.mode=dynamic",
                "loss_scale.init=1024"
            ]
        );
        assert_eq!(
            RecipeSpec::parse("mine:precision=fp16").unwrap().overrides,
            ["precision=fp16"]
        );
        let e = RecipeSpec::parse("fp64").unwrap_err().to_string();
        assert!(
            e.contains("unknown recipe 'fp64'") && e.contains("fp16-noscale"),
            "{e}"
        );
        assert!(RecipeSpec::parse("x:precision")
            .unwrap_err()
            .to_string()
            .contains("'precision' is not key=value"));
        assert!(RecipeSpec::parse("a b").is_err());
    }
}
