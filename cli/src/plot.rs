//! The loss-curve picture `keel pull` writes beside a checkpoint (`loss.png`).
//!
//! Reads `metrics.jsonl` with [`keel_proto::metrics`]. Step lines form the training curve;
//! eval lines are drawn as evaluation points. Other lines are skipped. Text is drawn with an
//! embedded DejaVu Sans font, so no system fonts are needed.

use anyhow::{Context, bail};
use keel_proto::metrics::{self, MetricsLine};
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static REGISTER_FONT: Once = Once::new();

/// Points read from a metrics file: `(step, loss)` pairs.
#[derive(Debug, Default, PartialEq)]
pub struct LossCurves {
    /// Training loss per step.
    pub train: Vec<(f64, f64)>,
    /// Held-out MLM loss at each evaluation.
    pub eval: Vec<(f64, f64)>,
}

/// The training and evaluation curves of `lines`: the finite losses of step and eval lines.
pub fn loss_curves(lines: &[MetricsLine]) -> LossCurves {
    let mut curves = LossCurves::default();
    for line in lines {
        match line {
            MetricsLine::Step(s) if s.loss.is_finite() => {
                curves.train.push((s.step as f64, s.loss));
            }
            MetricsLine::Eval(e) if e.eval_loss.is_finite() => {
                curves.eval.push((e.step as f64, e.eval_loss));
            }
            _ => {}
        }
    }
    curves
}

/// Draws `metrics_jsonl`'s loss curves to `out_png` (800 x 500 pixels), written atomically.
///
/// # Errors
/// The metrics file is unreadable or malformed, it holds no loss at all, or the PNG cannot be
/// written.
pub fn write_loss_png(metrics_jsonl: &Path, out_png: &Path) -> anyhow::Result<()> {
    let curves = loss_curves(&metrics::read(metrics_jsonl)?);
    if curves.train.is_empty() && curves.eval.is_empty() {
        bail!("{}: no line has a step and a loss", metrics_jsonl.display());
    }
    let dir = match out_png.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".loss-")
        .suffix(".png")
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    draw(&curves, tmp.path())?;
    // Temporary files are created 0600; the picture is as readable as the checkpoint beside it.
    keel_proto::atomic::persist_atomic(tmp, out_png, keel_proto::atomic::Access::Everyone)?;
    Ok(())
}

fn draw(curves: &LossCurves, path: &Path) -> anyhow::Result<()> {
    REGISTER_FONT.call_once(|| {
        // The font is compiled in; failing to parse it would be a build defect, and then
        // plotters reports the missing font when drawing text below.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
    let all = curves.train.iter().chain(curves.eval.iter());
    let (mut x_max, mut y_min, mut y_max) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in all {
        x_max = x_max.max(x);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Masked-LM loss", ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, (y_min - pad)..(y_max + pad))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats)")
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if !curves.train.is_empty() {
        chart
            .draw_series(LineSeries::new(curves.train.iter().copied(), &BLUE))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label("train")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    }
    if !curves.eval.is_empty() {
        chart
            .draw_series(
                curves
                    .eval
                    .iter()
                    .map(|&(x, y)| Circle::new((x, y), 4, RED.filled())),
            )
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label("held-out")
            .legend(|(x, y)| Circle::new((x + 10, y), 4, RED.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_loss_curves(text: &str) -> anyhow::Result<LossCurves> {
        let lines = metrics::parse_all(Path::new(metrics::METRICS_FILE), text)?;
        Ok(loss_curves(&lines))
    }

    #[test]
    fn curves_come_from_step_and_loss_lines() {
        let text = "{\"step\":1,\"loss\":9.5,\"lr\":1e-4}\n\n{\"step\":2,\"loss\":9.1}\n{\"step\":2,\"eval_loss\":9.3}\n{\"event\":\"done\"}\n";
        let c = read_loss_curves(text).unwrap();
        assert_eq!(c.train, vec![(1.0, 9.5), (2.0, 9.1)]);
        assert_eq!(c.eval, vec![(2.0, 9.3)]);
    }

    #[test]
    fn malformed_line_is_named() {
        let e = read_loss_curves("{\"step\":1,\"loss\":2}\nnot json\n").unwrap_err();
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
    }

    #[test]
    fn writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let lines: String = (1..=50)
            .map(|s| format!("{{\"step\":{s},\"loss\":{}}}\n", 9.0 / (s as f64).sqrt()))
            .collect();
        std::fs::write(&metrics, lines + "{\"step\":50,\"eval_loss\":1.5}\n").unwrap();
        let png = dir.path().join("loss.png");
        write_loss_png(&metrics, &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&png).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o644, "loss.png mode {mode:o}");
        }
        assert!(bytes.len() > 2000, "{} bytes", bytes.len());
    }

    #[test]
    fn metrics_without_loss_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(&metrics, "{\"step\":1}\n").unwrap();
        let e = write_loss_png(&metrics, &dir.path().join("loss.png")).unwrap_err();
        assert!(
            e.to_string().contains("no line has a step and a loss"),
            "{e}"
        );
    }
}
