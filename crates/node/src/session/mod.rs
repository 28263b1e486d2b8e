//! One NBD connection, from the greeting to the last reply.
//!
//! Negotiation shows a session only the volumes of its tenant: the identity its TLS handshake
//! proved, or the tenant its local uid is mapped to on the Unix socket (`Admitted::
//! local_tenant`), or none (plaintext, anonymous TLS, an unmapped uid), which sees only
//! volumes without a tenant. Any other volume is answered exactly as a name no volume has
//! (`Haggling::visible_export`). A TLS identity and a mapped uid that disagree end the
//! session: two proofs of who the client is that name two tenants are a misconfiguration, and
//! neither may silently win.
//!
//! Negotiation runs on the whole socket under a deadline, and may be cut short by eviction
//! (`node::admission`) until the reply that enters transmission. Transmission splits it: this
//! task reads and validates requests (and write payloads) and hands each one to the pipeline
//! (`node::pipeline`: permits and budget, splitting, scheduling, execution), and a writer task
//! encodes the pipeline's replies in completion order, batching whatever is ready into one
//! write. Every request holds its permits until its reply is on the wire (the pipeline's
//! `Intake` says which). A client that pipelines without reading replies fills its own
//! connection's budget, then its tenant's, never more: its reader stops pulling from the socket
//! and TCP pushes back, and the tenant's other connections go on with their reserves. A client
//! that takes no byte of a reply, or sends no byte of a WRITE payload, for
//! `client_stall_timeout_ms` is disconnected, which gives its bytes back.
//!
//! This is the NBD transport: only what is NBD's is here, one stage per file (the connection,
//! its TLS and the context it runs in are in this file):
//! - `negotiate`: option haggling, until the client enters transmission, starts TLS or leaves;
//! - `transmit`: the reader, which decodes and validates each request and hands it on;
//! - `reply`: the writer, which encodes replies as they complete, batching what is ready.

use std::sync::Arc;
use std::time::Duration;

use headroom_nbd as nbd;
use headroom_store::{Store, Volume};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use crate::admission::Admitted;
use crate::budget::BudgetError;
use crate::pipeline::Pipeline;
use negotiate::Haggling;
use negotiate::Outcome;
use negotiate::negotiate;
use transmit::transmit;

/// The one metadata context we serve.
pub(super) const ALLOCATION_CONTEXT_ID: u32 = nbd::BASE_ALLOCATION_CONTEXT_ID;
pub(super) const ALLOCATION_CONTEXT_NAME: &str = nbd::BASE_ALLOCATION;
/// A batch of replies is written once it holds this many bytes (headers and payloads)...
pub(super) const BATCH_BYTES_MAX: usize = 192 << 10;
/// ...or this many replies (each takes at most two of the kernel's 1,024 iovecs).
pub(super) const BATCH_REPLIES_MAX: usize = 256;

/// What a session needs from the node.
#[derive(Debug)]
pub struct SessionContext {
    pub store: Arc<Store>,
    /// The request path below the transport: limits, I/O, scheduler, budget, statistics.
    pub pipeline: Arc<Pipeline>,
    /// TLS credentials; `None`: NOTLS mode (STARTTLS is answered `NBD_REP_ERR_UNSUP`).
    pub tls: Option<Arc<Tls>>,
    /// FORCEDTLS: refuse every option but STARTTLS and ABORT until TLS is up.
    pub tls_required: bool,
}

/// What upgrades a session to TLS.
#[cfg(feature = "tls")]
pub type Tls = crate::tls::TlsAcceptor;

/// What upgrades a session to TLS: nothing in a build without the `tls` feature (the type has
/// no values, so `SessionContext::tls` is always `None` there).
#[cfg(not(feature = "tls"))]
#[derive(Debug)]
pub enum Tls {}

/// Why a session ended early. None of these affect other sessions.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    #[error("handshake: {0}")]
    Handshake(#[from] nbd::HandshakeError),
    #[error("client did not finish negotiation in time")]
    HandshakeTimeout,
    #[error("client asked for unknown export {0:?} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("option of {0} bytes is too large")]
    OptionTooLarge(u32),
    #[error("transmission: {0}")]
    Transmission(#[from] nbd::TransmissionError),
    #[error(
        "client asked for export {0:?} with NBD_OPT_EXPORT_NAME before starting the TLS this server requires"
    )]
    TlsRequired(String),
    #[error("{0}")]
    TlsHandshake(String),
    #[error(
        "the TLS identity acts for tenant {tls:?} but the local uid is mapped to tenant {local:?} \
         ([server] nbd_unix_tenants): refused"
    )]
    TenantConflict { tls: String, local: String },
    #[error("evicted while negotiating, to make room for a new connection")]
    Evicted,
    #[error("client stopped reading replies: it took no byte for {0} ms")]
    RepliesStalled(u64),
    #[error("client stopped sending a WRITE payload: no byte came for {0} ms")]
    PayloadStalled(u64),
    #[error("byte budget: {0}")]
    Budget(#[from] BudgetError),
}

/// The outcome of negotiation when the client moves to transmission.
pub(super) struct Negotiated {
    volume: Arc<Volume>,
    structured: bool,
    allocation_context: bool,
}

/// What a session runs on: any byte stream (a TCP socket on a node; an in-memory pipe in the
/// session fuzzer, `fuzz/src/session.rs`).
pub trait SessionStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> SessionStream for S {}

/// Serves one accepted connection to the end. Socket options (`TCP_NODELAY`) are the
/// caller's.
pub async fn serve_connection<S: SessionStream>(
    mut stream: S,
    ctx: Arc<SessionContext>,
    conn: &Admitted,
) -> Result<(), SessionError> {
    // One deadline for the whole negotiation, TLS handshake included.
    let deadline = tokio::time::Instant::now()
        + Duration::from_millis(ctx.pipeline.limits.handshake_timeout_ms);
    let mut state = match tokio::time::timeout_at(deadline, greet(&mut stream)).await {
        Ok(Ok(flags)) => {
            let mut state = Haggling::new(flags);
            state.tenant = conn.local_tenant().map(str::to_owned);
            state
        }
        Ok(Err(err)) => return Err(err),
        Err(_) => return Err(SessionError::HandshakeTimeout),
    };
    let outcome =
        match tokio::time::timeout_at(deadline, negotiate(&mut stream, &ctx, &mut state, conn))
            .await
        {
            Ok(outcome) => outcome?,
            Err(_) => return Err(SessionError::HandshakeTimeout),
        };
    match outcome {
        Outcome::End => Ok(()),
        Outcome::Transmit(negotiated) => transmit_on(stream, ctx, negotiated, conn).await,
        Outcome::StartTls(tls) => {
            let (upgraded, tenant) =
                match tokio::time::timeout_at(deadline, start_tls(&tls, stream, conn)).await {
                    Ok(upgraded) => upgraded?,
                    Err(_) => return Err(SessionError::HandshakeTimeout),
                };
            serve_tls(upgraded, tenant, ctx, state, deadline, conn).await
        }
    }
}

/// Transmission on the whole stream: a TCP or Unix socket splits into its owned halves (no
/// lock between the reader and the writer task), any other stream through `tokio::io::split`.
async fn transmit_on<S: SessionStream>(
    stream: S,
    ctx: Arc<SessionContext>,
    negotiated: Negotiated,
    conn: &Admitted,
) -> Result<(), SessionError> {
    let stream: Box<dyn std::any::Any + Send> = Box::new(stream);
    let stream = match stream.downcast::<TcpStream>() {
        Ok(tcp) => {
            let (reader, writer) = tcp.into_split();
            return transmit(reader, writer, ctx, negotiated, conn).await;
        }
        Err(other) => other,
    };
    match stream.downcast::<UnixStream>() {
        Ok(unix) => {
            let (reader, writer) = unix.into_split();
            transmit(reader, writer, ctx, negotiated, conn).await
        }
        Err(other) => {
            let Ok(stream) = other.downcast::<S>() else {
                unreachable!("the stream is an S")
            };
            let (reader, writer) = tokio::io::split(*stream);
            transmit(reader, writer, ctx, negotiated, conn).await
        }
    }
}

/// Sends the greeting and reads the client flags.
async fn greet<S: SessionStream>(stream: &mut S) -> Result<nbd::ClientFlags, SessionError> {
    let mut out = Vec::with_capacity(32);
    nbd::encode_server_greeting(&mut out);
    stream.write_all(&out).await?;
    let mut flags_buf = [0u8; 4];
    stream.read_exact(&mut flags_buf).await?;
    Ok(nbd::decode_client_flags(u32::from_be_bytes(flags_buf))?)
}

#[cfg(feature = "tls")]
type TlsStream<S> = tokio_openssl::SslStream<S>;
#[cfg(not(feature = "tls"))]
type TlsStream<S> = S;

/// The TLS handshake that follows our `NBD_REP_ACK` to `NBD_OPT_STARTTLS`; returns the
/// stream and the client's tenant (its PSK identity or certificate CN, `None` if anonymous).
/// A mapped local uid's tenant holds when TLS proves no identity; one that proves another
/// tenant is refused ([`SessionError::TenantConflict`]).
#[cfg(feature = "tls")]
async fn start_tls<S: SessionStream>(
    tls: &Tls,
    stream: S,
    conn: &Admitted,
) -> Result<(TlsStream<S>, Option<String>), SessionError> {
    let (stream, peer) = tls
        .accept(stream, conn.peer())
        .await
        .map_err(|err| SessionError::TlsHandshake(err.to_string()))?;
    tracing::debug!("TLS session up, peer {peer:?}");
    let tenant = combined_tenant(peer.into_tenant(), conn.local_tenant())?;
    Ok((stream, tenant))
}

/// The session's tenant from its TLS identity and its mapped local uid (see
/// [`start_tls`]).
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
fn combined_tenant(
    tls: Option<String>,
    local: Option<&str>,
) -> Result<Option<String>, SessionError> {
    match (tls, local) {
        (Some(tls), Some(local)) if tls != local => Err(SessionError::TenantConflict {
            tls,
            local: local.to_owned(),
        }),
        (Some(tls), _) => Ok(Some(tls)),
        (None, local) => Ok(local.map(str::to_owned)),
    }
}

#[cfg(not(feature = "tls"))]
async fn start_tls<S: SessionStream>(
    tls: &Tls,
    _stream: S,
    _conn: &Admitted,
) -> Result<(TlsStream<S>, Option<String>), SessionError> {
    match *tls {}
}

/// Negotiation (again, from scratch but for the client flags) and transmission over TLS, for
/// `tenant`.
async fn serve_tls<S: SessionStream>(
    mut stream: TlsStream<S>,
    tenant: Option<String>,
    ctx: Arc<SessionContext>,
    plaintext: Haggling,
    deadline: tokio::time::Instant,
    conn: &Admitted,
) -> Result<(), SessionError> {
    // Nothing settled in plaintext survives the upgrade: a man in the middle could have
    // chosen it.
    let mut state = Haggling::new(plaintext.client_flags);
    state.tls_active = true;
    state.tenant = tenant;
    let outcome =
        match tokio::time::timeout_at(deadline, negotiate(&mut stream, &ctx, &mut state, conn))
            .await
        {
            Ok(outcome) => outcome?,
            Err(_) => return Err(SessionError::HandshakeTimeout),
        };
    match outcome {
        Outcome::Transmit(negotiated) => {
            let (reader, writer) = tokio::io::split(stream);
            transmit(reader, writer, ctx, negotiated, conn).await
        }
        // ABORT or EOF: close TLS politely (the client may already be gone).
        Outcome::End => {
            let _ = stream.shutdown().await;
            Ok(())
        }
        // `answer` refuses a second STARTTLS.
        Outcome::StartTls(_) => Ok(()),
    }
}

mod negotiate;
mod reply;
mod transmit;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_tls_identity_and_a_mapped_uid_must_agree() {
        let alice = || Some("alice".to_owned());
        assert_eq!(combined_tenant(None, None).unwrap(), None);
        assert_eq!(combined_tenant(alice(), None).unwrap(), alice());
        assert_eq!(combined_tenant(None, Some("alice")).unwrap(), alice());
        assert_eq!(combined_tenant(alice(), Some("alice")).unwrap(), alice());
        assert!(matches!(
            combined_tenant(alice(), Some("bob")),
            Err(SessionError::TenantConflict { .. })
        ));
    }
}
