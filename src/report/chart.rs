//! Dependency-free SVG line charts over steps: one line per series (the bucket means) with a
//! shaded min–max band where a bucket holds several steps, axes with round ticks, a legend.

use std::fmt::Write;

use super::series::{downsample, Bucket, Series, DEFAULT_MAX_POINTS};

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 300.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 40.0;
/// Series with at most this many points also get a marker per point.
const MARKERS_UP_TO: usize = 60;
/// Line colors, in series order (matplotlib's tab10).
const COLORS: [&str; 10] =
    ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

/// What to draw.
#[derive(Debug, Clone)]
pub struct Chart<'a> {
    /// Title above the plot.
    pub title: &'a str,
    /// Label of the y axis (unit).
    pub y_label: &'a str,
    /// The series, drawn in order.
    pub series: &'a [Series],
    /// The x axis spans these steps (the whole run, so every chart lines up).
    pub steps: (i64, i64),
    /// Most buckets per series.
    pub max_points: usize,
    /// Start the y axis at 0 when every value is positive.
    pub y_from_zero: bool,
}

impl<'a> Chart<'a> {
    /// A chart of `series` over the steps they cover, with the defaults.
    pub fn new(title: &'a str, y_label: &'a str, series: &'a [Series]) -> Chart<'a> {
        let first = series.iter().filter_map(|s| s.points.first().map(|p| p.0)).min().unwrap_or(0);
        let last = series.iter().filter_map(|s| s.points.last().map(|p| p.0)).max().unwrap_or(first);
        Chart { title, y_label, series, steps: (first, last), max_points: DEFAULT_MAX_POINTS, y_from_zero: false }
    }
}

/// Renders `chart` as an SVG document.
pub fn line_chart(chart: &Chart<'_>) -> String {
    let (first, last) = chart.steps;
    let buckets: Vec<Vec<Bucket>> =
        chart.series.iter().map(|s| downsample(&s.points, first, last, chart.max_points)).collect();
    let (lo, hi) = y_range(&buckets, chart.y_from_zero);
    let (x_lo, x_hi) = (first as f64, (last as f64).max(first as f64 + 1.0));
    let x = |s: f64| LEFT + (s - x_lo) / (x_hi - x_lo) * (WIDTH - LEFT - RIGHT);
    let y = |v: f64| HEIGHT - BOTTOM - (v - lo) / (hi - lo) * (HEIGHT - TOP - BOTTOM);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(svg, r#"<text x="{LEFT}" y="18" font-size="14" font-weight="bold">{}</text>"#, escape(chart.title));
    axes(&mut svg, (lo, hi), (x_lo, x_hi), &x, &y, chart.y_label);
    for (i, (series, buckets)) in chart.series.iter().zip(&buckets).enumerate() {
        let color = COLORS[i % COLORS.len()];
        draw_series(&mut svg, buckets, color, &x, &y);
        legend_entry(&mut svg, i, &series.name, color);
    }
    if buckets.iter().all(|b| b.is_empty()) {
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#888">no data</text>"##,
            (LEFT + WIDTH - RIGHT) / 2.0,
            HEIGHT / 2.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn y_range(buckets: &[Vec<Bucket>], from_zero: bool) -> (f64, f64) {
    let all = buckets.iter().flatten();
    let lo = all.clone().map(|b| b.min).fold(f64::INFINITY, f64::min);
    let hi = all.map(|b| b.max).fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let lo = if from_zero && lo > 0.0 { 0.0 } else { lo };
    if hi - lo < 1e-12 {
        let pad = if hi.abs() > 1e-12 { hi.abs() * 0.1 } else { 1.0 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    (if from_zero && lo == 0.0 { 0.0 } else { lo - pad }, hi + pad)
}

/// Round tick values covering `[lo, hi]`, about `count` of them.
fn ticks(lo: f64, hi: f64, count: usize) -> Vec<f64> {
    let raw = (hi - lo) / count.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude);
    let mut tick = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while tick <= hi + step * 1e-9 && out.len() < 50 {
        out.push(if tick.abs() < step * 1e-9 { 0.0 } else { tick });
        tick += step;
    }
    out
}

fn number(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e6 {
        trimmed(v / 1e6, "M")
    } else if a >= 1e5 {
        trimmed(v / 1e3, "k")
    } else if a < 1e-3 {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        trimmed(v, "")
    }
}

/// `v` with up to three decimals, trailing zeros dropped, then `suffix`.
fn trimmed(v: f64, suffix: &str) -> String {
    let s = format!("{v:.3}");
    format!("{}{suffix}", s.trim_end_matches('0').trim_end_matches('.'))
}

fn axes(
    svg: &mut String,
    (lo, hi): (f64, f64),
    (x_lo, x_hi): (f64, f64),
    x: &dyn Fn(f64) -> f64,
    y: &dyn Fn(f64) -> f64,
    y_label: &str,
) {
    let (right, bottom) = (WIDTH - RIGHT, HEIGHT - BOTTOM);
    for v in ticks(lo, hi, 4) {
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" x2="{right}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e5e5e5"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT - 6.0,
            y(v) + 4.0,
            number(v),
            yy = y(v)
        );
    }
    for s in ticks(x_lo, x_hi, 6).into_iter().filter(|s| s.fract() == 0.0) {
        let _ = write!(
            svg,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{bottom}" y2="{}" stroke="#333"/><text x="{xx:.1}" y="{}" text-anchor="middle">{}</text>"##,
            bottom + 4.0,
            bottom + 16.0,
            number(s),
            xx = x(s)
        );
    }
    let _ = write!(
        svg,
        r##"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{bottom}" stroke="#333"/><line x1="{LEFT}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="#333"/>"##
    );
    let _ = write!(svg, r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#, (LEFT + right) / 2.0, HEIGHT - 6.0);
    let mid = (TOP + bottom) / 2.0;
    let _ = write!(
        svg,
        r#"<text x="14" y="{mid}" transform="rotate(-90 14 {mid})" text-anchor="middle">{}</text>"#,
        escape(y_label)
    );
}

fn draw_series(svg: &mut String, buckets: &[Bucket], color: &str, x: &dyn Fn(f64) -> f64, y: &dyn Fn(f64) -> f64) {
    if buckets.iter().any(|b| b.max > b.min) {
        let upper = buckets.iter().map(|b| format!("{:.1},{:.1}", x(b.step), y(b.max)));
        let lower = buckets.iter().rev().map(|b| format!("{:.1},{:.1}", x(b.step), y(b.min)));
        let points: Vec<String> = upper.chain(lower).collect();
        let _ = write!(
            svg,
            r#"<polygon class="band" fill="{color}" fill-opacity="0.18" stroke="none" points="{}"/>"#,
            points.join(" ")
        );
    }
    let line: Vec<String> = buckets.iter().map(|b| format!("{:.1},{:.1}", x(b.step), y(b.mean))).collect();
    let _ = write!(
        svg,
        r#"<polyline class="mean" fill="none" stroke="{color}" stroke-width="1.6" points="{}"/>"#,
        line.join(" ")
    );
    if buckets.len() <= MARKERS_UP_TO {
        for b in buckets {
            let _ = write!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#, x(b.step), y(b.mean));
        }
    }
}

fn legend_entry(svg: &mut String, index: usize, name: &str, color: &str) {
    // One row of up to five entries under the title (a second row after that).
    let (column, row) = (index % 5, index / 5);
    let lx = LEFT + column as f64 * 125.0;
    let ly = 34.0 + row as f64 * 12.0;
    let _ = write!(
        svg,
        r#"<rect x="{lx}" y="{}" width="10" height="3" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
        ly - 4.0,
        lx + 14.0,
        ly,
        escape(name)
    );
}

/// `text` with `&`, `<`, `>` and `"` escaped for SVG and HTML.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart_of(points: &[(i64, f64)]) -> String {
        let series = [Series::new("reward", points.iter().map(|&(s, v)| (s, Some(v))))];
        line_chart(&Chart { y_from_zero: true, ..Chart::new("a < b", "reward", &series) })
    }

    #[test]
    fn a_short_chart_has_one_marker_per_point_and_escapes_the_title() {
        let svg = chart_of(&[(0, 0.2), (1, 0.5), (2, 0.9)]);
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains("a &lt; b"));
        assert!(!svg.contains("class=\"band\""), "one step per bucket: no band");
    }

    #[test]
    fn higher_values_are_drawn_higher() {
        let svg = chart_of(&[(0, 0.0), (1, 1.0)]);
        let ys: Vec<f64> = svg
            .split("<circle")
            .skip(1)
            .map(|c| c.split("cy=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap())
            .collect();
        assert!(ys[1] < ys[0], "{ys:?}");
    }

    #[test]
    fn a_long_run_draws_at_most_max_points_with_a_band() {
        let points: Vec<(i64, f64)> = (1..=100_000).map(|s| (s, (s as f64).sin())).collect();
        let svg = chart_of(&points);
        let line = svg.split("class=\"mean\"").nth(1).unwrap().split("points=\"").nth(1).unwrap();
        let count = line.split('"').next().unwrap().split(' ').count();
        assert_eq!(count, DEFAULT_MAX_POINTS);
        assert!(svg.contains("class=\"band\""));
        assert_eq!(svg.matches("<circle").count(), 0);
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 1.0, 4), vec![0.0, 0.25, 0.5, 0.75, 1.0]);
        let t = ticks(1.0, 100_000.0, 6);
        assert!(t.iter().all(|v| v % 10_000.0 == 0.0), "{t:?}");
        assert!(t.len() >= 4 && t.len() <= 11, "{t:?}");
    }

    #[test]
    fn an_empty_chart_says_so() {
        assert!(chart_of(&[]).contains("no data"));
    }
}
