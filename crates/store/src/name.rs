//! The volume naming rule, and the tenant id rule.
//!
//! Why: a volume name is also the NBD export name, a URL path segment of the management API
//! and a word on the command line, so it is restricted to characters that need no quoting.
//! A tenant id is compared byte for byte with a TLS client's PSK identity or certificate
//! common name, so it must be something a PSK file line or a certificate subject can hold
//! and an operator can read: printable ASCII, no surrounding spaces, bounded length.

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

/// Longest accepted tenant id, in bytes (an X.509 common name holds at most 64 characters;
/// PSK identities may be longer).
pub const MAX_TENANT_ID_LEN: usize = 128;

/// Checks a tenant id: 1–128 printable ASCII characters (space to `~`), not starting or
/// ending with a space.
pub fn validate_tenant_id(tenant: &str) -> Result<(), StoreError> {
    let invalid = |reason| StoreError::InvalidTenant {
        tenant: tenant.chars().take(80).collect(),
        reason,
    };
    if tenant.is_empty() {
        return Err(invalid("empty"));
    }
    if tenant.len() > MAX_TENANT_ID_LEN {
        return Err(invalid("longer than 128 bytes"));
    }
    if !tenant.bytes().all(|b| (b' '..=b'~').contains(&b)) {
        return Err(invalid(
            "only printable ASCII characters (space to '~') are allowed",
        ));
    }
    if tenant.starts_with(' ') || tenant.ends_with(' ') {
        return Err(invalid("starts or ends with a space"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_accept_and_reject() {
        for ok in [
            "a",
            "alice",
            "tenant-a",
            "Tenant A",
            "acme.example:prod/1",
            &"t".repeat(128),
        ] {
            assert!(validate_tenant_id(ok).is_ok(), "{ok:?}");
        }
        for bad in [
            "",
            " alice",
            "alice ",
            "a\tb",
            "a\nb",
            "a\0",
            "\u{7f}",
            "é",
            "zero\u{200b}width",
            &"t".repeat(129),
        ] {
            assert!(
                matches!(
                    validate_tenant_id(bad),
                    Err(StoreError::InvalidTenant { .. })
                ),
                "{bad:?}"
            );
        }
    }

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
