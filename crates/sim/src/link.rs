//! Network link model (the node's NIC, one instance per direction).
//!
//! A link is a FIFO server that moves bytes at a fixed rate. BurstCBS (docs/background.md §1.5) found
//! that large I/Os are bound by the NIC, not the CPU, so the node needs this resource to show
//! the BPS-heavy interference of reproduction (a). The busy-until time is kept in floating
//! point so that sub-nanosecond transfer times add up exactly over millions of I/Os.

/// One direction of a network link.
#[derive(Clone, Debug)]
pub struct Link {
    ns_per_byte: f64,
    free_at_ns: f64,
    /// Bytes moved so far.
    pub bytes: u64,
    /// Time spent transferring, ns.
    pub busy_ns: f64,
}

impl Link {
    /// A link of `bytes_per_s` (0 or non-finite = unlimited: transfers take no time).
    pub fn new(bytes_per_s: f64) -> Link {
        let ns_per_byte = if bytes_per_s.is_finite() && bytes_per_s > 0.0 {
            1e9 / bytes_per_s
        } else {
            0.0
        };
        Link {
            ns_per_byte,
            free_at_ns: 0.0,
            bytes: 0,
            busy_ns: 0.0,
        }
    }

    /// Time to move `bytes` on an idle link, ns (rounded up).
    pub fn transfer_ns(&self, bytes: u64) -> u64 {
        crate::fastmath::ceil_u64(crate::fastmath::u64_to_f64(bytes) * self.ns_per_byte)
    }

    /// Moves `bytes` that become ready at `at_ns`; returns when the last byte is through.
    /// Calls must come in non-decreasing `at_ns` order (FIFO).
    #[inline]
    pub fn submit(&mut self, at_ns: u64, bytes: u64) -> u64 {
        if self.ns_per_byte == 0.0 || bytes == 0 {
            return at_ns;
        }
        let start = self.free_at_ns.max(crate::fastmath::u64_to_f64(at_ns));
        let took = crate::fastmath::u64_to_f64(bytes) * self.ns_per_byte;
        self.free_at_ns = start + took;
        self.bytes += bytes;
        self.busy_ns += took;
        crate::fastmath::ceil_u64(self.free_at_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_to_back_transfers_run_at_line_rate() {
        // 100 Gb/s = 12.5 GB/s; 1000 x 128 KiB back to back.
        let mut l = Link::new(12.5e9);
        let mut done = 0;
        for _ in 0..1000 {
            done = l.submit(0, 128 << 10);
        }
        let want = 1000.0 * 131_072.0 / 12.5;
        assert!((done as f64 - want).abs() <= 1.0, "{done} vs {want}");
    }

    #[test]
    fn idle_link_starts_at_arrival_and_unlimited_is_free() {
        let mut l = Link::new(1e9);
        assert_eq!(l.submit(5_000, 1_000), 6_000);
        assert_eq!(l.submit(100_000, 500), 100_500);
        let mut u = Link::new(0.0);
        assert_eq!(u.submit(42, 1 << 30), 42);
    }
}
