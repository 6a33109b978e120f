//! Inline SVG charts, written by hand so the HTML report needs no script and no external asset.
//! Hovering a point or bar shows its value through the SVG `<title>` tooltip every browser has.

use std::fmt::Write as _;

const W: f64 = 960.0;
const ML: f64 = 78.0;
const MR: f64 = 24.0;
const MT: f64 = 56.0;
const MB: f64 = 48.0;

/// Escapes text for HTML and SVG content and attributes.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// One axis: its label, how tick values print, and whether it is logarithmic.
pub struct Axis {
    pub label: String,
    pub fmt: fn(f64) -> String,
    pub log: bool,
    /// Start a linear axis at zero even when the data does not.
    pub zero: bool,
}

/// A line of a line chart; `None` y values break the line.
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub points: Vec<(f64, Option<f64>)>,
    pub dashed: bool,
}

/// A shaded x range (a run segment) behind the lines.
pub struct Band {
    pub x0: f64,
    pub x1: f64,
    pub label: String,
    pub fill: &'static str,
}

#[derive(Clone, Copy)]
struct Scale {
    lo: f64,
    hi: f64,
    log: bool,
    p0: f64,
    p1: f64,
}

impl Scale {
    fn new(values: impl Iterator<Item = f64>, axis: &Axis, p0: f64, p1: f64) -> Scale {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite() && (!axis.log || *v > 0.0)) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = if axis.log { (1.0, 10.0) } else { (0.0, 1.0) };
        }
        if axis.log {
            lo = 10f64.powf(lo.log10().floor());
            hi = 10f64.powf(hi.log10().ceil());
            if hi <= lo {
                hi = lo * 10.0;
            }
        } else {
            if axis.zero {
                lo = lo.min(0.0);
            }
            if hi <= lo {
                hi = lo + 1.0;
            }
            let step = nice_step(hi - lo, 5);
            lo = (lo / step).floor() * step;
            hi = (hi / step).ceil() * step;
        }
        Scale {
            lo,
            hi,
            log: axis.log,
            p0,
            p1,
        }
    }

    fn map(&self, v: f64) -> Option<f64> {
        if !v.is_finite() || (self.log && v <= 0.0) {
            return None;
        }
        let t = if self.log {
            (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        Some(self.p0 + t.clamp(-0.05, 1.05) * (self.p1 - self.p0))
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let (a, b) = (
                self.lo.log10().round() as i32,
                self.hi.log10().round() as i32,
            );
            let mut t = Vec::new();
            for e in a..=b {
                let base = 10f64.powi(e);
                t.push(base);
                if b - a <= 2 && e < b {
                    t.push(2.0 * base);
                    t.push(5.0 * base);
                }
            }
            t
        } else {
            let step = nice_step(self.hi - self.lo, 5);
            let n = ((self.hi - self.lo) / step).round() as usize;
            (0..=n.min(20)).map(|i| self.lo + step * i as f64).collect()
        }
    }
}

fn nice_step(range: f64, target: usize) -> f64 {
    let raw = (range / target as f64).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm < 1.5 {
        1.0
    } else if norm < 3.0 {
        2.0
    } else if norm < 7.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn open(out: &mut String, id: &str, title: &str, h: f64) {
    let _ = write!(
        out,
        r#"<svg id="{id}" class="chart" viewBox="0 0 {W} {h}" role="img" aria-label="{t}" xmlns="http://www.w3.org/2000/svg"><text class="title" x="{ML}" y="22">{t}</text>"#,
        t = esc(title)
    );
}

/// The legend: one row under the title, left-aligned with the plot.
fn legend(out: &mut String, items: &[(&str, &str, bool)]) {
    let mut x = ML;
    for (name, color, dashed) in items {
        let dash = if *dashed {
            r#" stroke-dasharray="5 3""#
        } else {
            ""
        };
        let _ = write!(
            out,
            r#"<line x1="{x}" y1="38" x2="{x2}" y2="38" stroke="{color}" stroke-width="3"{dash}/><text class="legend" x="{tx}" y="42">{n}</text>"#,
            x2 = x + 16.0,
            tx = x + 20.0,
            n = esc(name)
        );
        x += 36.0 + 6.5 * name.chars().count() as f64;
    }
}

fn axes(out: &mut String, xs: &Scale, ys: &Scale, x: &Axis, y: &Axis, h: f64) {
    let bottom = h - MB;
    for t in ys.ticks() {
        if let Some(py) = ys.map(t) {
            let _ = write!(
                out,
                r#"<line class="grid" x1="{ML}" y1="{py:.1}" x2="{x2}" y2="{py:.1}"/><text class="tick" x="{tx}" y="{ty:.1}" text-anchor="end">{v}</text>"#,
                x2 = W - MR,
                tx = ML - 6.0,
                ty = py + 4.0,
                v = esc(&(y.fmt)(t))
            );
        }
    }
    for t in xs.ticks() {
        if let Some(px) = xs.map(t) {
            let _ = write!(
                out,
                r#"<line class="axis" x1="{px:.1}" y1="{bottom}" x2="{px:.1}" y2="{b2}"/><text class="tick" x="{px:.1}" y="{ty}" text-anchor="middle">{v}</text>"#,
                b2 = bottom + 5.0,
                ty = bottom + 18.0,
                v = esc(&(x.fmt)(t))
            );
        }
    }
    let _ = write!(
        out,
        r#"<line class="axis" x1="{ML}" y1="{MT}" x2="{ML}" y2="{bottom}"/><line class="axis" x1="{ML}" y1="{bottom}" x2="{x2}" y2="{bottom}"/><text class="label" x="{cx}" y="{ly}" text-anchor="middle">{xl}</text><text class="label" transform="translate(16 {cy}) rotate(-90)" text-anchor="middle">{yl}</text>"#,
        x2 = W - MR,
        cx = (ML + W - MR) / 2.0,
        ly = h - 8.0,
        cy = (MT + bottom) / 2.0,
        xl = esc(&x.label),
        yl = esc(&y.label)
    );
}

/// A line chart with optional shaded bands.
pub fn line_chart(
    id: &str,
    title: &str,
    x: &Axis,
    y: &Axis,
    series: &[Series],
    bands: &[Band],
) -> String {
    let h = 330.0;
    let mut out = String::new();
    open(&mut out, id, title, h);
    let xs = Scale::new(
        series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .chain(bands.iter().flat_map(|b| [b.x0, b.x1])),
        x,
        ML,
        W - MR,
    );
    let ys = Scale::new(
        series
            .iter()
            .flat_map(|s| s.points.iter().filter_map(|p| p.1)),
        y,
        h - MB,
        MT,
    );
    for b in bands {
        if let (Some(a), Some(c)) = (xs.map(b.x0), xs.map(b.x1)) {
            let _ = write!(
                out,
                r#"<rect class="band" x="{a:.1}" y="{MT}" width="{w:.1}" height="{bh}" fill="{f}"><title>{l}</title></rect>"#,
                w = (c - a).max(0.5),
                bh = h - MB - MT,
                f = b.fill,
                l = esc(&b.label)
            );
        }
    }
    axes(&mut out, &xs, &ys, x, y, h);
    for s in series {
        let dash = if s.dashed {
            r#" stroke-dasharray="5 3""#
        } else {
            ""
        };
        let mut run: Vec<(f64, f64, f64, f64)> = Vec::new();
        let flush = |out: &mut String, run: &mut Vec<(f64, f64, f64, f64)>| {
            if run.len() > 1 {
                let pts: Vec<String> = run
                    .iter()
                    .map(|p| format!("{:.1},{:.1}", p.0, p.1))
                    .collect();
                let _ = write!(
                    out,
                    r#"<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="{p}"/>"#,
                    c = s.color,
                    p = pts.join(" ")
                );
            }
            for (px, py, vx, vy) in run.drain(..) {
                let _ = write!(
                    out,
                    r#"<circle cx="{px:.1}" cy="{py:.1}" r="2.5" fill="{c}"><title>{n}: {vy} at {vx}</title></circle>"#,
                    c = s.color,
                    n = esc(&s.name),
                    vy = esc(&(y.fmt)(vy)),
                    vx = esc(&(x.fmt)(vx))
                );
            }
        };
        for &(vx, vy) in &s.points {
            match (xs.map(vx), vy.and_then(|v| ys.map(v).map(|p| (p, v)))) {
                (Some(px), Some((py, v))) => run.push((px, py, vx, v)),
                _ => flush(&mut out, &mut run),
            }
        }
        flush(&mut out, &mut run);
    }
    let items: Vec<(&str, &str, bool)> = series
        .iter()
        .map(|s| (s.name.as_str(), s.color, s.dashed))
        .collect();
    legend(&mut out, &items);
    out.push_str("</svg>");
    out
}

/// Horizontal grouped bars: one row per category, one bar per group.
pub fn hbar_chart(
    id: &str,
    title: &str,
    categories: &[String],
    groups: &[(&str, &'static str, Vec<Option<f64>>)],
    fmt: fn(f64) -> String,
) -> String {
    let bar = 11.0;
    let row_h = bar * groups.len().max(1) as f64 + 10.0;
    let h = MT + row_h * categories.len().max(1) as f64 + MB;
    let mut out = String::new();
    open(&mut out, id, title, h);
    let axis = Axis {
        label: String::new(),
        fmt,
        log: false,
        zero: true,
    };
    let left = ML + 40.0;
    let xs = Scale::new(
        groups.iter().flat_map(|g| g.2.iter().flatten().copied()),
        &axis,
        left,
        W - MR - 70.0,
    );
    let bottom = h - MB;
    for t in xs.ticks() {
        if let Some(px) = xs.map(t) {
            let _ = write!(
                out,
                r#"<line class="grid" x1="{px:.1}" y1="{MT}" x2="{px:.1}" y2="{bottom}"/><text class="tick" x="{px:.1}" y="{ty}" text-anchor="middle">{v}</text>"#,
                ty = bottom + 18.0,
                v = esc(&fmt(t))
            );
        }
    }
    for (ci, cat) in categories.iter().enumerate() {
        let y0 = MT + row_h * ci as f64 + 5.0;
        let _ = write!(
            out,
            r#"<text class="tick" x="{tx}" y="{ty:.1}" text-anchor="end">{c}</text>"#,
            tx = left - 8.0,
            ty = y0 + row_h / 2.0,
            c = esc(cat)
        );
        for (gi, (name, color, values)) in groups.iter().enumerate() {
            let Some(v) = values.get(ci).copied().flatten() else {
                continue;
            };
            let (Some(x0), Some(x1)) = (xs.map(0.0), xs.map(v)) else {
                continue;
            };
            let y = y0 + bar * gi as f64;
            let _ = write!(
                out,
                r#"<rect x="{x0:.1}" y="{y:.1}" width="{w:.1}" height="{bh}" fill="{color}"><title>{c} {n}: {v}</title></rect><text class="value" x="{tx:.1}" y="{ty:.1}">{v}</text>"#,
                w = (x1 - x0).max(1.0),
                bh = bar - 2.0,
                tx = x1 + 4.0,
                ty = y + bar - 3.0,
                c = esc(cat),
                n = esc(name),
                v = esc(&fmt(v))
            );
        }
    }
    let _ = write!(
        out,
        r#"<line class="axis" x1="{left}" y1="{MT}" x2="{left}" y2="{bottom}"/>"#
    );
    let items: Vec<(&str, &str, bool)> = groups.iter().map(|g| (g.0, g.1, false)).collect();
    legend(&mut out, &items);
    out.push_str("</svg>");
    out
}

/// Vertical bars over labelled bins (e.g. log-spaced latency ranges); values are shares in 0..1.
pub fn bar_chart(
    id: &str,
    title: &str,
    bin_labels: &[String],
    groups: &[(&str, &'static str, Vec<f64>)],
    x_label: &str,
) -> String {
    let h = 330.0;
    let mut out = String::new();
    open(&mut out, id, title, h);
    let y = Axis {
        label: "share of answers".into(),
        fmt: |v| format!("{:.0}%", v * 100.0),
        log: false,
        zero: true,
    };
    let ys = Scale::new(
        groups.iter().flat_map(|g| g.2.iter().copied()),
        &y,
        h - MB,
        MT,
    );
    let bottom = h - MB;
    for t in ys.ticks() {
        if let Some(py) = ys.map(t) {
            let _ = write!(
                out,
                r#"<line class="grid" x1="{ML}" y1="{py:.1}" x2="{x2}" y2="{py:.1}"/><text class="tick" x="{tx}" y="{ty:.1}" text-anchor="end">{v}</text>"#,
                x2 = W - MR,
                tx = ML - 6.0,
                ty = py + 4.0,
                v = esc(&(y.fmt)(t))
            );
        }
    }
    let n = bin_labels.len().max(1);
    let slot = (W - MR - ML) / n as f64;
    let bw = (slot - 2.0).max(1.0) / groups.len().max(1) as f64;
    // Tick labels need about 64 px each; label every k-th bin so they never overlap.
    let label_every = (64.0 / slot).ceil().max(1.0) as usize;
    for (i, label) in bin_labels.iter().enumerate() {
        let x0 = ML + slot * i as f64 + 1.0;
        for (gi, (name, color, values)) in groups.iter().enumerate() {
            let v = values.get(i).copied().unwrap_or(0.0);
            if v <= 0.0 {
                continue;
            }
            let (Some(py), Some(p0)) = (ys.map(v), ys.map(0.0)) else {
                continue;
            };
            let _ = write!(
                out,
                r#"<rect x="{x:.1}" y="{py:.1}" width="{bw:.1}" height="{bh:.1}" fill="{color}"><title>{nm} {l}: {p:.2}%</title></rect>"#,
                x = x0 + bw * gi as f64,
                bh = (p0 - py).max(0.5),
                nm = esc(name),
                l = esc(label),
                p = v * 100.0
            );
        }
        if i % label_every == 0 {
            let _ = write!(
                out,
                r#"<text class="tick" x="{x:.1}" y="{y}" text-anchor="middle">{l}</text>"#,
                x = x0 + slot / 2.0,
                y = bottom + 18.0,
                l = esc(label.split('–').next().unwrap_or(label))
            );
        }
    }
    let _ = write!(
        out,
        r#"<line class="axis" x1="{ML}" y1="{MT}" x2="{ML}" y2="{bottom}"/><line class="axis" x1="{ML}" y1="{bottom}" x2="{x2}" y2="{bottom}"/><text class="label" x="{cx}" y="{ly}" text-anchor="middle">{xl}</text>"#,
        x2 = W - MR,
        cx = (ML + W - MR) / 2.0,
        ly = h - 8.0,
        xl = esc(x_label)
    );
    let items: Vec<(&str, &str, bool)> = groups.iter().map(|g| (g.0, g.1, false)).collect();
    legend(&mut out, &items);
    out.push_str("</svg>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_ticks() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert_eq!(nice_step(10.0, 5), 2.0);
        assert_eq!(nice_step(1000.0, 5), 200.0);
        let axis = Axis {
            label: "x".into(),
            fmt: |v| format!("{v}"),
            log: true,
            zero: false,
        };
        let s = Scale::new([150.0, 30_000.0].into_iter(), &axis, 0.0, 100.0);
        assert_eq!((s.lo, s.hi), (100.0, 100_000.0));
        assert_eq!(s.ticks(), vec![100.0, 1_000.0, 10_000.0, 100_000.0]);
        assert_eq!(s.map(-1.0), None);
    }

    #[test]
    fn line_chart_breaks_on_gaps() {
        let axis = |log| Axis {
            label: "t".into(),
            fmt: |v| format!("{v:.0}"),
            log,
            zero: true,
        };
        let svg = line_chart(
            "c",
            "T <1>",
            &axis(false),
            &axis(false),
            &[Series {
                name: "s".into(),
                color: "#000",
                points: vec![
                    (0.0, Some(1.0)),
                    (1.0, Some(2.0)),
                    (2.0, None),
                    (3.0, Some(1.0)),
                    (4.0, Some(3.0)),
                ],
                dashed: false,
            }],
            &[],
        );
        assert!(svg.starts_with("<svg id=\"c\""));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("T &lt;1&gt;"));
    }
}
