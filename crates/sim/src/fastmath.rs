//! Rounding and integer conversions without slow paths on the per-I/O path.
//!
//! `f64::round` and `f64::ceil` compile to library calls on the baseline x86-64 target, and
//! the simulator rounds a few times per I/O; these inline versions are exact for the
//! non-negative values below 2^52 the simulator produces (times and costs in ns).
//!
//! Conversions between `f64` and `u64` have no single instruction on baseline x86-64 (only
//! the signed `i64` ones do), so `x as u64` / `x as f64` become a compare-and-fix-up sequence
//! several times per I/O (measured: ~8 % of the FIFO run). Going through `i64` is exact and
//! gives the same result for every value below 2^63, which covers every time and size here.
//! (A branch between the two conversions does not help: the compiler merges it back into the
//! slow unsigned sequence, so `u64_to_f64` saturates instead.)

/// Below this, `f64 -> i64 -> u64` equals `f64 -> u64`.
const I64_LIMIT_F: f64 = 9_223_372_036_854_775_808.0; // 2^63

/// `v as u64` for non-negative `v` (truncation; saturating like `as`).
#[inline]
pub fn trunc_u64(v: f64) -> u64 {
    if v < I64_LIMIT_F {
        // Negative and NaN give 0 like `as u64` (NaN as i64 is 0, negatives clamp below).
        (v as i64).max(0) as u64
    } else {
        v as u64
    }
}

/// `x as f64` (same value and rounding) for `x < 2^63`; larger values saturate to 2^63.
#[inline]
pub fn u64_to_f64(x: u64) -> f64 {
    x.min(i64::MAX as u64) as i64 as f64
}

/// `v.round()` for `0 <= v < 2^52` (half rounds up), saturating to 0 for negative or NaN.
#[inline]
pub fn round_u64(v: f64) -> u64 {
    if v > 0.0 { trunc_u64(v + 0.5) } else { 0 }
}

/// `v.ceil()` for `0 <= v < 2^52`, saturating to 0 for negative or NaN.
#[inline]
pub fn ceil_u64(v: f64) -> u64 {
    if v > 0.0 {
        if v < I64_LIMIT_F {
            let t = v as i64;
            (if (t as f64) < v { t + 1 } else { t }) as u64
        } else {
            // Already integral at this magnitude.
            v as u64
        }
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

    #[test]
    fn conversions_agree_with_as() {
        for v in [
            0.0,
            -0.0,
            -1.5,
            0.9,
            1e18,
            9.2e18,
            9.223_372_036_854_774e18,
            1.8e19,
            1e30,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            assert_eq!(trunc_u64(v), v as u64, "trunc {v}");
        }
        for x in [0u64, 1, (1 << 53) + 1, (1 << 62) + 12345, i64::MAX as u64] {
            assert_eq!(u64_to_f64(x).to_bits(), (x as f64).to_bits(), "to_f64 {x}");
        }
        assert_eq!(u64_to_f64(u64::MAX), 9_223_372_036_854_775_808.0);
        for v in [0.5, 1.0, 1.2, 4096.0001, 9.3e18, 1e300] {
            assert_eq!(ceil_u64(v), v.ceil() as u64, "ceil {v}");
        }
    }
}
