//! Inline SVG charts for the HTML report: no script, no external resource, every text escaped,
//! well-formed XML (the report is parsed as XML by its tests).

use std::fmt::Write as _;

/// Writes into a `String` (which cannot fail).
macro_rules! w {
    ($out:expr, $($arg:tt)*) => {{
        let _ = write!($out, $($arg)*);
    }};
}
pub(crate) use w;

/// Escapes text and attribute values (`&`, `<`, `>`, `"`, `'`): names in a trace are untrusted.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Control characters other than tab and newline are not allowed in XML 1.0 at all.
            c if c.is_control() && c != '\t' && c != '\n' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// Cuts a label for an axis (whole characters), marking the cut.
pub(crate) fn short(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// Twelve distinguishable series colours; the 13th series ("other") is grey.
pub(crate) const PALETTE: [&str; 12] =
    ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79", "#637939", "#843c39"];
pub(crate) const OTHER_COLOR: &str = "#9e9e9e";

/// The two percentile series (p50, p99): blues, apart from the palette the versions use.
pub(crate) const P50_COLOR: &str = "#90caf9";
pub(crate) const P99_COLOR: &str = "#1565c0";

pub(crate) fn color(i: usize) -> &'static str {
    PALETTE.get(i).copied().unwrap_or(OTHER_COLOR)
}

/// A number for a tick or a table cell: short, with k/M/G above 10,000.
pub(crate) fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        "-".into()
    } else if a >= 1e9 {
        format!("{:.1}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 || (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else if a == 0.0 {
        "0".into()
    } else {
        format!("{v:.3}")
    }
}

/// The unit a time axis over `span_ms` is labelled in: (ms per unit, name).
pub(crate) fn time_unit(span_ms: f64) -> (f64, &'static str) {
    if span_ms <= 120_000.0 {
        (1000.0, "s")
    } else if span_ms <= 7_200_000.0 {
        (60_000.0, "min")
    } else if span_ms <= 172_800_000.0 {
        (3_600_000.0, "h")
    } else {
        (86_400_000.0, "d")
    }
}

/// A step of 1, 2 or 5 × 10ⁿ giving about five ticks over `range`.
fn nice_step(range: f64) -> f64 {
    let raw = range / 5.0;
    if !raw.is_finite() || raw <= 0.0 {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let k = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    k * mag
}

/// The axis range covering [lo, hi] on whole steps, and the step.
fn nice_range(lo: f64, hi: f64) -> (f64, f64, f64) {
    let (lo, hi) = if lo.is_finite() && hi.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let hi = if hi > lo { hi } else { lo + 1.0 };
    let step = nice_step(hi - lo);
    ((lo / step).floor() * step, (hi / step).ceil() * step, step)
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 260.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = 44.0;

/// The plot area of one chart and its y scale.
struct Plot {
    height: f64,
    y_lo: f64,
    y_hi: f64,
    y_step: f64,
}

impl Plot {
    fn new(height: f64, lo: f64, hi: f64) -> Plot {
        let (y_lo, y_hi, y_step) = nice_range(lo, hi);
        Plot { height, y_lo, y_hi, y_step }
    }
    fn x0(&self) -> f64 {
        LEFT
    }
    fn x1(&self) -> f64 {
        WIDTH - RIGHT
    }
    fn bottom(&self) -> f64 {
        self.height - BOTTOM
    }
    fn y(&self, v: f64) -> f64 {
        let span = self.y_hi - self.y_lo;
        let f = if span > 0.0 { (v - self.y_lo) / span } else { 0.0 };
        self.bottom() - f.clamp(0.0, 1.0) * (self.bottom() - TOP)
    }

    /// `<svg>`, its title, the y grid with tick labels and the axis label.
    fn open(&self, out: &mut String, title: &str, y_label: &str, y_fmt: fn(f64) -> String) {
        w!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {h}" width="{WIDTH}" height="{h}" role="img" aria-label="{t}"><title>{t}</title>"#,
            h = self.height,
            t = esc(title)
        );
        let ticks = ((self.y_hi - self.y_lo) / self.y_step).round().clamp(1.0, 20.0) as usize;
        for i in 0..=ticks {
            let v = self.y_lo + self.y_step * i as f64;
            let y = self.y(v);
            w!(out, r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/>"##, self.x0(), self.x1());
            w!(out, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, self.x0() - 4.0, y + 4.0, esc(&y_fmt(v)));
        }
        w!(
            out,
            r#"<text x="12" y="{:.1}" transform="rotate(-90 12 {:.1})" text-anchor="middle">{}</text>"#,
            (TOP + self.bottom()) / 2.0,
            (TOP + self.bottom()) / 2.0,
            esc(y_label)
        );
        w!(
            out,
            r##"<line x1="{x0:.1}" y1="{b:.1}" x2="{x1:.1}" y2="{b:.1}" stroke="#555"/><line x1="{x0:.1}" y1="{TOP:.1}" x2="{x0:.1}" y2="{b:.1}" stroke="#555"/>"##,
            x0 = self.x0(),
            x1 = self.x1(),
            b = self.bottom()
        );
    }

    /// Time ticks along the x axis over [t0, t1] ms, and the axis label.
    fn time_axis(&self, out: &mut String, t0: f64, t1: f64) {
        let (unit, name) = time_unit(t1 - t0);
        let (lo, hi) = (t0 / unit, t1 / unit);
        let step = nice_step(hi - lo);
        let first = (lo / step).ceil() * step;
        let mut v = first;
        let mut n = 0;
        while v <= hi + step * 1e-9 && n < 20 {
            let x = self.x_of(v * unit, t0, t1);
            w!(out, r##"<line x1="{x:.1}" y1="{b:.1}" x2="{x:.1}" y2="{:.1}" stroke="#555"/>"##, self.bottom() + 4.0, b = self.bottom());
            w!(out, r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, self.bottom() + 16.0, esc(&fmt_num(v)));
            v += step;
            n += 1;
        }
        self.x_label(out, &format!("time since the first request ({name})"));
    }

    fn x_label(&self, out: &mut String, label: &str) {
        w!(out, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, (self.x0() + self.x1()) / 2.0, self.height - 6.0, esc(label));
    }

    fn x_of(&self, t: f64, t0: f64, t1: f64) -> f64 {
        let f = if t1 > t0 { (t - t0) / (t1 - t0) } else { 0.0 };
        self.x0() + f.clamp(0.0, 1.0) * (self.x1() - self.x0())
    }
}

/// One named series of values (per category or per time bucket; `None`: no value there).
pub(crate) struct Series {
    pub name: String,
    pub color: &'static str,
    pub values: Vec<Option<f64>>,
}

/// One named series of (x, y) points, x in ms.
pub(crate) struct Line {
    pub name: String,
    pub color: &'static str,
    pub points: Vec<(f64, f64)>,
}

/// The legend of some series, as HTML.
pub(crate) fn legend<'a>(items: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = String::from(r#"<ul class="legend">"#);
    for (name, colour) in items {
        w!(out, r#"<li><span class="swatch" style="background:{colour}"></span>{}</li>"#, esc(name));
    }
    out.push_str("</ul>");
    out
}

pub(crate) fn series_legend(series: &[Series]) -> String {
    legend(series.iter().map(|s| (s.name.as_str(), s.color)))
}

/// Bars of each series side by side within each category.
pub(crate) fn grouped_bars(title: &str, categories: &[String], series: &[Series], y_label: &str) -> String {
    let max = series.iter().flat_map(|s| s.values.iter().flatten()).copied().filter(|v| v.is_finite()).fold(0.0f64, f64::max);
    let plot = Plot::new(HEIGHT, 0.0, max);
    let mut out = String::new();
    plot.open(&mut out, title, y_label, fmt_num);
    let n_cat = categories.len().max(1) as f64;
    let group = (plot.x1() - plot.x0()) / n_cat;
    let bar = group * 0.8 / series.len().max(1) as f64;
    for (ci, category) in categories.iter().enumerate() {
        let gx = plot.x0() + group * ci as f64 + group * 0.1;
        for (si, s) in series.iter().enumerate() {
            let Some(v) = s.values.get(ci).copied().flatten().filter(|v| v.is_finite()) else { continue };
            let (x, y) = (gx + bar * si as f64, plot.y(v));
            w!(
                out,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
                (bar - 1.0).max(0.5),
                plot.bottom() - y,
                s.color,
                esc(&format!("{category} · {}", s.name)),
                esc(&fmt_num(v))
            );
        }
        w!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            gx + group * 0.4,
            plot.bottom() + 16.0,
            esc(&short(category, (group / 7.0) as usize + 2))
        );
    }
    out.push_str("</svg>");
    out
}

/// Bars per time bucket over [t0, t1], the series stacked; with `share`, each bar is scaled to
/// 100 % of its bucket (empty buckets stay empty).
pub(crate) fn stacked_bars(title: &str, t0: f64, t1: f64, series: &[Series], y_label: &str, share: bool) -> String {
    let buckets = series.iter().map(|s| s.values.len()).max().unwrap_or(0);
    let totals: Vec<f64> = (0..buckets).map(|b| series.iter().filter_map(|s| s.values.get(b).copied().flatten()).filter(|v| v.is_finite()).sum()).collect();
    let max = if share { 1.0 } else { totals.iter().copied().fold(0.0f64, f64::max) };
    let plot = Plot::new(HEIGHT, 0.0, max);
    let mut out = String::new();
    plot.open(&mut out, title, y_label, if share { |v| format!("{:.0}%", v * 100.0) } else { fmt_num });
    let width = (plot.x1() - plot.x0()) / buckets.max(1) as f64;
    for (b, total) in totals.iter().enumerate() {
        if *total <= 0.0 || total.is_nan() {
            continue;
        }
        let x = plot.x0() + width * b as f64;
        let mut base = 0.0;
        for s in series {
            let Some(v) = s.values.get(b).copied().flatten().filter(|v| v.is_finite() && *v > 0.0) else { continue };
            let v = if share { v / total } else { v };
            let (top, bottom) = (plot.y(base + v), plot.y(base));
            w!(
                out,
                r#"<rect x="{x:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
                (width - 1.0).max(0.5),
                (bottom - top).max(0.0),
                s.color,
                esc(&s.name),
                esc(&if share { format!("{:.1}%", v * 100.0) } else { fmt_num(v) })
            );
            base += v;
        }
    }
    plot.time_axis(&mut out, t0, t1);
    out.push_str("</svg>");
    out
}

/// Lines over time [t0, t1]; with `step`, each value holds until the next point.
pub(crate) fn lines(title: &str, t0: f64, t1: f64, series: &[Line], y_label: &str, step: bool) -> String {
    let ys = || series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).filter(|v| v.is_finite());
    let (lo, hi) = (ys().fold(0.0f64, f64::min), ys().fold(0.0f64, f64::max));
    let plot = Plot::new(HEIGHT, lo, hi);
    let mut out = String::new();
    plot.open(&mut out, title, y_label, fmt_num);
    for s in series {
        let mut d = String::new();
        let mut last_y = None;
        for &(t, v) in s.points.iter().filter(|p| p.0.is_finite() && p.1.is_finite()) {
            let (x, y) = (plot.x_of(t, t0, t1), plot.y(v));
            match last_y {
                None => w!(d, "M{x:.1} {y:.1}"),
                Some(_) if step => w!(d, "H{x:.1}V{y:.1}"),
                Some(_) => w!(d, "L{x:.1} {y:.1}"),
            }
            last_y = Some(y);
        }
        if last_y.is_some() {
            w!(out, r#"<path d="{d}" fill="none" stroke="{}" stroke-width="1.6"><title>{}</title></path>"#, s.color, esc(&s.name));
        }
    }
    plot.time_axis(&mut out, t0, t1);
    out.push_str("</svg>");
    out
}

/// Points (x, y, colour) on linear axes from 0.
pub(crate) fn scatter(title: &str, points: &[(f64, f64, &str)], x_label: &str, y_label: &str) -> String {
    let finite = || points.iter().filter(|p| p.0.is_finite() && p.1.is_finite());
    let y_max = finite().map(|p| p.1).fold(0.0f64, f64::max);
    let (_, x_hi, x_step) = nice_range(0.0, finite().map(|p| p.0).fold(0.0f64, f64::max));
    let plot = Plot::new(HEIGHT, 0.0, y_max);
    let mut out = String::new();
    plot.open(&mut out, title, y_label, fmt_num);
    let ticks = (x_hi / x_step).round().clamp(1.0, 20.0) as usize;
    for i in 0..=ticks {
        let v = x_step * i as f64;
        let x = plot.x_of(v, 0.0, x_hi);
        w!(out, r##"<line x1="{x:.1}" y1="{b:.1}" x2="{x:.1}" y2="{:.1}" stroke="#555"/>"##, plot.bottom() + 4.0, b = plot.bottom());
        w!(out, r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, plot.bottom() + 16.0, esc(&fmt_num(v)));
    }
    for (x, y, colour) in finite() {
        w!(out, r#"<circle cx="{:.1}" cy="{:.1}" r="2.2" fill="{colour}" fill-opacity="0.55"/>"#, plot.x_of(*x, 0.0, x_hi), plot.y(*y));
    }
    plot.x_label(&mut out, x_label);
    out.push_str("</svg>");
    out
}

/// One row of a band chart: a name and coloured spans (from ms, to ms, colour, what it is).
pub(crate) struct Band {
    pub name: String,
    pub spans: Vec<(f64, f64, &'static str, &'static str)>,
}

/// Coloured spans per row over time [t0, t1].
pub(crate) fn bands(title: &str, t0: f64, t1: f64, rows: &[Band]) -> String {
    const ROW: f64 = 22.0;
    let height = TOP + ROW * rows.len() as f64 + BOTTOM;
    let plot = Plot { height, y_lo: 0.0, y_hi: 1.0, y_step: 1.0 };
    let mut out = String::new();
    w!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" aria-label="{t}"><title>{t}</title>"#,
        t = esc(title)
    );
    for (i, row) in rows.iter().enumerate() {
        let y = TOP + ROW * i as f64;
        w!(out, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, plot.x0() - 4.0, y + ROW / 2.0 + 4.0, esc(&short(&row.name, 9)));
        for &(from, to, colour, what) in &row.spans {
            let (x0, x1) = (plot.x_of(from, t0, t1), plot.x_of(to, t0, t1));
            w!(
                out,
                r#"<rect x="{x0:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{colour}"><title>{}</title></rect>"#,
                y + 2.0,
                (x1 - x0).max(0.5),
                ROW - 4.0,
                esc(&format!("{}: {what}", row.name))
            );
        }
    }
    plot.time_axis(&mut out, t0, t1);
    out.push_str("</svg>");
    out
}
