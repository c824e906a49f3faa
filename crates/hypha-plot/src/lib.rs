//! Plots of a run's metrics as SVG, drawn with `plotters`: line charts with axes, ticks,
//! labels and a marker per point.
//!
//! `hypha quickstart`'s `loss.svg` and the scheduler's live dashboard draw their loss plots
//! with [`loss_by_round`], so the two always look alike.
//!
//! This crate knows how to draw points, not where they come from: no runs, no files, no
//! networks.

use std::ops::Range;

use plotters::prelude::*;

/// One line of a chart: its name (in the legend) and its points, in x order.
#[derive(Debug, Clone, Copy)]
pub struct Series<'a> {
    pub name: &'a str,
    pub points: &'a [(f64, f64)],
}

/// A line chart: one or more series on shared axes.
#[derive(Debug, Clone)]
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: Vec<Series<'a>>,
    /// Width and height in pixels.
    pub size: (u32, u32),
}

#[derive(Debug, thiserror::Error)]
#[error("drawing the plot failed: {0}")]
pub struct PlotError(String);

/// The colours of the series, in order (then again from the first).
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// The chart as an SVG document. Points whose coordinates are not finite are left out; a
/// chart without points has empty axes.
pub fn line_chart(chart: &Chart<'_>) -> Result<String, PlotError> {
    let finite: Vec<Vec<(f64, f64)>> = chart
        .series
        .iter()
        .map(|s| {
            s.points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect()
        })
        .collect();
    let all = || finite.iter().flatten();
    let x_range = padded(all().map(|p| p.0), 0.0);
    let y_range = padded(all().map(|p| p.1), 0.05);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, chart.size).into_drawing_area();
        root.fill(&WHITE).map_err(failed)?;
        let mut plot = ChartBuilder::on(&root)
            .caption(chart.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x_range, y_range)
            .map_err(failed)?;
        plot.configure_mesh()
            .x_desc(chart.x_label)
            .y_desc(chart.y_label)
            .x_labels(8)
            .y_labels(6)
            .x_label_formatter(&tick)
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(failed)?;
        for (n, (series, points)) in chart.series.iter().zip(&finite).enumerate() {
            let colour = PALETTE[n % PALETTE.len()];
            plot.draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))
            .map_err(failed)?
            .label(series.name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
            });
            plot.draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                .map_err(failed)?;
        }
        if chart.series.len() > 1 {
            plot.configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .draw()
                .map_err(failed)?;
        }
        root.present().map_err(failed)?;
    }
    Ok(svg)
}

/// Training loss by DiLoCo round, one marker per applied round (round, loss), and beside it
/// the held-out loss of global models (the model's round, loss): the model of round r is
/// what round r − 1 led to, and is drawn there, beside that round's training loss. Without
/// held-out losses, the training loss alone.
pub fn loss_by_round(
    training: &[(u64, f64)],
    held_out: &[(u64, f64)],
) -> Result<String, PlotError> {
    let points = |losses: &[(u64, f64)], shift: u64| -> Vec<(f64, f64)> {
        (losses.iter())
            .map(|&(r, l)| (r.saturating_sub(shift) as f64, l))
            .collect()
    };
    let (training, held_out) = (points(training, 0), points(held_out, 1));
    let mut series = vec![Series {
        name: "training loss",
        points: &training,
    }];
    let (title, y_label) = if held_out.is_empty() {
        ("Training loss by round", "training loss")
    } else {
        series.push(Series {
            name: "held-out loss",
            points: &held_out,
        });
        ("Training and held-out loss by round", "loss")
    };
    line_chart(&Chart {
        title,
        x_label: "round",
        y_label,
        series,
        size: (720, 400),
    })
}

/// A range holding every value, widened by `margin` of its span on both sides; one unit
/// wide around a single value, and 0..1 for none.
fn padded(values: impl Iterator<Item = f64>, margin: f64) -> Range<f64> {
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if low > high {
        return 0.0..1.0;
    }
    if low == high {
        return low - 0.5..high + 0.5;
    }
    let pad = (high - low) * margin;
    low - pad..high + pad
}

/// A tick label: whole numbers (rounds, steps) without a fraction, others to six decimals
/// without trailing zeros (ticks are sums of float steps: 3 × 0.1 is 0.30000000000000004).
fn tick(value: &f64) -> String {
    if value.fract() == 0.0 {
        return format!("{value:.0}");
    }
    let fixed = format!("{value:.6}");
    match fixed.trim_end_matches('0').trim_end_matches('.') {
        "0" | "-0" => format!("{value:.1e}"),
        short => short.to_string(),
    }
}

fn failed(e: impl std::fmt::Display) -> PlotError {
    PlotError(e.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The plot's markers, as (cx, cy) read back from the SVG.
    fn markers(svg: &str) -> Vec<(f64, f64)> {
        let doc = roxmltree::Document::parse(svg).unwrap();
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        doc.descendants()
            .filter(|n| n.has_tag_name("circle"))
            .map(|n| {
                let at = |a: &str| n.attribute(a).unwrap().parse::<f64>().unwrap();
                (at("cx"), at("cy"))
            })
            .collect()
    }

    fn texts(svg: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(svg).unwrap();
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text().map(|t| t.trim().to_string()))
            .collect()
    }

    #[test]
    fn ticks_read_as_people_write_numbers() {
        assert_eq!(tick(&12.0), "12");
        assert_eq!(tick(&2.5), "2.5");
        assert_eq!(tick(&(0.1 * 3.0)), "0.3");
        assert_eq!(tick(&-0.25), "-0.25");
        assert_eq!(tick(&0.0000002), "2.0e-7");
    }

    #[test]
    fn a_loss_plot_is_svg_with_a_marker_per_round_and_labelled_axes() {
        let losses: Vec<(u64, f64)> = (0..10).map(|r| (r, 2.0 / (r as f64 + 1.0))).collect();
        let svg = loss_by_round(&losses, &[]).unwrap();
        let markers = markers(&svg);
        assert_eq!(markers.len(), 10);
        // Later rounds are further right, and lower losses lower on the page (larger y).
        for pair in markers.windows(2) {
            assert!(pair[1].0 > pair[0].0, "{markers:?}");
            assert!(pair[1].1 > pair[0].1, "{markers:?}");
        }
        let texts = texts(&svg);
        for label in ["round", "training loss", "Training loss by round"] {
            assert!(texts.iter().any(|t| t == label), "{label} in {texts:?}");
        }
        // Tick labels on both axes: numbers.
        let numbers = texts.iter().filter(|t| t.parse::<f64>().is_ok()).count();
        assert!(numbers >= 6, "{texts:?}");
    }

    #[test]
    fn points_that_are_not_finite_are_left_out_and_no_points_still_draw_axes() {
        let svg = loss_by_round(
            &[(0, 1.0), (1, f64::NAN), (2, f64::INFINITY), (3, 0.5)],
            &[],
        )
        .unwrap();
        assert_eq!(markers(&svg).len(), 2);
        let svg = loss_by_round(&[], &[]).unwrap();
        assert!(markers(&svg).is_empty());
        assert!(texts(&svg).iter().any(|t| t == "round"));
        let svg = loss_by_round(&[(4, 0.3)], &[]).unwrap();
        assert_eq!(markers(&svg).len(), 1);
    }

    /// Held-out losses are a second line, named in a legend, each drawn beside the training
    /// loss of the round that led to its model.
    #[test]
    fn held_out_losses_are_a_second_line_beside_the_rounds_that_led_to_their_models() {
        let training: Vec<(u64, f64)> = (0..10).map(|r| (r, 2.0 / (r as f64 + 1.0))).collect();
        let svg = loss_by_round(&training, &[(5, 1.0), (10, 0.5)]).unwrap();
        let markers = markers(&svg);
        assert_eq!(markers.len(), 12);
        let x_of = |round: usize| markers[round].0;
        // The model of round 5 is what round 4 led to; that of round 10, round 9.
        assert!((markers[10].0 - x_of(4)).abs() < 0.5, "{markers:?}");
        assert!((markers[11].0 - x_of(9)).abs() < 0.5, "{markers:?}");
        let texts = texts(&svg);
        for label in [
            "training loss",
            "held-out loss",
            "Training and held-out loss by round",
        ] {
            assert!(texts.iter().any(|t| t == label), "{label} in {texts:?}");
        }
    }
}
