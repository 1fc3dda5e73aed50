//! The overlaid curves of a comparison (training and validation loss, gradient norm, loss scale)
//! and the learning-rate sensitivity plot, as SVG.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

use super::plan::RecipeSpec;
use super::rows::EntryReport;
use crate::metrics::StepRecord;

/// Recipe colour: its position in the command's recipe list.
fn recipe_colour(recipes: &[RecipeSpec], recipe: &str) -> RGBColor {
    palette(recipes.iter().position(|r| r.name == recipe).unwrap_or(0))
}

/// The overlaid curves: training and validation loss, gradient norm and, when a recipe scales
/// the loss, the loss scale. Returns the files written.
pub(super) fn curve_plots(
    dir: &Path,
    recipes: &[RecipeSpec],
    entries: &[EntryReport],
) -> Result<Vec<String>> {
    let mut plots = Vec::new();
    let colour = |recipe: &str| recipe_colour(recipes, recipe);
    let series =
        |f: &dyn Fn(&StepRecord) -> Option<f64>| -> Vec<(String, RGBColor, Vec<(f64, f64)>)> {
            entries
                .iter()
                .map(|e| {
                    (
                        e.name.clone(),
                        colour(&e.recipe),
                        e.records
                            .iter()
                            .filter_map(|r| {
                                f(r).filter(|v| v.is_finite()).map(|v| (r.step as f64, v))
                            })
                            .collect(),
                    )
                })
                .collect()
        };
    plot(
        &dir.join("train_loss.svg"),
        "training loss",
        "step",
        "loss (nats/token)",
        &series(&|r| Some(r.loss)),
        false,
    )?;
    plots.push("train_loss.svg".to_string());
    plot(
        &dir.join("val_loss.svg"),
        "validation loss",
        "step",
        "loss (nats/token)",
        &series(&|r| r.val_loss),
        true,
    )?;
    plots.push("val_loss.svg".to_string());
    plot(
        &dir.join("grad_norm.svg"),
        "gradient norm (before clipping)",
        "step",
        "norm",
        &series(&|r| Some(r.grad_norm)),
        false,
    )?;
    plots.push("grad_norm.svg".to_string());
    if entries.iter().any(|e| e.loss_scale_max.is_some()) {
        plot(
            &dir.join("loss_scale.svg"),
            "loss scale (log2)",
            "step",
            "log2(scale)",
            &series(&|r| Some(r.loss_scale.log2())),
            false,
        )?;
        plots.push("loss_scale.svg".to_string());
    }
    Ok(plots)
}

/// With several learning rates: best validation loss (mean over seeds) against log10(lr), one line
/// per recipe (Wortsman et al. 2023). Returns the file written, if any.
pub(super) fn lr_sensitivity_plot(
    dir: &Path,
    recipes: &[RecipeSpec],
    entries: &[EntryReport],
) -> Result<Option<String>> {
    let mut lrs: Vec<f64> = entries.iter().map(|e| e.lr).collect();
    lrs.sort_by(|a, b| a.total_cmp(b));
    lrs.dedup();
    if lrs.len() < 2 {
        return Ok(None);
    }
    let lines: Vec<(String, RGBColor, Vec<(f64, f64)>)> = recipes
        .iter()
        .map(|r| {
            let pts = lrs
                .iter()
                .filter_map(|&lr| {
                    let v: Vec<f64> = entries
                        .iter()
                        .filter(|e| e.recipe == r.name && e.lr == lr)
                        .filter_map(|e| e.best_val_loss)
                        .collect();
                    (!v.is_empty()).then(|| (lr.log10(), v.iter().sum::<f64>() / v.len() as f64))
                })
                .collect();
            (r.name.clone(), recipe_colour(recipes, &r.name), pts)
        })
        .collect();
    plot(
        &dir.join("lr_sensitivity.svg"),
        "learning-rate sensitivity",
        "log10(learning rate)",
        "best validation loss",
        &lines,
        true,
    )?;
    Ok(Some("lr_sensitivity.svg".to_string()))
}

fn palette(i: usize) -> RGBColor {
    const P: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    P[i % P.len()]
}

/// Overlaid line plots, one series per entry (points marked when `marks`).
fn plot(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, RGBColor, Vec<(f64, f64)>)],
    marks: bool,
) -> Result<()> {
    let e =
        |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("plot {}: {e}", path.display());
    let pts = series.iter().flat_map(|s| s.2.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let (px, py) = (((x1 - x0) * 0.03).max(1e-3), ((y1 - y0) * 0.05).max(1e-3));
    crate::fsutil::replace_with(path, |tmp| {
        let root = SVGBackend::new(tmp, (900, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((x0 - px)..(x1 + px), (y0 - py)..(y1 + py))
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(e)?;
        for (name, c, data) in series {
            let c = *c;
            chart
                .draw_series(LineSeries::new(
                    data.iter().copied(),
                    c.stroke_width(if marks { 2 } else { 1 }),
                ))
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            if marks {
                chart
                    .draw_series(
                        data.iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, c.filled())),
                    )
                    .map_err(e)?;
            }
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
        Ok(())
    })
}
