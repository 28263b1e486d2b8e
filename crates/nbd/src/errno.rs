//! The NBD error values that may appear in a reply's error field.
//!
//! Why: the spec restricts the error field to a fixed set of values ("the allowed
//! values for the error field have been restricted to set of possibilities"), so the
//! server works with a closed enum instead of raw host `errno`s, and the mapping from
//! storage failures to wire values happens in exactly one type.

use crate::consts;

/// An NBD error value. `as_u32()` gives the wire value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Errno {
    /// `NBD_EPERM` (1): operation not permitted (writes on a read-only export).
    Eperm = consts::NBD_EPERM,
    /// `NBD_EIO` (5): input/output error (device errors).
    Eio = consts::NBD_EIO,
    /// `NBD_ENOMEM` (12): "The server SHOULD NOT return `NBD_ENOMEM` if at all possible."
    Enomem = consts::NBD_ENOMEM,
    /// `NBD_EINVAL` (22): invalid argument.
    Einval = consts::NBD_EINVAL,
    /// `NBD_ENOSPC` (28): no space left / write beyond the end of the export.
    Enospc = consts::NBD_ENOSPC,
    /// `NBD_EOVERFLOW` (75): only for `NBD_CMD_READ` with `NBD_CMD_FLAG_DF`.
    Eoverflow = consts::NBD_EOVERFLOW,
    /// `NBD_ENOTSUP` (95): only for `NBD_CMD_WRITE_ZEROES` with `NBD_CMD_FLAG_FAST_ZERO`.
    Enotsup = consts::NBD_ENOTSUP,
    /// `NBD_ESHUTDOWN` (108): the server is shutting down.
    Eshutdown = consts::NBD_ESHUTDOWN,
}

impl Errno {
    /// The value sent in the 32-bit error field.
    #[must_use]
    pub const fn as_u32(self) -> u32 {
        self as u32
    }

    /// Parses a wire value; `None` for 0 (success) and for values the spec does not define.
    #[must_use]
    pub const fn from_u32(raw: u32) -> Option<Self> {
        match raw {
            consts::NBD_EPERM => Some(Self::Eperm),
            consts::NBD_EIO => Some(Self::Eio),
            consts::NBD_ENOMEM => Some(Self::Enomem),
            consts::NBD_EINVAL => Some(Self::Einval),
            consts::NBD_ENOSPC => Some(Self::Enospc),
            consts::NBD_EOVERFLOW => Some(Self::Eoverflow),
            consts::NBD_ENOTSUP => Some(Self::Enotsup),
            consts::NBD_ESHUTDOWN => Some(Self::Eshutdown),
            _ => None,
        }
    }

    /// The spec's constant name, for logs.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Eperm => "NBD_EPERM",
            Self::Eio => "NBD_EIO",
            Self::Enomem => "NBD_ENOMEM",
            Self::Einval => "NBD_EINVAL",
            Self::Enospc => "NBD_ENOSPC",
            Self::Eoverflow => "NBD_EOVERFLOW",
            Self::Enotsup => "NBD_ENOTSUP",
            Self::Eshutdown => "NBD_ESHUTDOWN",
        }
    }
}

impl From<Errno> for u32 {
    fn from(errno: Errno) -> Self {
        errno.as_u32()
    }
}

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.as_u32())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_values_match_spec_table() {
        // "The following error values are defined:" NBD_EPERM 1, NBD_EIO 5, NBD_ENOMEM 12, NBD_EINVAL 22,
        // NBD_ENOSPC 28, NBD_EOVERFLOW 75, NBD_ENOTSUP 95, NBD_ESHUTDOWN 108.
        let table = [
            (Errno::Eperm, 1),
            (Errno::Eio, 5),
            (Errno::Enomem, 12),
            (Errno::Einval, 22),
            (Errno::Enospc, 28),
            (Errno::Eoverflow, 75),
            (Errno::Enotsup, 95),
            (Errno::Eshutdown, 108),
        ];
        for (errno, wire) in table {
            assert_eq!(errno.as_u32(), wire);
            assert_eq!(u32::from(errno), wire);
            assert_eq!(Errno::from_u32(wire), Some(errno));
        }
        assert_eq!(Errno::from_u32(0), None);
        assert_eq!(Errno::from_u32(2), None);
        assert_eq!(Errno::Einval.to_string(), "NBD_EINVAL (22)");
    }
}
