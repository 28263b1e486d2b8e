//! The cost vector: what one I/O consumes of each node resource.
//!
//! BurstCBS (docs/background.md §1.5) showed that a scalar cost charges the wrong resource: small I/Os
//! are CPU-bound, large ones NIC-bound. Every admission decision in this crate therefore
//! compares a four-dimensional [`CostVector`] against a capacity of the same shape, dimension
//! by dimension. All arithmetic is integer and saturating so that a hostile or absurd request
//! can never wrap a budget around.

use serde::{Deserialize, Serialize};
use std::ops::{Add, AddAssign, Sub, SubAssign};

/// Number of resource dimensions in a [`CostVector`].
pub const DIMENSIONS: usize = 4;

/// One resource dimension of the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Dimension {
    /// Front-end CPU time in nanoseconds.
    CpuNs,
    /// Payload bytes received from clients (writes).
    IngressBytes,
    /// Payload bytes sent to clients (reads).
    EgressBytes,
    /// Device cost units (IOCost device nanoseconds or Libra milli-VOPs, see `model`).
    DeviceUnits,
}

impl Dimension {
    /// All dimensions in the order used by [`CostVector::dims`].
    pub const ALL: [Dimension; DIMENSIONS] = [
        Dimension::CpuNs,
        Dimension::IngressBytes,
        Dimension::EgressBytes,
        Dimension::DeviceUnits,
    ];

    /// Stable lower-case name, used in metrics and error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::CpuNs => "cpu_ns",
            Dimension::IngressBytes => "ingress_bytes",
            Dimension::EgressBytes => "egress_bytes",
            Dimension::DeviceUnits => "device_units",
        }
    }

    /// Index of this dimension in [`CostVector::dims`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What one I/O costs (or what a node can do per second) in each resource dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CostVector {
    /// CPU time, nanoseconds.
    pub cpu_ns: u64,
    /// Bytes received from the client.
    pub ingress_bytes: u64,
    /// Bytes sent to the client.
    pub egress_bytes: u64,
    /// Device cost units.
    pub device_units: u64,
}

impl CostVector {
    /// The zero vector.
    pub const ZERO: CostVector = CostVector {
        cpu_ns: 0,
        ingress_bytes: 0,
        egress_bytes: 0,
        device_units: 0,
    };

    /// A vector with every dimension at `u64::MAX` ("unlimited").
    pub const MAX: CostVector = CostVector {
        cpu_ns: u64::MAX,
        ingress_bytes: u64::MAX,
        egress_bytes: u64::MAX,
        device_units: u64::MAX,
    };

    /// Builds a vector from its four components.
    pub const fn new(
        cpu_ns: u64,
        ingress_bytes: u64,
        egress_bytes: u64,
        device_units: u64,
    ) -> Self {
        CostVector {
            cpu_ns,
            ingress_bytes,
            egress_bytes,
            device_units,
        }
    }

    /// The components in [`Dimension::ALL`] order.
    pub const fn dims(&self) -> [u64; DIMENSIONS] {
        [
            self.cpu_ns,
            self.ingress_bytes,
            self.egress_bytes,
            self.device_units,
        ]
    }

    /// Inverse of [`CostVector::dims`].
    pub const fn from_dims(d: [u64; DIMENSIONS]) -> Self {
        CostVector::new(d[0], d[1], d[2], d[3])
    }

    /// A bit per dimension ([`Dimension::ALL`] order) whose component is not zero: the
    /// dimensions a request of this cost needs.
    pub const fn dims_mask(&self) -> u8 {
        (self.cpu_ns > 0) as u8
            | ((self.ingress_bytes > 0) as u8) << 1
            | ((self.egress_bytes > 0) as u8) << 2
            | ((self.device_units > 0) as u8) << 3
    }

    /// The component of one dimension.
    pub fn get(&self, dim: Dimension) -> u64 {
        self.dims()[dim.index()]
    }

    /// True when every component is zero.
    pub fn is_zero(&self) -> bool {
        *self == CostVector::ZERO
    }

    /// Component-wise saturating addition.
    pub fn saturating_add(self, rhs: CostVector) -> CostVector {
        self.zip(rhs, u64::saturating_add)
    }

    /// Component-wise saturating subtraction (clamps at zero).
    pub fn saturating_sub(self, rhs: CostVector) -> CostVector {
        self.zip(rhs, u64::saturating_sub)
    }

    /// Component-wise subtraction, `None` if any component would go negative.
    pub fn checked_sub(self, rhs: CostVector) -> Option<CostVector> {
        Some(CostVector::new(
            self.cpu_ns.checked_sub(rhs.cpu_ns)?,
            self.ingress_bytes.checked_sub(rhs.ingress_bytes)?,
            self.egress_bytes.checked_sub(rhs.egress_bytes)?,
            self.device_units.checked_sub(rhs.device_units)?,
        ))
    }

    /// Component-wise minimum.
    pub fn min(self, rhs: CostVector) -> CostVector {
        self.zip(rhs, u64::min)
    }

    /// Component-wise maximum.
    pub fn max(self, rhs: CostVector) -> CostVector {
        self.zip(rhs, u64::max)
    }

    /// True when every component is `<=` the same component of `cap`.
    pub fn fits_within(&self, cap: &CostVector) -> bool {
        self.cpu_ns <= cap.cpu_ns
            && self.ingress_bytes <= cap.ingress_bytes
            && self.egress_bytes <= cap.egress_bytes
            && self.device_units <= cap.device_units
    }

    /// The first dimension in which `self` exceeds `cap`, if any.
    pub fn first_exceeding(&self, cap: &CostVector) -> Option<Dimension> {
        Dimension::ALL
            .into_iter()
            .find(|d| self.get(*d) > cap.get(*d))
    }

    /// Multiplies every component by `num / den`, rounding up, saturating.
    /// `den == 0` yields [`CostVector::MAX`] for non-zero components.
    pub fn mul_ratio_ceil(self, num: u64, den: u64) -> CostVector {
        self.map(|x| mul_div_ceil(x, num, den))
    }

    /// Multiplies every component by `num / den`, rounding down, saturating.
    pub fn mul_ratio_floor(self, num: u64, den: u64) -> CostVector {
        self.map(|x| mul_div_floor(x, num, den))
    }

    /// Applies `f` to every component.
    pub fn map(self, mut f: impl FnMut(u64) -> u64) -> CostVector {
        let d = self.dims();
        CostVector::from_dims([f(d[0]), f(d[1]), f(d[2]), f(d[3])])
    }

    /// Combines two vectors component-wise with `f`.
    pub fn zip(self, rhs: CostVector, mut f: impl FnMut(u64, u64) -> u64) -> CostVector {
        let a = self.dims();
        let b = rhs.dims();
        CostVector::from_dims([f(a[0], b[0]), f(a[1], b[1]), f(a[2], b[2]), f(a[3], b[3])])
    }
}

/// `x * num / den` rounded down, computed in 128 bits and saturated to `u64`.
pub fn mul_div_floor(x: u64, num: u64, den: u64) -> u64 {
    if den == 0 {
        return if x == 0 || num == 0 { 0 } else { u64::MAX };
    }
    // Same exact result in 64 bits when the product fits (no 128-bit division routine).
    if let Some(p) = x.checked_mul(num) {
        return p / den;
    }
    let v = u128::from(x) * u128::from(num) / u128::from(den);
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// `x * num / den` rounded up, computed in 128 bits and saturated to `u64`.
pub fn mul_div_ceil(x: u64, num: u64, den: u64) -> u64 {
    if den == 0 {
        return if x == 0 || num == 0 { 0 } else { u64::MAX };
    }
    if let Some(p) = x.checked_mul(num) {
        return p.div_ceil(den);
    }
    let v = (u128::from(x) * u128::from(num)).div_ceil(u128::from(den));
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// Saturating addition (documented: a budget never wraps).
impl Add for CostVector {
    type Output = CostVector;
    fn add(self, rhs: CostVector) -> CostVector {
        self.saturating_add(rhs)
    }
}

/// Saturating subtraction (documented: clamps at zero instead of underflowing).
impl Sub for CostVector {
    type Output = CostVector;
    fn sub(self, rhs: CostVector) -> CostVector {
        self.saturating_sub(rhs)
    }
}

impl AddAssign for CostVector {
    fn add_assign(&mut self, rhs: CostVector) {
        *self = self.saturating_add(rhs);
    }
}

impl SubAssign for CostVector {
    fn sub_assign(&mut self, rhs: CostVector) {
        *self = self.saturating_sub(rhs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let a = CostVector::new(1, 2, 3, u64::MAX);
        let b = CostVector::new(2, 1, 3, 1);
        assert_eq!(a + b, CostVector::new(3, 3, 6, u64::MAX));
        assert_eq!(a - b, CostVector::new(0, 1, 0, u64::MAX - 1));
        assert_eq!(a.checked_sub(b), None);
        assert_eq!(b.checked_sub(b), Some(CostVector::ZERO));
    }

    #[test]
    fn fits_within_is_per_dimension() {
        let cap = CostVector::new(10, 10, 10, 10);
        assert!(CostVector::new(10, 0, 10, 0).fits_within(&cap));
        let over = CostVector::new(0, 0, 11, 0);
        assert!(!over.fits_within(&cap));
        assert_eq!(over.first_exceeding(&cap), Some(Dimension::EgressBytes));
    }

    #[test]
    fn ratios_round_as_named() {
        assert_eq!(mul_div_ceil(10, 1, 3), 4);
        assert_eq!(mul_div_floor(10, 1, 3), 3);
        assert_eq!(mul_div_floor(u64::MAX, 2, 1), u64::MAX);
        assert_eq!(mul_div_ceil(5, 1, 0), u64::MAX);
        assert_eq!(
            CostVector::new(3, 6, 9, 12).mul_ratio_ceil(1, 2),
            CostVector::new(2, 3, 5, 6)
        );
    }
}
