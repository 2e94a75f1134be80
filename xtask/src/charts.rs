//! PNG charts of `bench e2e` results (plotters, bitmap backend).
//!
//! Text is drawn with ab_glyph from a system TrueType font (DejaVu Sans, package
//! fonts-dejavu-core), registered once as `sans-serif`.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;

/// One measured point: a system (with its NIC count) running a job.
#[derive(Debug, Clone)]
pub struct Point {
    /// `nbdkit-tcp`, `tyche-xdp`, ...
    pub system: String,
    /// NICs used.
    pub nics: u32,
    /// `read` or `write`.
    pub direction: &'static str,
    /// Block size in bytes.
    pub block: u64,
    /// GB/s.
    pub gbps: f64,
}

const FONTS: [&str; 2] =
    ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"];

fn register_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let path = FONTS.iter().find(|p| Path::new(p).exists()).ok_or("no DejaVu font (package fonts-dejavu-core)")?;
        let bytes: &'static [u8] = Box::leak(std::fs::read(path).map_err(|e| e.to_string())?.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a usable TrueType font"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

fn label(block: u64) -> String {
    if block >= 1 << 20 {
        format!("{} MiB", block >> 20)
    } else {
        format!("{} KiB", block >> 10)
    }
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Throughput by block size: one panel per direction, one line per system and NIC count, block
/// sizes on a log axis.
pub fn by_block_size(points: &[Point], out: &Path, title: &str) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(out, (1200, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let panels = root.split_evenly((1, 2));
    let mut series: Vec<(String, u32)> = points.iter().map(|p| (p.system.clone(), p.nics)).collect();
    series.dedup();
    series.sort();
    series.dedup();
    let blocks: Vec<u64> = {
        let mut b: Vec<u64> = points.iter().map(|p| p.block).collect();
        b.sort_unstable();
        b.dedup();
        b
    };
    let top = points.iter().map(|p| p.gbps).fold(0.0, f64::max) * 1.15 + 0.01;
    // Block sizes as evenly spaced categories (4 KiB, 128 KiB, 1 MiB), in order.
    let at = |block: u64| blocks.iter().position(|b| *b == block).unwrap_or(0) as f64;
    for (panel, direction) in panels.iter().zip(["read", "write"]) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{direction}s"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(-0.3f64..blocks.len() as f64 - 0.7, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("block size")
            .y_desc("GB/s")
            .x_labels(blocks.len())
            .x_label_formatter(&|x| {
                let i = x.round();
                if (i - x).abs() < 0.01 && i >= 0.0 {
                    blocks.get(i as usize).map_or(String::new(), |b| label(*b))
                } else {
                    String::new()
                }
            })
            .label_style(("sans-serif", 13))
            .draw()?;
        for (k, (system, nics)) in series.iter().enumerate() {
            let color = PALETTE[k % PALETTE.len()];
            let mut line: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| &p.system == system && p.nics == *nics && p.direction == direction)
                .map(|p| (at(p.block), p.gbps))
                .collect();
            if line.is_empty() {
                continue;
            }
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                .label(format!("{system} ({nics} NIC{})", if *nics == 1 { "" } else { "s" }))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            chart.draw_series(line.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
    }
    root.present().with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// Throughput by NIC count for one system: one line per job (direction and block size).
pub fn by_nic_count(points: &[Point], system: &str, out: &Path, title: &str) -> Result<()> {
    register_font()?;
    let mine: Vec<&Point> = points.iter().filter(|p| p.system == system).collect();
    let max_nics = mine.iter().map(|p| p.nics).max().context("no points")?;
    let top = mine.iter().map(|p| p.gbps).fold(0.0, f64::max) * 1.2 + 0.01;
    let root = BitMapBackend::new(out, (800, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.8f64..max_nics as f64 + 0.2, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("NICs")
        .y_desc("GB/s")
        .x_labels(max_nics as usize + 1)
        .x_label_formatter(&|x| if (x.round() - x).abs() < 0.01 { format!("{}", x.round()) } else { String::new() })
        .label_style(("sans-serif", 13))
        .draw()?;
    let mut jobs: Vec<(&'static str, u64)> = mine.iter().map(|p| (p.direction, p.block)).collect();
    jobs.sort();
    jobs.dedup();
    for (k, (direction, block)) in jobs.iter().enumerate() {
        let color = PALETTE[k % PALETTE.len()];
        let mut line: Vec<(f64, f64)> = mine
            .iter()
            .filter(|p| p.direction == *direction && p.block == *block)
            .map(|p| (p.nics as f64, p.gbps))
            .collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(format!("{direction} {}", label(*block)))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(line.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present().with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Point> {
        let mut v = Vec::new();
        for (system, nics, scale) in [("nbdkit-tcp", 1, 1.0), ("tyche-xdp", 1, 0.5), ("tyche-xdp", 2, 0.6)] {
            for (block, base) in [(4096u64, 0.3), (128 << 10, 2.0), (1 << 20, 1.8)] {
                for direction in ["read", "write"] {
                    v.push(Point { system: system.into(), nics, direction, block, gbps: base * scale });
                }
            }
        }
        v
    }

    #[test]
    fn charts_render_to_png() {
        if FONTS.iter().all(|p| !Path::new(p).exists()) {
            tyche_testkit::cannot_run("charts_render_to_png", "no DejaVu font (package fonts-dejavu-core)");
            return;
        }
        let dir = std::env::temp_dir().join(format!("tyche-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = dir.join("a.png");
        let b = dir.join("b.png");
        by_block_size(&sample(), &a, "test").unwrap();
        by_nic_count(&sample(), "tyche-xdp", &b, "test").unwrap();
        for f in [&a, &b] {
            let bytes = std::fs::read(f).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{} is a PNG", f.display());
            assert!(bytes.len() > 5000, "{} has content", f.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
