//! Per-layer numerics over training as heatmaps: FP8 health, or fp16/bf16 gradient numerics,
//! one row per tracked tensor and one column per step with a record.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

use super::rows::EntryReport;
use crate::metrics::{LayerHealth, StepRecord};

/// Per-layer numerics of the low-precision entries, as heatmaps: FP8's health records (every
/// `fp8.health_interval` steps), fp16's and bf16's numerics records (every
/// `training.numerics_interval` steps). Returns the files written.
pub(super) fn numerics_plots(dir: &Path, entries: &[EntryReport]) -> Result<Vec<String>> {
    let mut plots = Vec::new();
    for e in entries {
        if let Some(h) = numerics_grid(&e.records) {
            let file = format!("numerics-{}.svg", e.name);
            let what = if e.records.iter().any(|r| r.fp8.is_some()) {
                "FP8 numerics per tensor (underflow: nonzero values quantized to zero; saturated: clipped)".to_string()
            } else {
                let format = e
                    .records
                    .iter()
                    .find(|r| r.numerics.is_some())
                    .map_or("", |r| r.precision.as_str());
                format!("{format} gradient numerics per tensor (underflow: nonzero values below the smallest normal, loss scale applied; saturated: not finite)")
            };
            heatmaps(&dir.join(&file), &format!("{}: {what}", e.name), &h)?;
            plots.push(file);
        }
    }

    Ok(plots)
}

/// Per-layer numerics over training (FP8 health, or fp16/bf16 gradient numerics): one row per
/// tracked tensor (a projection's weight, input, output gradient or weight gradient), one column
/// per step with a record.
#[derive(Debug, PartialEq)]
pub struct NumericsGrid {
    pub rows: Vec<String>,
    pub steps: Vec<u64>,
    /// `[row][column]`: share of nonzero values that quantize to zero (NaN where not recorded).
    pub underflow: Vec<Vec<f64>>,
    /// `[row][column]`: share of values clipped at the format's largest value.
    pub saturated: Vec<Vec<f64>>,
}

/// The per-layer numerics records of a run (`fp8`, or else `numerics`) as a grid, or `None` when
/// it has none.
pub fn numerics_grid(records: &[StepRecord]) -> Option<NumericsGrid> {
    let of = |r: &StepRecord| -> Option<Vec<LayerHealth>> {
        r.fp8
            .clone()
            .or_else(|| r.numerics.clone())
            .filter(|v| !v.is_empty())
    };
    let with: Vec<(u64, Vec<LayerHealth>)> = records
        .iter()
        .filter_map(|r| of(r).map(|h| (r.step, h)))
        .collect();
    if with.is_empty() {
        return None;
    }
    let mut rows: Vec<String> = Vec::new();
    for (_, hs) in &with {
        for h in hs {
            if !rows.contains(&h.layer) {
                rows.push(h.layer.clone());
            }
        }
    }
    let steps: Vec<u64> = with.iter().map(|r| r.0).collect();
    let mut underflow = vec![vec![f64::NAN; steps.len()]; rows.len()];
    let mut saturated = vec![vec![f64::NAN; steps.len()]; rows.len()];
    for (c, (_, hs)) in with.iter().enumerate() {
        for h in hs {
            let i = rows.iter().position(|l| l == &h.layer).expect("row");
            underflow[i][c] = h.underflow;
            saturated[i][c] = h.saturated;
        }
    }
    Some(NumericsGrid {
        rows,
        steps,
        underflow,
        saturated,
    })
}

/// Two heatmaps side by side (underflow, saturation), tensors by step, white (0) to red (the
/// largest share in the panel, printed in its title), grey where nothing was recorded.
fn heatmaps(path: &Path, title: &str, g: &NumericsGrid) -> Result<()> {
    let e =
        |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("plot {}: {e}", path.display());
    let height = (120 + 14 * g.rows.len()).clamp(300, 2400) as u32;
    crate::fsutil::replace_with(path, |tmp| {
        let root = SVGBackend::new(tmp, (1400, height)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(title, ("sans-serif", 20)).map_err(e)?;
        let panels = root.split_evenly((1, 2));
        for (panel, (name, data)) in panels
            .iter()
            .zip([("underflow", &g.underflow), ("saturated", &g.saturated)])
        {
            let max = data
                .iter()
                .flatten()
                .copied()
                .filter(|v| v.is_finite())
                .fold(0.0f64, f64::max);
            let (nr, nc) = (g.rows.len(), g.steps.len());
            let mut chart = ChartBuilder::on(panel)
                .caption(format!("{name} share (max {max:.2e})"), ("sans-serif", 16))
                .margin(8)
                .x_label_area_size(36)
                .y_label_area_size(if name == "underflow" { 230 } else { 10 })
                .build_cartesian_2d(0..nc, 0..nr)
                .map_err(e)?;
            let rows = g.rows.clone();
            let steps = g.steps.clone();
            chart
                .configure_mesh()
                .disable_mesh()
                .x_desc("step")
                .x_labels(nc.min(10))
                .x_label_formatter(&|c| steps.get(*c).map_or(String::new(), |s| s.to_string()))
                .y_labels(nr)
                .y_label_formatter(&|r| {
                    if name == "underflow" {
                        rows.get(nr.saturating_sub(1 + *r))
                            .cloned()
                            .unwrap_or_default()
                    } else {
                        String::new()
                    }
                })
                .label_style(("sans-serif", 11))
                .draw()
                .map_err(e)?;
            chart
                .draw_series(
                    (0..nr)
                        .flat_map(|r| (0..nc).map(move |c| (r, c)))
                        .map(|(r, c)| {
                            let v = data[r][c];
                            let colour = if !v.is_finite() {
                                RGBColor(200, 200, 200)
                            } else {
                                let t = if max > 0.0 {
                                    (v / max).clamp(0.0, 1.0)
                                } else {
                                    0.0
                                };
                                let fade = (255.0 * (1.0 - t)) as u8;
                                RGBColor(255, fade, fade)
                            };
                            // Row 0 at the top.
                            let y = nr - 1 - r;
                            Rectangle::new([(c, y), (c + 1, y + 1)], colour.filled())
                        }),
                )
                .map_err(e)?;
        }
        root.present().map_err(e)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::testing::smooth;

    #[test]
    fn fp8_health_becomes_a_heatmap() {
        let mut rs = smooth(30);
        let h = |layer: &str, u: f64| LayerHealth {
            layer: layer.into(),
            amax: 1.0,
            underflow: u,
            saturated: u / 10.0,
        };
        rs[0].fp8 = Some(vec![
            h("blocks.0.attn.qkv.weight", 0.01),
            h("blocks.0.attn.qkv.grad_output", 0.2),
        ]);
        rs[19].fp8 = Some(vec![h("blocks.0.attn.qkv.grad_output", 0.3)]);
        let g = numerics_grid(&rs).expect("grid");
        assert_eq!(
            g.rows,
            ["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.grad_output"]
        );
        assert_eq!(g.steps, [1, 20]);
        assert_eq!(g.underflow[1], [0.2, 0.3]);
        assert!(g.underflow[0][1].is_nan(), "not recorded at step 20");
        assert!(numerics_grid(&smooth(5)).is_none());
        // fp16/bf16 records make the same grid.
        let mut rs = smooth(3);
        rs[0].numerics = Some(vec![h("blocks.0.mlp.fc.weight_grad", 0.5)]);
        let g16 = numerics_grid(&rs).expect("grid from numerics");
        assert_eq!(g16.rows, ["blocks.0.mlp.fc.weight_grad"]);
        assert_eq!(g16.underflow, [[0.5]]);
        let path = std::env::temp_dir().join(format!("burnmix-heatmap-{}.svg", std::process::id()));
        heatmaps(&path, "test", &g).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("<svg") && svg.contains("<rect") && svg.contains("grad_output"));
        let _ = std::fs::remove_file(&path);
    }
}
