//! The loss-curve picture `keel pull` writes beside a checkpoint (`loss.png`).
//!
//! Reads `metrics.jsonl` with [`keel_proto::metrics`]. Step lines give the training loss and
//! the learning rate; eval lines give the held-out loss. Other lines are skipped. The picture
//! has the training loss (a line) and the held-out loss (a line with point markers) against
//! the left axis, in nats, and the learning rate (dashed) against a right-hand axis, with a
//! legend naming the three. Text is drawn with an embedded DejaVu Sans font, so no system
//! fonts are needed.

use anyhow::{Context, bail};
use keel_proto::metrics::{self, MetricsLine};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use std::ops::Range;
use std::path::Path;
use std::sync::Once;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static REGISTER_FONT: Once = Once::new();

/// The picture's size in pixels, width by height.
pub const PNG_SIZE: (u32, u32) = (800, 500);

const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
const EVAL_COLOR: RGBColor = RGBColor(214, 39, 40);
const LR_COLOR: RGBColor = RGBColor(44, 160, 44);

/// Points read from a metrics file: `(step, value)` pairs in file order, only finite values.
#[derive(Debug, Default, PartialEq)]
pub struct LossCurves {
    /// Training loss per step, in nats.
    pub train: Vec<(f64, f64)>,
    /// Held-out MLM loss at each evaluation, in nats.
    pub eval: Vec<(f64, f64)>,
    /// Learning rate per step (also of steps whose loss is not finite; none from files
    /// written before step lines had `lr`).
    pub lr: Vec<(f64, f64)>,
}

/// The curves of `lines`: the finite losses and learning rates of step lines and the finite
/// held-out losses of eval lines.
pub fn loss_curves(lines: &[MetricsLine]) -> LossCurves {
    let mut curves = LossCurves::default();
    for line in lines {
        match line {
            MetricsLine::Step(s) => {
                if s.loss.is_finite() {
                    curves.train.push((s.step as f64, s.loss));
                }
                if s.lr.is_finite() {
                    curves.lr.push((s.step as f64, s.lr));
                }
            }
            MetricsLine::Eval(e) if e.eval_loss.is_finite() => {
                curves.eval.push((e.step as f64, e.eval_loss));
            }
            _ => {}
        }
    }
    curves
}

/// Draws `metrics_jsonl`'s curves to `out_png` ([`PNG_SIZE`] pixels), written atomically
/// (mode 0644 on Unix).
///
/// # Errors
/// The metrics file is unreadable or malformed, it holds no loss at all, or the PNG cannot be
/// drawn or written; each error names the file concerned.
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
    draw(&curves, tmp.path()).with_context(|| {
        format!(
            "drawing {} from {}",
            out_png.display(),
            metrics_jsonl.display()
        )
    })?;
    // Temporary files are created 0600; the picture is as readable as the checkpoint beside it.
    keel_proto::atomic::persist_atomic(tmp, out_png, keel_proto::atomic::Access::Everyone)?;
    Ok(())
}

/// The axes' ranges: steps (x), losses in nats (left y), learning rate (right y; `None`
/// without one).
#[derive(Debug, PartialEq)]
struct Ranges {
    steps: Range<f64>,
    loss: Range<f64>,
    lr: Option<Range<f64>>,
}

/// The axis ranges of `curves`: steps from 0 to a little past the last, the losses with 5% room (a flat curve gets
/// room of 5% of its value), the learning rate from 0 (`None` without one).
///
/// Errors: no loss at all, or values too large to scale.
fn ranges(curves: &LossCurves) -> anyhow::Result<Ranges> {
    let steps = curves.train.iter().chain(&curves.eval).chain(&curves.lr);
    let x_max = steps.map(|p| p.0).fold(1.0f64, f64::max);
    let losses = || curves.train.iter().chain(&curves.eval).map(|p| p.1);
    let y_min = losses().fold(f64::INFINITY, f64::min);
    let y_max = losses().fold(f64::NEG_INFINITY, f64::max);
    if y_min > y_max {
        bail!("no loss to draw");
    }
    let span = y_max - y_min;
    let pad = if span > 0.0 {
        span * 0.05
    } else {
        (y_max.abs() * 0.05).max(1e-3)
    };
    if !(span + 2.0 * pad).is_finite() {
        bail!("losses from {y_min} to {y_max} are too far apart to draw");
    }
    let lr = if curves.lr.is_empty() {
        None
    } else {
        let lo = curves.lr.iter().map(|p| p.1).fold(0.0f64, f64::min);
        let hi = curves.lr.iter().map(|p| p.1).fold(0.0f64, f64::max);
        let top = if hi > lo {
            hi + (hi - lo) * 0.05
        } else {
            lo + 1.0
        };
        if !(top - lo).is_finite() {
            bail!("learning rates from {lo} to {hi} are too far apart to draw");
        }
        Some(lo..top)
    };
    // Room on the right, so that the last point's marker is not cut in half.
    let x_end = x_max + (x_max * 0.02).max(1.0);
    Ok(Ranges {
        steps: 0.0..x_end,
        loss: (y_min - pad)..(y_max + pad),
        lr,
    })
}

/// A plotters error as an `anyhow` one (plotters' errors borrow the backend's error type).
fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// A learning rate as an axis label: `1e-3`, `2.5e-4`, `0`.
fn lr_label(lr: &f64) -> String {
    if *lr == 0.0 {
        return "0".to_string();
    }
    let text = format!("{lr:.1e}");
    text.replace(".0e", "e")
}

/// A step as an axis label: whole steps only (`12`), so that a short run's fractional ticks
/// stay blank.
fn step_label(step: &f64) -> String {
    if (step - step.round()).abs() < 1e-6 {
        format!("{:.0}", step.round())
    } else {
        String::new()
    }
}

/// The marker size for a line of `points`: a dot when there is only one point (a line of one
/// point draws nothing), none otherwise.
fn lone_point(points: &[(f64, f64)]) -> u32 {
    if points.len() == 1 { 3 } else { 0 }
}

fn draw(curves: &LossCurves, path: &Path) -> anyhow::Result<()> {
    REGISTER_FONT.call_once(|| {
        // The font is compiled in; failing to parse it would be a build defect, and then
        // plotters reports the missing font when drawing text below.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
    let Ranges {
        steps: x,
        loss: y,
        lr,
    } = ranges(curves)?;
    let root = BitMapBackend::new(path, PNG_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Masked-LM pretraining", ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .right_y_label_area_size(if lr.is_some() { 72 } else { 0 })
        .build_cartesian_2d(x.clone(), y)
        .map_err(plot_err)?
        .set_secondary_coord(x, lr.clone().unwrap_or(0.0..1.0));
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats)")
        .x_label_formatter(&step_label)
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(plot_err)?;
    if lr.is_some() {
        chart
            .configure_secondary_axes()
            .y_desc("learning rate")
            .y_label_formatter(&lr_label)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()
            .map_err(plot_err)?;
    }
    if !curves.train.is_empty() {
        chart
            .draw_series(
                LineSeries::new(
                    curves.train.iter().copied(),
                    TRAIN_COLOR.filled().stroke_width(1),
                )
                .point_size(lone_point(&curves.train)),
            )
            .map_err(plot_err)?
            .label("training loss")
            .legend(|(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], TRAIN_COLOR.stroke_width(2))
            });
    }
    if !curves.eval.is_empty() {
        let style = EVAL_COLOR.filled().stroke_width(2);
        chart
            .draw_series(LineSeries::new(curves.eval.iter().copied(), style).point_size(4))
            .map_err(plot_err)?
            .label("held-out loss")
            .legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (24, 0)], style)
                    + Circle::new((12, 0), 4, style)
            });
    }
    if lr.is_some() {
        if let [point] = curves.lr[..] {
            // A dashed line of one point draws nothing: mark a lone learning rate with a dot.
            chart
                .draw_secondary_series([Circle::new(point, 3, LR_COLOR.filled())])
                .map_err(plot_err)?;
        }
        chart
            .draw_secondary_series(DashedLineSeries::new(
                curves.lr.iter().copied(),
                6,
                4,
                LR_COLOR.stroke_width(2),
            ))
            .map_err(plot_err)?
            .label("learning rate (right axis)")
            .legend(|(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 24, y)], 6, 4, LR_COLOR.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_loss_curves(text: &str) -> anyhow::Result<LossCurves> {
        let lines = metrics::parse_all(Path::new(metrics::METRICS_FILE), text)?;
        Ok(loss_curves(&lines))
    }

    /// The width and height a PNG's header (its IHDR chunk) gives, after checking the
    /// signature.
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert!(bytes.len() > 24, "{} bytes", bytes.len());
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |at: usize| {
            u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        (be(16), be(20))
    }

    /// Writes `text` as a metrics file, draws it, and returns the PNG's bytes after checking
    /// its size.
    fn png_of(text: &str) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(&metrics, text).unwrap();
        let png = dir.path().join("loss.png");
        write_loss_png(&metrics, &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(png_size(&bytes), PNG_SIZE);
        bytes
    }

    #[test]
    fn curves_come_from_step_and_loss_lines() {
        let text = "{\"step\":1,\"loss\":9.5,\"lr\":1e-4}\n\n{\"step\":2,\"loss\":9.1}\n{\"step\":2,\"eval_loss\":9.3}\n{\"event\":\"done\"}\n";
        let c = read_loss_curves(text).unwrap();
        assert_eq!(c.train, vec![(1.0, 9.5), (2.0, 9.1)]);
        assert_eq!(c.eval, vec![(2.0, 9.3)]);
        assert_eq!(c.lr, vec![(1.0, 1e-4)]);
    }

    #[test]
    fn a_skipped_step_has_a_learning_rate_but_no_loss() {
        let text = "{\"step\":1,\"loss\":9.5,\"lr\":1e-4}\n{\"step\":2,\"loss\":null,\"lr\":2e-4,\"skipped\":true}\n{\"step\":3,\"loss\":9.0,\"lr\":null}\n{\"step\":3,\"eval_loss\":null}\n";
        let c = read_loss_curves(text).unwrap();
        assert_eq!(c.train, vec![(1.0, 9.5), (3.0, 9.0)]);
        assert_eq!(c.lr, vec![(1.0, 1e-4), (2.0, 2e-4)]);
        assert!(c.eval.is_empty());
    }

    #[test]
    fn malformed_line_is_named() {
        let e = read_loss_curves("{\"step\":1,\"loss\":2}\nnot json\n").unwrap_err();
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
    }

    #[test]
    fn ranges_pad_flat_curves_and_start_the_learning_rate_at_zero() {
        let flat = LossCurves {
            train: vec![(1.0, 9.0)],
            ..Default::default()
        };
        let Ranges {
            steps: x,
            loss: y,
            lr,
        } = ranges(&flat).unwrap();
        assert_eq!(x, 0.0..2.0);
        assert!(y.start < 9.0 && y.end > 9.0, "{y:?}");
        assert_eq!(lr, None);
        let sloped = LossCurves {
            train: vec![(1.0, 10.0), (20.0, 5.0)],
            eval: vec![(20.0, 6.0)],
            lr: vec![(1.0, 1e-4), (20.0, 1e-3)],
        };
        let Ranges {
            steps: x,
            loss: y,
            lr,
        } = ranges(&sloped).unwrap();
        assert_eq!(x, 0.0..21.0);
        assert_eq!(y, 4.75..10.25);
        let lr = lr.unwrap();
        assert_eq!(lr.start, 0.0);
        assert!(lr.end > 1e-3 && lr.end < 1.1e-3, "{lr:?}");
        assert!(ranges(&LossCurves::default()).is_err());
    }

    #[test]
    fn axis_labels_are_short() {
        assert_eq!(lr_label(&0.0), "0");
        assert_eq!(lr_label(&1e-3), "1e-3");
        assert_eq!(lr_label(&2.5e-4), "2.5e-4");
        assert_eq!(step_label(&200.0), "200");
        assert_eq!(step_label(&0.5), "");
        assert_eq!(step_label(&0.999_999_999), "1");
    }

    #[test]
    fn writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let lines: String = (1..=50)
            .map(|s| {
                let lr = 1e-3 * (s as f64 / 10.0).min(1.0);
                format!(
                    "{{\"step\":{s},\"loss\":{},\"lr\":{lr}}}\n",
                    9.0 / (s as f64).sqrt()
                )
            })
            .collect();
        let evals = "{\"step\":25,\"eval_loss\":2.0}\n{\"step\":50,\"eval_loss\":1.5}\n";
        std::fs::write(&metrics, lines + evals).unwrap();
        let png = dir.path().join("loss.png");
        write_loss_png(&metrics, &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(png_size(&bytes), PNG_SIZE);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&png).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o644, "loss.png mode {mode:o}");
        }
        assert!(bytes.len() > 2000, "{} bytes", bytes.len());
    }

    #[test]
    fn writes_a_png_without_eval_or_learning_rate() {
        // An old file: no `lr` field, or `lr` written as null; no eval line.
        let text: String = (1..=20)
            .map(|s| match s % 2 {
                0 => format!("{{\"step\":{s},\"loss\":{}}}\n", 10.0 - s as f64 / 4.0),
                _ => format!(
                    "{{\"step\":{s},\"loss\":{},\"lr\":null}}\n",
                    10.0 - s as f64 / 4.0
                ),
            })
            .collect();
        let c = read_loss_curves(&text).unwrap();
        assert!(c.lr.is_empty() && c.eval.is_empty() && c.train.len() == 20);
        png_of(&text);
    }

    #[test]
    fn writes_a_png_of_a_single_step() {
        png_of("{\"step\":1,\"loss\":9.5,\"lr\":1e-4}\n");
        png_of("{\"step\":1,\"loss\":9.5,\"lr\":0.0}\n{\"step\":1,\"eval_loss\":9.5}\n");
    }

    #[test]
    fn writes_a_png_of_evaluations_only() {
        png_of("{\"step\":100,\"eval_loss\":7.0}\n{\"step\":200,\"eval_loss\":6.0}\n");
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
        assert!(e.to_string().contains("metrics.jsonl"), "{e}");
    }

    #[test]
    fn a_bad_metrics_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let png = dir.path().join("loss.png");
        let e = write_loss_png(&metrics, &png).unwrap_err();
        assert!(format!("{e:#}").contains("metrics.jsonl"), "{e:#}");
        std::fs::write(&metrics, "{\"step\":1,\"loss\":\"high\"}\n").unwrap();
        let e = write_loss_png(&metrics, &png).unwrap_err();
        assert!(format!("{e:#}").contains("metrics.jsonl"), "{e:#}");
        assert!(!png.exists());
    }
}
