//! CPU feature levels for the per-window allocation's vector arithmetic.
//!
//! Burst's allocation does four-dimensional saturating `u64` arithmetic (min, compare,
//! subtract) for every active volume every window. Baseline x86-64 (SSE2) has no 64-bit
//! compare, so the compiler emits it lane by lane; AVX-512 has unsigned 64-bit min and compare
//! on four lanes at once, AVX2 at least signed 64-bit compares. The same source compiled for
//! those levels took the allocation bench at 1,024 active volumes from ~20 µs to ~13 µs
//! (x86-64-v4) and ~17 µs (x86-64-v3) on the EPYC this project runs on (docs/results.md,
//! "CPU feature dispatch"). Building the whole binary for such a level would crash it on a CPU
//! without it, so the hot loop alone is compiled three times and the level is detected once,
//! when a policy is built, with the standard library's cached CPUID check.
//!
//! Every level computes exactly the same integers (no floating point is contracted or
//! reordered: Rust never fuses or reassociates `f64` operations), so decisions do not depend
//! on the machine; a test runs the allocation at every level the CPU has and compares.

/// An instruction-set level the allocation can be compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuLevel {
    /// Whatever the binary was built for (SSE2 on x86-64, or any other architecture).
    Baseline,
    /// x86-64-v3: AVX2, BMI1/2, LZCNT, POPCNT, FMA.
    X86V3,
    /// x86-64-v4: x86-64-v3 plus AVX-512 F, VL, BW, DQ, CD.
    X86V4,
}

impl CpuLevel {
    /// The highest level this CPU supports (CPUID, cached by the standard library).
    pub fn detect() -> CpuLevel {
        #[cfg(target_arch = "x86_64")]
        {
            let v3 = std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("bmi1")
                && std::is_x86_feature_detected!("bmi2")
                && std::is_x86_feature_detected!("lzcnt")
                && std::is_x86_feature_detected!("popcnt")
                && std::is_x86_feature_detected!("fma");
            let v4 = v3
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("avx512cd");
            if v4 {
                return CpuLevel::X86V4;
            }
            if v3 {
                return CpuLevel::X86V3;
            }
        }
        CpuLevel::Baseline
    }

    /// Every level this CPU supports, lowest first.
    pub fn available() -> Vec<CpuLevel> {
        let top = CpuLevel::detect();
        [CpuLevel::Baseline, CpuLevel::X86V3, CpuLevel::X86V4]
            .into_iter()
            .filter(|l| *l <= top)
            .collect()
    }

    /// `baseline`, `x86-64-v3` or `x86-64-v4`.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuLevel::Baseline => "baseline",
            CpuLevel::X86V3 => "x86-64-v3",
            CpuLevel::X86V4 => "x86-64-v4",
        }
    }
}

impl std::str::FromStr for CpuLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<CpuLevel, String> {
        match s {
            "baseline" => Ok(CpuLevel::Baseline),
            "x86-64-v3" | "v3" => Ok(CpuLevel::X86V3),
            "x86-64-v4" | "v4" => Ok(CpuLevel::X86V4),
            other => Err(format!(
                "unknown CPU level {other:?} (baseline, x86-64-v3, x86-64-v4)"
            )),
        }
    }
}

/// Runs `body` compiled for `level`, or for the highest level this CPU has if that is lower
/// (so no caller can make it run an instruction the CPU lacks). `body` should be
/// `#[inline(always)]` down to its arithmetic, so that it is compiled into each level's copy.
macro_rules! dispatch {
    ($level:expr, |$($arg:ident : $ty:ty),*| $body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt,fma")]
        fn v3($($arg: $ty),*) {
            $body
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(
            enable = "avx2,bmi1,bmi2,lzcnt,popcnt,fma,avx512f,avx512vl,avx512bw,avx512dq,avx512cd"
        )]
        fn v4($($arg: $ty),*) {
            $body
        }
        fn baseline($($arg: $ty),*) {
            $body
        }
        match $crate::cpu::CpuLevel::min($level, $crate::cpu::CpuLevel::detect()) {
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::CpuLevel::X86V4 => {
                // SAFETY: the level is at most what `CpuLevel::detect` found, and `X86V4` is only
                // found on a CPU that has every feature `v4` is compiled with.
                #[allow(unsafe_code)]
                unsafe {
                    v4($($arg),*)
                }
            }
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::CpuLevel::X86V3 => {
                // SAFETY: as above, for `X86V3` and `v3`'s features.
                #[allow(unsafe_code)]
                unsafe {
                    v3($($arg),*)
                }
            }
            _ => baseline($($arg),*),
        }
    }};
}
pub(crate) use dispatch;
