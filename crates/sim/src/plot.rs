//! Minimal hand-written SVG charts (line charts and stacked areas).
//!
//! The simulator writes its plots without a plotting dependency: a latency CDF per tenant
//! group, throughput over time, and service by phase are simple enough to draw directly, and
//! plain SVG opens in any browser and diffs in review.

use std::fmt::Write;

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 50.0;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// One named series of `(x, y)` points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Points, x ascending.
    pub points: Vec<(f64, f64)>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        return vec![lo];
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(t);
        t += step;
    }
    out
}

fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.3}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.3}M", v / 1e6)
    } else if a >= 1e3 {
        format!("{:.3}k", v / 1e3)
    } else if a >= 1.0 || a == 0.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.3e}")
    }
    .replace(".000", "")
}

fn header(out: &mut String, title: &str, x_label: &str, y_label: &str) {
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = write!(
        out,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        esc(title)
    );
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 10.0,
        esc(x_label)
    );
    let _ = write!(
        out,
        r#"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>"#,
        (TOP + H - BOTTOM) / 2.0,
        (TOP + H - BOTTOM) / 2.0,
        esc(y_label)
    );
}

struct Axes {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    log_x: bool,
}

impl Axes {
    fn px(&self, x: f64) -> f64 {
        let (a, b, v) = if self.log_x {
            (self.x0.log10(), self.x1.log10(), x.max(self.x0).log10())
        } else {
            (self.x0, self.x1, x)
        };
        LEFT + (v - a) / (b - a).max(1e-12) * (W - LEFT - RIGHT)
    }
    fn py(&self, y: f64) -> f64 {
        H - BOTTOM - (y - self.y0) / (self.y1 - self.y0).max(1e-12) * (H - TOP - BOTTOM)
    }
}

fn frame(out: &mut String, ax: &Axes) {
    let _ = write!(
        out,
        r##"<rect x="{LEFT}" y="{TOP}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        W - LEFT - RIGHT,
        H - TOP - BOTTOM
    );
    let xt: Vec<f64> = if ax.log_x {
        let mut v = Vec::new();
        let mut p = 10f64.powf(ax.x0.log10().floor());
        while p <= ax.x1 * 1.0001 {
            if p >= ax.x0 * 0.9999 {
                v.push(p);
            }
            p *= 10.0;
        }
        v
    } else {
        nice_ticks(ax.x0, ax.x1, 6)
    };
    for t in xt {
        let x = ax.px(t);
        let _ = write!(
            out,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
            H - BOTTOM,
            H - BOTTOM + 16.0,
            fmt_num(t)
        );
    }
    for t in nice_ticks(ax.y0, ax.y1, 5) {
        let y = ax.py(t);
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            fmt_num(t)
        );
    }
}

fn legend(out: &mut String, names: &[&str]) {
    for (i, n) in names.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 18.0;
        let x = W - RIGHT + 12.0;
        let _ = write!(
            out,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            y - 10.0,
            COLOURS[i % COLOURS.len()],
            x + 18.0,
            y,
            esc(n)
        );
    }
}

/// A line chart. `log_x` draws the x axis in decades (for latency CDFs).
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
) -> String {
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY);
    for (x, y) in pts {
        if log_x && *x <= 0.0 {
            continue;
        }
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y1 = y1.max(*y);
    }
    if !x0.is_finite() {
        (x0, x1, y1) = (if log_x { 1.0 } else { 0.0 }, 1.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 * 1.1 + 1.0;
    }
    if y1.is_nan() || y1 <= 0.0 {
        y1 = 1.0;
    }
    let ax = Axes {
        x0,
        x1,
        y0: 0.0,
        y1: y1 * 1.05,
        log_x,
    };
    let mut out = String::new();
    header(&mut out, title, x_label, y_label);
    frame(&mut out, &ax);
    for (i, s) in series.iter().enumerate() {
        let mut d = String::new();
        for (x, y) in &s.points {
            if log_x && *x <= 0.0 {
                continue;
            }
            let cmd = if d.is_empty() { 'M' } else { 'L' };
            let _ = write!(d, "{cmd}{:.1},{:.1} ", ax.px(*x), ax.py(*y));
        }
        let _ = write!(
            out,
            r#"<path d="{d}" fill="none" stroke="{}" stroke-width="1.6"/>"#,
            COLOURS[i % COLOURS.len()]
        );
    }
    let names: Vec<&str> = series.iter().map(|s| s.name.as_str()).collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

/// A stacked area chart: all series share the same x values (the first series' x).
pub fn stacked_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let n = series.first().map_or(0, |s| s.points.len());
    let xs: Vec<f64> = series
        .first()
        .map(|s| s.points.iter().map(|p| p.0).collect())
        .unwrap_or_default();
    let mut tops = vec![0.0f64; n];
    let mut layers: Vec<(Vec<f64>, Vec<f64>)> = Vec::new();
    for s in series {
        let bottom = tops.clone();
        for (i, t) in tops.iter_mut().enumerate() {
            *t += s.points.get(i).map_or(0.0, |p| p.1);
        }
        layers.push((bottom, tops.clone()));
    }
    let ymax = tops.iter().cloned().fold(0.0, f64::max);
    let ax = Axes {
        x0: xs.first().copied().unwrap_or(0.0),
        x1: xs.last().copied().filter(|v| *v > 0.0).unwrap_or(1.0),
        y0: 0.0,
        y1: if ymax > 0.0 { ymax * 1.05 } else { 1.0 },
        log_x: false,
    };
    let mut out = String::new();
    header(&mut out, title, x_label, y_label);
    frame(&mut out, &ax);
    for (li, (bottom, top)) in layers.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let mut d = String::new();
        for i in 0..n {
            let cmd = if i == 0 { 'M' } else { 'L' };
            let _ = write!(d, "{cmd}{:.1},{:.1} ", ax.px(xs[i]), ax.py(top[i]));
        }
        for i in (0..n).rev() {
            let _ = write!(d, "L{:.1},{:.1} ", ax.px(xs[i]), ax.py(bottom[i]));
        }
        let _ = write!(
            out,
            r#"<path d="{d}Z" fill="{}" fill-opacity="0.75" stroke="none"/>"#,
            COLOURS[li % COLOURS.len()]
        );
    }
    let names: Vec<&str> = series.iter().map(|s| s.name.as_str()).collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed_svg() {
        let s = vec![
            Series {
                name: "victim <1>".into(),
                points: vec![(10.0, 0.1), (100.0, 0.9), (1000.0, 1.0)],
            },
            Series {
                name: "burster".into(),
                points: vec![(50.0, 0.5), (5000.0, 1.0)],
            },
        ];
        let svg = line_chart("CDF", "latency (us)", "fraction", &s, true);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("victim &lt;1&gt;"));
        assert_eq!(svg.matches("<path").count(), 2);
        let st = stacked_chart("phases", "t", "iops", &s);
        assert_eq!(st.matches("<path").count(), 2);
        let empty = line_chart("e", "x", "y", &[], false);
        assert!(empty.ends_with("</svg>\n"));
    }

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(
            nice_ticks(0.0, 10.0, 5),
            vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        );
        assert_eq!(fmt_num(25_000.0), "25k");
    }
}
