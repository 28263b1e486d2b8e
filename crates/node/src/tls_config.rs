//! The NBD port's TLS settings (`[tls]`), apart from `tls` (the handshake, which needs the
//! `tls` cargo feature) so that a build without the feature still reads and checks them.

use std::path::PathBuf;

/// TLS on the NBD port (`NBD_OPT_STARTTLS`). Needs the `tls` cargo feature.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// `identity:hexkey` lines (qemu's `keys.psk`).
    pub psk_file: Option<PathBuf>,
    /// qemu's X.509 layout: `server-cert.pem`, `server-key.pem`, and optionally `ca-cert.pem`
    /// (then client certificates are required and verified against it).
    pub cert_dir: Option<PathBuf>,
    /// FORCEDTLS: every option but STARTTLS and ABORT is refused with `NBD_REP_ERR_TLS_REQD`
    /// until TLS is up. Otherwise TLS is the client's choice.
    pub required: bool,
    /// The tenant each client certificate acts for, by its common name (`[tls]
    /// certificate_tenants`). Required when `ca-cert.pem` makes the server verify client
    /// certificates: a certificate whose CN is not in it fails the handshake. Certificate
    /// names and PSK identities are two namespaces; only this map joins a CN to a tenant.
    pub certificate_tenants: Option<std::collections::BTreeMap<String, String>>,
    /// Also offer the TLS 1.2 suites without forward secrecy (plain PSK) and the CBC ones,
    /// for old clients (`[tls] legacy_cipher_suites`). Off: only ephemeral (EC)DHE with AEAD.
    pub legacy_cipher_suites: bool,
    /// TLS handshakes per second per client address group, bursts of twice that
    /// (`[tls] handshakes_per_s_per_address`, `handshake_limit.rs`); 0: no limit.
    pub handshakes_per_s_per_address: u32,
}
