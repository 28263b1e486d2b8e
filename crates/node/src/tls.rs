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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use openssl::ex_data::Index;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslOptions, SslRef,
    SslSessionCacheMode, SslVerifyMode, SslVersion,
};
use openssl::x509::X509Name;
use tokio::net::TcpStream;
use tokio_openssl::SslStream;

use crate::config::TlsConfig;

/// TLS 1.2 cipher suites: forward-secret AEAD suites for certificates, and the PSK suites
/// GnuTLS clients offer (qemu and libnbd add `+ECDHE-PSK:+DHE-PSK:+PSK` to their priority).
/// TLS 1.3 uses OpenSSL's default suites, which cover PSK too.
const TLS12_CIPHERS: &str = "ECDHE+AESGCM:ECDHE+CHACHA20:ECDHE-PSK-CHACHA20-POLY1305:\
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
    #[error("setting up TLS: {0}")]
    Setup(#[from] openssl::error::ErrorStack),
    #[error("TLS handshake: {0}")]
    Handshake(openssl::ssl::Error),
}

/// Who the client proved to be in the TLS handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// The PSK identity the client used.
    PskIdentity(String),
    /// The common name of the client certificate (verified against `ca-cert.pem`).
    CertificateCn(String),
    /// Neither (a server certificate without client verification).
    Anonymous,
}

impl Peer {
    /// The tenant this client acts for: its PSK identity or certificate CN as it is (an
    /// identity no tenant id can equal, say one with a control character, sees no volume),
    /// `None` for an anonymous client.
    pub fn into_tenant(self) -> Option<String> {
        match self {
            Peer::PskIdentity(identity) | Peer::CertificateCn(identity) => Some(identity),
            Peer::Anonymous => None,
        }
    }
}

/// Accepts TLS on sessions that asked for it with `NBD_OPT_STARTTLS`.
pub struct TlsAcceptor {
    context: SslContext,
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
        builder.set_cipher_list(TLS12_CIPHERS)?;
        if let Some(dir) = &config.cert_dir {
            load_certificates(&mut builder, dir)?;
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
            identity_index,
        })
    }

    /// Runs the server side of the handshake on `stream` (right after the `NBD_REP_ACK` to
    /// `NBD_OPT_STARTTLS`) and says who the client is.
    pub async fn accept(
        &self,
        stream: TcpStream,
    ) -> Result<(SslStream<TcpStream>, Peer), TlsError> {
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
        certificate_peer(ssl)
    }
}

fn certificate_peer(ssl: &SslRef) -> Peer {
    let cn = ssl.peer_certificate().and_then(|cert| {
        cert.subject_name()
            .entries_by_nid(openssl::nid::Nid::COMMONNAME)
            .next()
            .and_then(|entry| entry.data().to_string().ok())
    });
    cn.map_or(Peer::Anonymous, Peer::CertificateCn)
}

fn load_certificates(builder: &mut SslContextBuilder, dir: &Path) -> Result<(), TlsError> {
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
    }
    Ok(())
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

    /// A resumed TLS session would skip the PSK callback and come back without its tenant,
    /// so the server hands out no session to resume: a client that asks for tickets (TLS 1.3)
    /// and caches sessions (TLS 1.2) receives none, and every connection authenticates anew.
    #[test]
    fn the_server_offers_no_session_to_resume() {
        use std::io::{Read as _, Write as _};
        use std::os::unix::fs::PermissionsExt as _;
        use std::sync::atomic::{AtomicUsize, Ordering};

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.psk");
        let key = [0x5au8; 32];
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(&path, format!("alice:{hex}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let acceptor = Arc::new(
            TlsAcceptor::new(&TlsConfig {
                psk_file: Some(path),
                ..TlsConfig::default()
            })
            .unwrap(),
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for version in [SslVersion::TLS1_3, SslVersion::TLS1_2] {
            let listener = runtime
                .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
                .unwrap();
            let addr = listener.local_addr().unwrap();
            let sessions = Arc::new(AtomicUsize::new(0));
            let client = {
                let sessions = Arc::clone(&sessions);
                std::thread::spawn(move || {
                    let mut b =
                        openssl::ssl::SslConnector::builder(SslMethod::tls_client()).unwrap();
                    b.set_min_proto_version(Some(version)).unwrap();
                    b.set_max_proto_version(Some(version)).unwrap();
                    b.set_verify(SslVerifyMode::NONE);
                    b.set_cipher_list("ECDHE-PSK-CHACHA20-POLY1305:PSK-AES128-GCM-SHA256")
                        .unwrap();
                    b.set_ciphersuites("TLS_AES_128_GCM_SHA256").unwrap();
                    b.set_session_cache_mode(SslSessionCacheMode::CLIENT);
                    b.set_new_session_callback(move |_, _| {
                        sessions.fetch_add(1, Ordering::SeqCst);
                    });
                    b.set_psk_client_callback(move |_, _, identity, psk| {
                        identity[..6].copy_from_slice(b"alice\0");
                        psk[..key.len()].copy_from_slice(&key);
                        Ok(key.len())
                    });
                    let connector = b.build();
                    let tcp = std::net::TcpStream::connect(addr).unwrap();
                    let mut config = connector.configure().unwrap();
                    config.set_verify_hostname(false);
                    config.set_use_server_name_indication(false);
                    let mut tls = config.connect("headroom", tcp).unwrap();
                    // TLS 1.3 tickets come after the handshake: read past them.
                    let mut byte = [0u8; 1];
                    tls.read_exact(&mut byte).unwrap();
                    tls.write_all(&byte).unwrap();
                })
            };
            let peer = runtime.block_on(async {
                let (tcp, _) = listener.accept().await.unwrap();
                let (mut tls, peer) = acceptor.accept(tcp).await.unwrap();
                use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
                tls.write_all(b"x").await.unwrap();
                tls.flush().await.unwrap();
                let mut byte = [0u8; 1];
                tls.read_exact(&mut byte).await.unwrap();
                peer
            });
            // (`session_reused` says nothing here: OpenSSL reports a TLS 1.3 external PSK
            // handshake as a reuse.)
            client.join().unwrap();
            assert_eq!(peer, Peer::PskIdentity("alice".into()), "{version:?}");
            assert_eq!(
                sessions.load(Ordering::SeqCst),
                0,
                "{version:?}: the server handed the client a session it could resume"
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
            Peer::CertificateCn("tenant-a".into())
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
