//! Human sizes on the command line: `1GiB`, `512MiB`, `4k`, `1073741824`.
//!
//! Binary units (KiB, MiB, GiB, TiB and the bare K/M/G/T that qemu-img also reads as binary),
//! decimal units only when spelled KB/MB/GB/TB. Overflow is an error, never a wrap.

use std::fmt;

#[derive(Debug, PartialEq, Eq)]
pub struct SizeError(String);

impl fmt::Display for SizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid size {:?}: use bytes or a unit such as 512MiB, 1GiB, 4k",
            self.0
        )
    }
}

impl std::error::Error for SizeError {}

/// Parses a size in bytes.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(split);
    if digits.is_empty() {
        return Err(SizeError(text.to_string()));
    }
    let value: u64 = digits.parse().map_err(|_| SizeError(text.to_string()))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(SizeError(text.to_string())),
    };
    value
        .checked_mul(multiplier)
        .ok_or_else(|| SizeError(text.to_string()))
}

/// Binary units, largest first.
pub const BINARY_UNITS: [(u64, &str); 4] = [
    (1 << 40, "TiB"),
    (1 << 30, "GiB"),
    (1 << 20, "MiB"),
    (1 << 10, "KiB"),
];

/// Formats bytes with the largest binary unit that divides them exactly, else in bytes.
pub fn format_size(bytes: u64) -> String {
    for (unit, name) in BINARY_UNITS {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{}", bytes / unit, name);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_units() {
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size(" 3 MiB "), Ok(3 << 20));
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        assert!(parse_size("").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1.5GiB").is_err());
        assert!(parse_size("10XB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn formats_exact_units() {
        assert_eq!(format_size(1 << 30), "1GiB");
        assert_eq!(format_size(3 << 20), "3MiB");
        assert_eq!(format_size(1000), "1000B");
    }
}
