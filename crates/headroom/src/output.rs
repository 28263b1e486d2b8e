//! What the CLI prints: aligned tables and human units for people, JSON for scripts, and one
//! way to write to stdout that ends the process quietly when the reader has gone.
//!
//! Why one writer: Rust ignores SIGPIPE, so `println!` panics ("failed printing to stdout")
//! when `headroom volume list | head -1` closes the pipe early. Every command writes through
//! [`emit`] (or the [`outln!`] macro), which exits 0 without a word on `BrokenPipe`: the
//! reader asked for no more, nothing went wrong. Tables are rendered to a `String` first and
//! written in one call, so a table is never half-aligned.
//!
//! No table crate: the tables here are a few left- or right-aligned columns, which is thirty
//! lines. No colour unless stdout is a terminal and `NO_COLOR` is unset (then the header is
//! bold), so pipes and files get plain text.

use std::io::{IsTerminal, Write};

use serde::Serialize;

/// Writes `text` to stdout as it is. A closed pipe ends the process quietly with status 0;
/// any other write error ends it with status 1 and says so on stderr.
pub fn emit(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let result = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
    if let Err(err) = result {
        drop(stdout);
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {err}");
        std::process::exit(1);
    }
}

/// `println!` through [`emit`]: quiet on a closed pipe.
#[macro_export]
macro_rules! outln {
    () => { $crate::output::emit("\n") };
    ($($arg:tt)*) => {{
        let mut line = format!($($arg)*);
        line.push('\n');
        $crate::output::emit(&line);
    }};
}

/// Prints `value` as pretty JSON (one document, newline-terminated).
pub fn print_json<T: Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    emit(&text);
    Ok(())
}

/// True when stdout is a terminal and `NO_COLOR` is not set.
pub fn stdout_styled() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stdout().is_terminal()
}

/// Column alignment: text left, numbers right.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A table: a header row, aligned columns two spaces apart, no trailing blanks.
#[derive(Debug)]
pub struct Table {
    headers: Vec<&'static str>,
    aligns: Vec<Align>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns as (header, alignment).
    pub fn new(columns: &[(&'static str, Align)]) -> Table {
        Table {
            headers: columns.iter().map(|(h, _)| *h).collect(),
            aligns: columns.iter().map(|(_, a)| *a).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells are blank, extra cells are dropped.
    pub fn row(&mut self, cells: Vec<String>) {
        let mut cells = cells;
        cells.resize(self.headers.len(), String::new());
        self.rows.push(cells);
    }

    /// The table as text; `styled` makes the header bold (ANSI), for terminals only.
    pub fn render(&self, styled: bool) -> String {
        let columns = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let mut line = |cells: &mut dyn Iterator<Item = &str>, bold: bool| {
            let mut text = String::new();
            for (i, cell) in cells.enumerate() {
                if i > 0 {
                    text.push_str("  ");
                }
                let pad = widths[i].saturating_sub(cell.chars().count());
                let last = i + 1 == columns;
                match self.aligns[i] {
                    Align::Left => {
                        text.push_str(cell);
                        if !last {
                            text.extend(std::iter::repeat_n(' ', pad));
                        }
                    }
                    Align::Right => {
                        text.extend(std::iter::repeat_n(' ', pad));
                        text.push_str(cell);
                    }
                }
            }
            let text = text.trim_end();
            if bold {
                out.push_str("\x1b[1m");
                out.push_str(text);
                out.push_str("\x1b[0m");
            } else {
                out.push_str(text);
            }
            out.push('\n');
        };
        line(&mut self.headers.iter().copied(), styled);
        for row in &self.rows {
            line(&mut row.iter().map(String::as_str), false);
        }
        out
    }

    /// Renders for stdout (bold header on a terminal) and writes it.
    pub fn print(&self) {
        emit(&self.render(stdout_styled()));
    }
}

/// `key: value` lines with the values aligned, for one object (`volume show`, `pool`).
#[derive(Debug, Default)]
pub struct Fields {
    rows: Vec<(String, String)>,
}

impl Fields {
    pub fn new() -> Fields {
        Fields::default()
    }

    pub fn add(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.rows.push((key.into(), value.into()));
    }

    pub fn render(&self) -> String {
        let width = self
            .rows
            .iter()
            .map(|(k, _)| k.chars().count() + 1)
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        for (key, value) in &self.rows {
            let label = format!("{key}:");
            out.push_str(format!("{label:<width$}  {value}").trim_end());
            out.push('\n');
        }
        out
    }
}

/// Bytes for people: exact binary units when they divide, else one decimal (`1.5GiB`).
pub fn human_bytes(bytes: u64) -> String {
    for (unit, name) in crate::size::BINARY_UNITS {
        if bytes >= unit {
            if bytes.is_multiple_of(unit) {
                return format!("{}{name}", bytes / unit);
            }
            return format!("{:.1}{name}", bytes as f64 / unit as f64);
        }
    }
    format!("{bytes}B")
}

/// Bytes per second as MB/s (10^6) when exact, else MiB/s when exact, else MB/s with one
/// decimal.
pub fn bytes_rate(bytes_per_s: u64) -> String {
    const MB: u64 = 1_000_000;
    const MIB: u64 = 1 << 20;
    if bytes_per_s.is_multiple_of(MB) {
        format!("{} MB/s", bytes_per_s / MB)
    } else if bytes_per_s.is_multiple_of(MIB) {
        format!("{} MiB/s", bytes_per_s / MIB)
    } else {
        format!("{:.1} MB/s", bytes_per_s as f64 / MB as f64)
    }
}

/// A fractional rate with one decimal: MB/s below 10 GB/s (`123.4 MB/s`), else GB/s.
pub fn mb_per_s(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e10 {
        format!("{:.1} GB/s", bytes_per_s / 1e9)
    } else {
        format!("{:.1} MB/s", bytes_per_s / 1e6)
    }
}

/// An integer with thousands separators (`5,400,000`).
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A share as a percentage with one decimal, `-` when the whole is 0.
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".to_string();
    }
    format!("{:.1}%", part as f64 * 100.0 / whole as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_trim() {
        let mut table = Table::new(&[("NAME", Align::Left), ("SIZE", Align::Right)]);
        table.row(vec!["a".into(), "1GiB".into()]);
        table.row(vec!["longer".into(), "512MiB".into()]);
        assert_eq!(
            table.render(false),
            "NAME      SIZE\na         1GiB\nlonger  512MiB\n"
        );
        let mut table = Table::new(&[("A", Align::Right), ("NOTE", Align::Left)]);
        table.row(vec!["10".into(), "".into()]);
        table.row(vec!["µs".into()]);
        assert_eq!(table.render(false), " A  NOTE\n10\nµs\n");
        assert!(table.render(true).starts_with("\x1b[1m A  NOTE\x1b[0m\n"));
    }

    #[test]
    fn fields_align() {
        let mut fields = Fields::new();
        fields.add("name", "v1");
        fields.add("allocated", "0B");
        assert_eq!(fields.render(), "name:       v1\nallocated:  0B\n");
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(0), "0B");
        assert_eq!(human_bytes(1000), "1000B");
        assert_eq!(human_bytes(1 << 30), "1GiB");
        assert_eq!(human_bytes(3 << 29), "1.5GiB");
        assert_eq!(bytes_rate(125_000_000), "125 MB/s");
        assert_eq!(bytes_rate(250 << 20), "250 MiB/s");
        assert_eq!(bytes_rate(1_500_001), "1.5 MB/s");
        assert_eq!(mb_per_s(1_234_567.0), "1.2 MB/s");
        assert_eq!(mb_per_s(24_782_400_000.0), "24.8 GB/s");
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(5_400_000), "5,400,000");
        assert_eq!(percent(1, 4), "25.0%");
        assert_eq!(percent(1, 0), "-");
    }
}
