//! Rounding without libm calls on the per-I/O path.
//!
//! `f64::round` and `f64::ceil` compile to library calls on the baseline x86-64 target, and
//! the simulator rounds a few times per I/O; these inline versions are exact for the
//! non-negative values below 2^52 the simulator produces (times and costs in ns).

/// `v.round()` for `0 <= v < 2^52` (half rounds up), saturating to 0 for negative or NaN.
#[inline]
pub fn round_u64(v: f64) -> u64 {
    if v > 0.0 { (v + 0.5) as u64 } else { 0 }
}

/// `v.ceil()` for `0 <= v < 2^52`, saturating to 0 for negative or NaN.
#[inline]
pub fn ceil_u64(v: f64) -> u64 {
    if v > 0.0 {
        let t = v as u64;
        if (t as f64) < v { t + 1 } else { t }
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agrees_with_std() {
        for v in [
            0.0,
            0.2,
            0.5,
            0.7,
            1.0,
            1.5,
            2.4999,
            12345.5,
            1e12 + 0.3,
            4503599627370495.0,
        ] {
            assert_eq!(round_u64(v), v.round() as u64, "round {v}");
            assert_eq!(ceil_u64(v), v.ceil() as u64, "ceil {v}");
        }
        assert_eq!(round_u64(-3.0), 0);
        assert_eq!(ceil_u64(f64::NAN), 0);
    }
}
