//! The volume naming rule.
//!
//! Why: a volume name is also the NBD export name, a URL path segment of the management API
//! and a word on the command line, so it is restricted to characters that need no quoting.

use crate::error::StoreError;

/// Longest accepted volume name, in bytes.
pub const MAX_VOLUME_NAME_LEN: usize = 64;

/// Checks a volume name: 1–64 characters of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_volume_name(name: &str) -> Result<(), StoreError> {
    let invalid = |reason| StoreError::InvalidName {
        name: name.chars().take(80).collect(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("empty"));
    }
    if name.len() > MAX_VOLUME_NAME_LEN {
        return Err(invalid("longer than 64 characters"));
    }
    if name.starts_with('.') || name.starts_with('-') {
        return Err(invalid("starts with '.' or '-'"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    {
        return Err(invalid("only A-Z, a-z, 0-9, '.', '_' and '-' are allowed"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_rejects() {
        for ok in ["a", "vol-1", "A.b_c-d", "0", &"x".repeat(64)] {
            assert!(validate_volume_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".hidden",
            "-x",
            "a/b",
            "a b",
            "é",
            &"x".repeat(65),
            "a\0",
        ] {
            assert!(
                matches!(
                    validate_volume_name(bad),
                    Err(StoreError::InvalidName { .. })
                ),
                "{bad:?}"
            );
        }
    }
}
