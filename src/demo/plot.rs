//! A dependency-free SVG line chart of the demo's mean reward per step.

use std::fmt::Write;

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 360.0;
const MARGIN: f64 = 48.0;

/// Renders `(step, mean reward)` points as an SVG document with axes and a title.
pub fn reward_svg(title: &str, points: &[(i64, f64)]) -> String {
    let max_step = points.iter().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let (lo, hi) = (0.0, 1.0_f64.max(points.iter().map(|p| p.1).fold(0.0, f64::max)));
    let x = |s: f64| MARGIN + s / max_step * (WIDTH - 2.0 * MARGIN);
    let y = |r: f64| HEIGHT - MARGIN - (r - lo) / (hi - lo) * (HEIGHT - 2.0 * MARGIN);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ =
        write!(svg, r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#, WIDTH / 2.0, escape(title));
    // Axes and grid lines every 0.25 of reward.
    for i in 0..=4 {
        let r = lo + (hi - lo) * i as f64 / 4.0;
        let _ = write!(
            svg,
            r##"<line x1="{MARGIN}" x2="{}" y1="{y0:.1}" y2="{y0:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{r:.2}</text>"##,
            WIDTH - MARGIN,
            MARGIN - 6.0,
            y(r) + 4.0,
            y0 = y(r)
        );
    }
    let _ = write!(
        svg,
        r#"<line x1="{MARGIN}" x2="{MARGIN}" y1="{MARGIN}" y2="{b}" stroke="black"/><line x1="{MARGIN}" x2="{r}" y1="{b}" y2="{b}" stroke="black"/>"#,
        b = HEIGHT - MARGIN,
        r = WIDTH - MARGIN
    );
    let _ = write!(svg, r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#, WIDTH / 2.0, HEIGHT - 12.0);
    let _ = write!(
        svg,
        r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">mean reward</text>"#,
        HEIGHT / 2.0,
        HEIGHT / 2.0
    );
    let path: Vec<String> = points.iter().map(|&(s, r)| format!("{:.1},{:.1}", x(s as f64), y(r))).collect();
    let _ = write!(svg, r##"<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{}"/>"##, path.join(" "));
    for &(s, r) in points {
        let _ = write!(svg, r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="#1f77b4"/>"##, x(s as f64), y(r));
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_has_one_marker_per_point_and_escapes_the_title() {
        let svg = reward_svg("a < b", &[(0, 0.2), (1, 0.5), (2, 0.9)]);
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains("a &lt; b"));
    }

    #[test]
    fn higher_rewards_are_drawn_higher() {
        let svg = reward_svg("t", &[(0, 0.0), (1, 1.0)]);
        let ys: Vec<f64> = svg
            .split("<circle")
            .skip(1)
            .map(|c| c.split("cy=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap())
            .collect();
        assert!(ys[1] < ys[0], "{ys:?}");
    }
}
