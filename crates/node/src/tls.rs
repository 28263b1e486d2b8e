//! TLS for NBD sessions (`NBD_OPT_STARTTLS`), with X.509 certificates or pre-shared keys.
//!
//! Why OpenSSL: qemu and libnbd (both GnuTLS) offer two kinds of credentials, X.509 and
//! external pre-shared keys (`keys.psk`: `identity:hexkey` lines). rustls has no external PSK
//! (rustls does not implement it), so this module drives OpenSSL through the `openssl` crate, with
//! `tokio-openssl` running the handshake and the records on the session's socket. It sits
//! behind the `tls` cargo feature: a machine without libssl-dev still builds the server.
//!
//! One [`TlsAcceptor`] is built at start-up from [`TlsConfig`] and shared by every session;
//! a failed handshake (wrong key, untrusted certificate) ends that session only.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use openssl::ex_data::Index;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslOptions, SslRef,
    SslSessionCacheMode, SslVerifyMode, SslVersion,
};
use openssl::x509::store::X509Lookup;
use openssl::x509::verify::X509VerifyFlags;
use openssl::x509::{X509Name, X509Ref};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_openssl::SslStream;

use crate::handshake_limit::HandshakeLimiter;
use crate::tls_config::TlsConfig;

/// TLS 1.2 cipher suites by default: forward-secret AEAD suites only — ECDHE with AES-GCM or
/// ChaCha20-Poly1305 for certificates, and ECDHE-PSK with ChaCha20-Poly1305 (the one
/// forward-secret AEAD PSK suite OpenSSL and GnuTLS share; qemu and libnbd add `+ECDHE-PSK`
/// to their priority). TLS 1.3 is forward-secret as it is: OpenSSL accepts a PSK only with
/// an (EC)DHE exchange (`psk_dhe_ke`) unless told otherwise, and it is not.
const TLS12_CIPHERS: &str =
    "ECDHE+AESGCM:ECDHE+CHACHA20:ECDHE-PSK-CHACHA20-POLY1305:!aNULL:!eNULL:!SHA1";

/// TLS 1.2 suites with `legacy_cipher_suites`: the default ones, then the CBC ECDHE-PSK
/// suites and the plain PSK suites (no forward secrecy: one leaked key opens every recorded
/// session), for clients that offer nothing better.
const TLS12_LEGACY_CIPHERS: &str = "ECDHE+AESGCM:ECDHE+CHACHA20:ECDHE-PSK-CHACHA20-POLY1305:\
    ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256:PSK-AES256-GCM-SHA384:\
    PSK-AES128-GCM-SHA256:PSK-CHACHA20-POLY1305:!aNULL:!eNULL";

/// TLS 1.3 suites when PSKs are configured: the SHA-256 ones first (see `TlsAcceptor::new`).
const TLS13_PSK_CIPHERSUITES: &str =
    "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384";

/// Longest PSK OpenSSL accepts (`PSK_MAX_PSK_LEN`).
const MAX_PSK_BYTES: usize = 512;
/// Shortest PSK accepted: 128 bits. One captured handshake lets an attacker test guesses of
/// the key offline, as fast as they can compute HMACs, so a short or human-chosen key falls;
/// 16 random bytes do not (GnuTLS `psktool` makes 32).
pub const MIN_PSK_BYTES: usize = 16;
/// Longest PSK identity: the TLS limit is 2^16 - 1, GnuTLS and OpenSSL use far less.
const MAX_IDENTITY_BYTES: usize = 1024;

/// Why TLS could not be set up, or a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}, line {line}: {reason}")]
    PskFile {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("{path} holds no keys")]
    NoKeys { path: PathBuf },
    #[error(
        "{path} is readable by others (mode {mode:o}): it holds every tenant's key; chmod 600 it"
    )]
    PskFileMode { path: PathBuf, mode: u32 },
    #[error("{path}: {source}")]
    Credentials {
        path: PathBuf,
        source: openssl::error::ErrorStack,
    },
    #[error("TLS needs --tls-psk-file or --tls-cert-dir")]
    NoCredentials,
    #[error(
        "client certificates are verified ({ca} exists), but no [tls] certificate_tenants map \
         says which tenant each certificate acts for: add one (--tls-cert-tenant CN=TENANT, or \
         [tls.certificate_tenants] in the configuration file; an empty map admits no \
         certificate), or remove ca-cert.pem to ask clients for no certificate"
    )]
    NoCertificateTenants { ca: PathBuf },
    #[error(
        "[tls] certificate_tenants maps client certificates, but {ca} does not exist, so no \
         client certificate is asked for: add the CA that signs them, or drop the map"
    )]
    CertificateTenantsWithoutCa { ca: PathBuf },
    #[error("setting up TLS: {0}")]
    Setup(#[from] openssl::error::ErrorStack),
    #[error("TLS handshake: {0}")]
    Handshake(openssl::ssl::Error),
    #[error(
        "too many TLS handshakes from {group}: refused before any cryptography \
         ([tls] handshakes_per_s_per_address)"
    )]
    Throttled { group: crate::origin::OriginGroup },
}

/// Who the client proved to be in the TLS handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// The PSK identity the client used.
    PskIdentity(String),
    /// A client certificate verified against `ca-cert.pem`: its common name, and the tenant
    /// `[tls] certificate_tenants` maps it to.
    Certificate { cn: String, tenant: String },
    /// Neither (a server certificate without client verification).
    Anonymous,
}

impl Peer {
    /// The tenant this client acts for: its PSK identity as it is (an identity no tenant id
    /// can equal, say one with a control character, sees no volume), the tenant its
    /// certificate's CN is mapped to, `None` for an anonymous client.
    pub fn into_tenant(self) -> Option<String> {
        match self {
            Peer::PskIdentity(tenant) | Peer::Certificate { tenant, .. } => Some(tenant),
            Peer::Anonymous => None,
        }
    }
}

/// Accepts TLS on sessions that asked for it with `NBD_OPT_STARTTLS`.
pub struct TlsAcceptor {
    context: SslContext,
    /// CN to tenant (`TlsConfig::certificate_tenants`); empty without client certificates.
    certificate_tenants: Arc<BTreeMap<String, String>>,
    /// Handshakes per address group (`handshake_limit.rs`); none by default.
    handshakes: Option<HandshakeLimiter>,
    /// Where the PSK callback leaves the identity it accepted (OpenSSL does not report the
    /// identity of a TLS 1.3 external PSK through `SSL_get_psk_identity`).
    identity_index: Index<Ssl, String>,
}

impl std::fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsAcceptor")
    }
}

impl TlsAcceptor {
    /// Builds the server context: certificates from `cert_dir` (qemu's layout:
    /// `server-cert.pem`, `server-key.pem`, and `ca-cert.pem` to require and verify client
    /// certificates), keys from `psk_file`, or both.
    pub fn new(config: &TlsConfig) -> Result<TlsAcceptor, TlsError> {
        if config.psk_file.is_none() && config.cert_dir.is_none() {
            return Err(TlsError::NoCredentials);
        }
        let identity_index = Ssl::new_ex_index::<String>()?;
        let mut builder = SslContextBuilder::new(SslMethod::tls_server())?;
        // "MUST support TLS version 1.2 ... MAY support older versions but SHOULD NOT do so
        // by default".
        builder.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        // No session resumption: a resumed session skips the PSK callback and the client
        // certificate, so the session would not know its tenant (it would come back as the
        // anonymous one). NBD sessions are long-lived; a full handshake per connection is cheap
        // next to them. No TLS 1.2 tickets or session cache, no TLS 1.3 tickets.
        builder.set_options(
            SslOptions::NO_COMPRESSION
                | SslOptions::CIPHER_SERVER_PREFERENCE
                | SslOptions::NO_RENEGOTIATION
                | SslOptions::NO_TICKET,
        );
        builder.set_session_cache_mode(SslSessionCacheMode::OFF);
        builder.set_num_tickets(0)?;
        builder.set_cipher_list(if config.legacy_cipher_suites {
            TLS12_LEGACY_CIPHERS
        } else {
            TLS12_CIPHERS
        })?;
        let mut certificate_tenants = Arc::new(BTreeMap::new());
        if let Some(dir) = &config.cert_dir {
            let verifies_clients = load_certificates(&mut builder, dir)?;
            let ca = dir.join("ca-cert.pem");
            match (&config.certificate_tenants, verifies_clients) {
                (Some(map), true) => certificate_tenants = Arc::new(map.clone()),
                (None, true) => return Err(TlsError::NoCertificateTenants { ca }),
                (Some(_), false) => return Err(TlsError::CertificateTenantsWithoutCa { ca }),
                (None, false) => {}
            }
            if verifies_clients {
                // A chain that verifies is not enough: its CN must be mapped to a tenant, or
                // the handshake fails (the client sees a certificate alert, not a session
                // that lists nothing).
                let map = Arc::clone(&certificate_tenants);
                builder.set_verify_callback(
                    SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT,
                    move |verified, chain| {
                        if !verified {
                            tracing::info!(
                                error = chain.error().error_string(),
                                depth = chain.error_depth(),
                                cn = chain.current_cert().and_then(common_name).as_deref(),
                                "TLS client certificate refused"
                            );
                            return false;
                        }
                        if chain.error_depth() != 0 {
                            return true;
                        }
                        let cn = chain.current_cert().and_then(common_name);
                        let mapped = cn.as_ref().is_some_and(|cn| map.contains_key(cn));
                        if !mapped {
                            tracing::info!(
                                cn = cn.as_deref().unwrap_or("(none)"),
                                "TLS client certificate verified, but its CN is not in \
                                 [tls] certificate_tenants: handshake refused"
                            );
                        }
                        mapped
                    },
                );
            }
        } else if config.certificate_tenants.is_some() {
            return Err(TlsError::CertificateTenantsWithoutCa {
                ca: PathBuf::from("ca-cert.pem"),
            });
        }
        if let Some(path) = &config.psk_file {
            // OpenSSL binds a TLS 1.3 PSK from this callback to SHA-256, and picks the suite
            // before it looks at the PSK: with a certificate configured and a SHA-384 suite
            // first, a PSK client (GnuTLS offers AES-256-GCM-SHA384 first) would be answered
            // with certificate authentication it has no credentials for.
            builder.set_ciphersuites(TLS13_PSK_CIPHERSUITES)?;
            let keys = Arc::new(load_psk_file(path)?);
            builder.set_psk_server_callback(move |ssl, identity, key_out| {
                let length = psk_lookup(&keys, identity, key_out);
                if let (true, Some(identity)) = (length > 0, identity) {
                    ssl.set_ex_data(
                        identity_index,
                        String::from_utf8_lossy(identity).into_owned(),
                    );
                    // The key authenticates the client: asking it for a certificate too (when
                    // ca-cert.pem is configured) would fail PSK-only clients.
                    ssl.set_verify(SslVerifyMode::NONE);
                }
                Ok(length)
            });
        }
        Ok(TlsAcceptor {
            context: builder.build(),
            certificate_tenants,
            handshakes: None,
            identity_index,
        })
    }

    /// Refuses handshakes over `limiter`'s rate per client address group.
    pub fn with_handshake_limit(mut self, limiter: HandshakeLimiter) -> TlsAcceptor {
        self.handshakes = Some(limiter);
        self
    }

    /// Runs the server side of the handshake on `stream` (right after the `NBD_REP_ACK` to
    /// `NBD_OPT_STARTTLS`) from the client at `origin` and says who the client is. Any byte
    /// stream will do: a TCP or Unix socket on a node, an in-memory pipe in the session fuzzer.
    pub async fn accept<S>(
        &self,
        stream: S,
        origin: &crate::origin::Origin,
    ) -> Result<(SslStream<S>, Peer), TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        if let Some(limiter) = &self.handshakes
            && !limiter.admit_origin(origin, std::time::Instant::now())
        {
            return Err(TlsError::Throttled {
                group: limiter.group_of(origin),
            });
        }
        let ssl = Ssl::new(&self.context)?;
        let mut stream = SslStream::new(ssl, stream)?;
        Pin::new(&mut stream)
            .accept()
            .await
            .map_err(TlsError::Handshake)?;
        let ssl = stream.ssl();
        tracing::debug!(
            "TLS handshake done: {} {}",
            ssl.version_str(),
            ssl.current_cipher().map_or("?", |cipher| cipher.name())
        );
        let peer = self.peer_of(ssl);
        Ok((stream, peer))
    }

    fn peer_of(&self, ssl: &SslRef) -> Peer {
        if let Some(identity) = ssl.ex_data(self.identity_index) {
            return Peer::PskIdentity(identity.clone());
        }
        // The verify callback admitted only mapped CNs; a certificate without a CN, or a
        // server that asks for none, makes an anonymous client.
        let cn = ssl.peer_certificate().and_then(|cert| common_name(&cert));
        match cn.and_then(|cn| Some((self.certificate_tenants.get(&cn)?.clone(), cn))) {
            Some((tenant, cn)) => Peer::Certificate { cn, tenant },
            None => Peer::Anonymous,
        }
    }
}

fn common_name(cert: &X509Ref) -> Option<String> {
    cert.subject_name()
        .entries_by_nid(openssl::nid::Nid::COMMONNAME)
        .next()
        .and_then(|entry| entry.data().to_string().ok())
}

/// Loads qemu's layout from `dir`; true when `ca-cert.pem` is there, so client certificates
/// are required and verified (and `ca-crl.pem`, when there, revokes some of them).
fn load_certificates(builder: &mut SslContextBuilder, dir: &Path) -> Result<bool, TlsError> {
    let credentials = |path: PathBuf| {
        move |source| TlsError::Credentials {
            path: path.clone(),
            source,
        }
    };
    let cert = dir.join("server-cert.pem");
    let key = dir.join("server-key.pem");
    let ca = dir.join("ca-cert.pem");
    builder
        .set_certificate_chain_file(&cert)
        .map_err(credentials(cert.clone()))?;
    builder
        .set_private_key_file(&key, SslFiletype::PEM)
        .map_err(credentials(key.clone()))?;
    builder.check_private_key().map_err(credentials(key))?;
    if ca.exists() {
        // qemu's default for a server with a CA: verify-peer, i.e. require a client
        // certificate signed by it.
        builder.set_ca_file(&ca).map_err(credentials(ca.clone()))?;
        let names = X509Name::load_client_ca_file(&ca).map_err(credentials(ca.clone()))?;
        builder.set_client_ca_list(names);
        builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        // qemu's layout names the revocation list `ca-crl.pem`. Read at start: a new list
        // takes effect on restart.
        let crl = dir.join("ca-crl.pem");
        if crl.exists() {
            let store = builder.cert_store_mut();
            store
                .add_lookup(X509Lookup::file())
                .and_then(|lookup| lookup.load_crl_file(&crl, SslFiletype::PEM))
                .map_err(credentials(crl.clone()))?;
            store
                .set_flags(X509VerifyFlags::CRL_CHECK)
                .map_err(credentials(crl))?;
        }
        return Ok(true);
    }
    Ok(false)
}

/// Copies the key of `identity` into `key_out`; 0 (handshake failure) for an unknown one.
fn psk_lookup(
    keys: &HashMap<Vec<u8>, Vec<u8>>,
    identity: Option<&[u8]>,
    key_out: &mut [u8],
) -> usize {
    let Some(key) = identity.and_then(|identity| keys.get(identity)) else {
        tracing::info!(
            "TLS client offered unknown PSK identity {:?}",
            identity.map(String::from_utf8_lossy)
        );
        return 0;
    };
    match key_out.get_mut(..key.len()) {
        Some(out) => {
            out.copy_from_slice(key);
            key.len()
        }
        None => 0,
    }
}

/// Reads a PSK file: `identity:hexkey` per line (qemu's `keys.psk`, GnuTLS `psktool`'s
/// format); blank lines and lines starting with `#` are skipped.
pub fn load_psk_file(path: &Path) -> Result<HashMap<Vec<u8>, Vec<u8>>, TlsError> {
    use std::os::unix::fs::PermissionsExt as _;
    let read_error = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mode = std::fs::metadata(path)
        .map_err(read_error)?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(TlsError::PskFileMode {
            path: path.to_path_buf(),
            mode: mode & 0o777,
        });
    }
    let text = std::fs::read_to_string(path).map_err(read_error)?;
    let keys = parse_psk_file(&text).map_err(|(line, reason)| TlsError::PskFile {
        path: path.to_path_buf(),
        line,
        reason,
    })?;
    if keys.is_empty() {
        return Err(TlsError::NoKeys {
            path: path.to_path_buf(),
        });
    }
    Ok(keys)
}

/// Parses the text of a PSK file; errors carry the 1-based line number.
pub fn parse_psk_file(text: &str) -> Result<HashMap<Vec<u8>, Vec<u8>>, (usize, String)> {
    let mut keys = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((identity, hex)) = line.split_once(':') else {
            return Err((number, "expected identity:hexkey".into()));
        };
        if identity.is_empty() || identity.len() > MAX_IDENTITY_BYTES {
            return Err((
                number,
                format!("identity must be 1 to {MAX_IDENTITY_BYTES} bytes"),
            ));
        }
        let key =
            decode_hex(hex).ok_or((number, "key is not an even number of hex digits".into()))?;
        if key.len() < MIN_PSK_BYTES {
            return Err((
                number,
                format!(
                    "the key of identity {identity:?} is {} bytes; at least {MIN_PSK_BYTES} \
                     random bytes are required (a shorter key falls to an offline guessing \
                     attack on one captured handshake): make one with `psktool -u {identity} \
                     -p FILE` or `openssl rand -hex 32`",
                    key.len()
                ),
            ));
        }
        if key.len() > MAX_PSK_BYTES {
            return Err((number, format!("key must be at most {MAX_PSK_BYTES} bytes")));
        }
        if keys.insert(identity.as_bytes().to_vec(), key).is_some() {
            return Err((number, format!("identity {identity:?} appears twice")));
        }
    }
    Ok(keys)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    let digits = hex.as_bytes();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    digits
        .chunks_exact(2)
        .map(|pair| {
            let high = char::from(pair[0]).to_digit(16)?;
            let low = char::from(pair[1]).to_digit(16)?;
            u8::try_from(high * 16 + low).ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_file_lines_parse() {
        let alice = "00ff10".repeat(6);
        let text = format!(
            "# comment\n\nalice:{alice}\nbob:ABCDEF0123{}\n",
            "00".repeat(11)
        );
        let keys = parse_psk_file(&text).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[b"alice".as_slice()], [0x00, 0xff, 0x10].repeat(6));
        assert_eq!(
            keys[b"bob".as_slice()],
            [vec![0xab, 0xcd, 0xef, 0x01, 0x23], vec![0; 11]].concat()
        );
    }

    #[test]
    fn bad_psk_lines_name_their_line() {
        let k = "00".repeat(MIN_PSK_BYTES);
        for (text, line) in [
            ("alice".to_string(), 1),
            (format!("ok:{k}\n:{k}"), 2),
            ("alice:0g".to_string(), 1),
            ("alice:abc".to_string(), 1),
            ("alice:".to_string(), 1),
            (format!("a:{k}\na:{k}"), 2),
        ] {
            let err = parse_psk_file(&text).unwrap_err();
            assert_eq!(err.0, line, "{text:?}: {}", err.1);
        }
        let long = format!("a:{}", "00".repeat(MAX_PSK_BYTES + 1));
        assert!(parse_psk_file(&long).is_err());
    }

    #[test]
    fn keys_shorter_than_16_bytes_are_refused_naming_the_identity() {
        let short = format!(
            "ok:{}\nbob:{}\n",
            "ab".repeat(MIN_PSK_BYTES),
            "ab".repeat(15)
        );
        let (line, reason) = parse_psk_file(&short).unwrap_err();
        assert_eq!(line, 2);
        assert!(
            reason.contains("\"bob\"") && reason.contains("15 bytes"),
            "{reason}"
        );
        assert!(parse_psk_file(&format!("bob:{}", "ab".repeat(MIN_PSK_BYTES))).is_ok());
    }

    #[test]
    fn a_psk_file_readable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.psk");
        std::fs::write(&path, format!("alice:{}\n", "ab".repeat(32))).unwrap();
        for mode in [0o644, 0o640, 0o604, 0o660] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = load_psk_file(&path).unwrap_err();
            assert!(
                matches!(err, TlsError::PskFileMode { .. })
                    && err.to_string().contains("chmod 600"),
                "{mode:o}: {err}"
            );
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load_psk_file(&path).unwrap().len(), 1);
    }

    const TEST_KEY: [u8; 32] = [0x5a; 32];

    /// An acceptor with one PSK, `alice` = `TEST_KEY`.
    fn psk_acceptor(dir: &Path, legacy_cipher_suites: bool) -> Arc<TlsAcceptor> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.join("keys.psk");
        let hex: String = TEST_KEY.iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(&path, format!("alice:{hex}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        Arc::new(
            TlsAcceptor::new(&TlsConfig {
                psk_file: Some(path),
                legacy_cipher_suites,
                ..TlsConfig::default()
            })
            .unwrap(),
        )
    }

    /// What a PSK handshake as `alice` at exactly `version`, offering only `ciphers` (TLS
    /// 1.2 suites), gives: the server's peer and the sessions the client was handed, or the
    /// server's handshake error.
    fn psk_handshake(
        acceptor: &Arc<TlsAcceptor>,
        version: SslVersion,
        ciphers: &str,
    ) -> Result<(Peer, usize), String> {
        use std::io::{Read as _, Write as _};
        use std::sync::atomic::{AtomicUsize, Ordering};

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let sessions = Arc::new(AtomicUsize::new(0));
        let client = {
            let sessions = Arc::clone(&sessions);
            let ciphers = ciphers.to_string();
            std::thread::spawn(move || {
                let mut b = openssl::ssl::SslConnector::builder(SslMethod::tls_client()).unwrap();
                b.set_min_proto_version(Some(version)).unwrap();
                b.set_max_proto_version(Some(version)).unwrap();
                b.set_verify(SslVerifyMode::NONE);
                b.set_cipher_list(&ciphers).unwrap();
                b.set_ciphersuites("TLS_AES_128_GCM_SHA256").unwrap();
                b.set_session_cache_mode(SslSessionCacheMode::CLIENT);
                b.set_new_session_callback(move |_, _| {
                    sessions.fetch_add(1, Ordering::SeqCst);
                });
                b.set_psk_client_callback(move |_, _, identity, psk| {
                    identity[..6].copy_from_slice(b"alice\0");
                    psk[..TEST_KEY.len()].copy_from_slice(&TEST_KEY);
                    Ok(TEST_KEY.len())
                });
                let connector = b.build();
                let tcp = std::net::TcpStream::connect(addr).unwrap();
                let mut config = connector.configure().unwrap();
                config.set_verify_hostname(false);
                config.set_use_server_name_indication(false);
                // A refused handshake ends here, on the client's side too.
                let Ok(mut tls) = config.connect("headroom", tcp) else {
                    return;
                };
                // TLS 1.3 tickets come after the handshake: read past them.
                let mut byte = [0u8; 1];
                if tls.read_exact(&mut byte).is_ok() {
                    let _ = tls.write_all(&byte);
                }
            })
        };
        let peer = runtime.block_on(async {
            let (tcp, _) = listener.accept().await.unwrap();
            let (mut tls, peer) = acceptor
                .accept(tcp, &crate::origin::Origin::Tcp(addr))
                .await
                .map_err(|e| e.to_string())?;
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            tls.write_all(b"x").await.unwrap();
            tls.flush().await.unwrap();
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte).await.unwrap();
            Ok::<_, String>(peer)
        });
        client.join().unwrap();
        peer.map(|peer| (peer, sessions.load(Ordering::SeqCst)))
    }

    /// A resumed TLS session would skip the PSK callback and come back without its tenant,
    /// so the server hands out no session to resume: a client that asks for tickets (TLS 1.3)
    /// and caches sessions (TLS 1.2) receives none, and every connection authenticates anew.
    #[test]
    fn the_server_offers_no_session_to_resume() {
        let dir = tempfile::tempdir().unwrap();
        let acceptor = psk_acceptor(dir.path(), false);
        for version in [SslVersion::TLS1_3, SslVersion::TLS1_2] {
            // (`session_reused` says nothing here: OpenSSL reports a TLS 1.3 external PSK
            // handshake as a reuse.)
            let (peer, sessions) =
                psk_handshake(&acceptor, version, "ECDHE-PSK-CHACHA20-POLY1305").unwrap();
            assert_eq!(peer, Peer::PskIdentity("alice".into()), "{version:?}");
            assert_eq!(
                sessions, 0,
                "{version:?}: the server handed the client a session it could resume"
            );
        }
    }

    /// Handshakes over the limit are refused before any cryptography: at 1 per second
    /// (bursts of 2) the third handshake in a row from 127.0.0.1 fails, naming the limit.
    #[test]
    fn handshakes_over_the_rate_per_address_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let limited = Arc::new(
            Arc::into_inner(psk_acceptor(dir.path(), false))
                .unwrap()
                .with_handshake_limit(HandshakeLimiter::new(1, 64)),
        );
        let fs_aead = "ECDHE-PSK-CHACHA20-POLY1305";
        for _ in 0..2 {
            assert!(psk_handshake(&limited, SslVersion::TLS1_3, fs_aead).is_ok());
        }
        let refused = psk_handshake(&limited, SslVersion::TLS1_3, fs_aead).unwrap_err();
        assert!(refused.contains("too many TLS handshakes"), "{refused}");
    }

    /// By default TLS 1.2 offers forward-secret AEAD suites only: a client that offers only
    /// plain PSK (no ephemeral key exchange: one leaked key decrypts every recorded session)
    /// or a CBC suite is refused, and accepted once `legacy_cipher_suites` allows it.
    #[test]
    fn tls_1_2_without_forward_secrecy_or_with_cbc_only_by_explicit_choice() {
        let dir = tempfile::tempdir().unwrap();
        let strict = psk_acceptor(dir.path(), false);
        let legacy = psk_acceptor(dir.path(), true);
        let alice = Peer::PskIdentity("alice".into());
        let fs_aead = "ECDHE-PSK-CHACHA20-POLY1305";
        assert_eq!(
            psk_handshake(&strict, SslVersion::TLS1_2, fs_aead).map(|r| r.0),
            Ok(alice.clone())
        );
        for weak in [
            "PSK-AES128-GCM-SHA256",
            "PSK-CHACHA20-POLY1305",
            "ECDHE-PSK-AES128-CBC-SHA256",
        ] {
            let refused = psk_handshake(&strict, SslVersion::TLS1_2, weak);
            assert!(refused.is_err(), "{weak} was accepted by default");
            assert_eq!(
                psk_handshake(&legacy, SslVersion::TLS1_2, weak).map(|r| r.0),
                Ok(alice.clone()),
                "{weak} with legacy_cipher_suites"
            );
        }
    }

    #[test]
    fn the_tenant_is_the_identity_or_none() {
        assert_eq!(
            Peer::PskIdentity("alice".into()).into_tenant().as_deref(),
            Some("alice")
        );
        assert_eq!(
            Peer::Certificate {
                cn: "host-17.example".into(),
                tenant: "tenant-a".into()
            }
            .into_tenant()
            .as_deref(),
            Some("tenant-a")
        );
        assert_eq!(Peer::Anonymous.into_tenant(), None);
    }

    #[test]
    fn lookup_copies_only_known_keys() {
        let keys = parse_psk_file(&format!("alice:0102{}", "00".repeat(14))).unwrap();
        let mut out = [0u8; 32];
        assert_eq!(psk_lookup(&keys, Some(b"alice"), &mut out), 16);
        assert_eq!(out[..3], [1, 2, 0]);
        assert_eq!(psk_lookup(&keys, Some(b"mallory"), &mut out), 0);
        assert_eq!(psk_lookup(&keys, None, &mut out), 0);
        assert_eq!(psk_lookup(&keys, Some(b"alice"), &mut [0u8; 15]), 0);
    }
}
