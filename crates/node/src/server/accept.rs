//! The NBD accept loop: takes connections off the listener, admits them under the
//! connection limits (logging refusals and evictions at a bounded rate), backs off when
//! `accept` itself fails, and runs each admitted connection as a session, on a connection
//! thread when there are some.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::NodeError;
use crate::admission::{Admitted, Connections};
use crate::session::{SessionContext, SessionError, serve_connection};

/// Starts the connection threads (`net_threads`; 0: connections share the runtime) and the
/// accept loop; returns the loop's task and what the API reads of the threads.
pub(super) fn spawn(
    listener: TcpListener,
    ctx: Arc<SessionContext>,
    connections: Arc<Connections>,
    stop: watch::Receiver<bool>,
    net_threads: usize,
) -> Result<(JoinHandle<()>, crate::net_threads::OpenConnections), NodeError> {
    let net_threads = match net_threads {
        0 => None,
        n => Some(crate::net_threads::NetThreads::start(n).map_err(NodeError::Workers)?),
    };
    let connection_threads = net_threads
        .as_ref()
        .map(crate::net_threads::NetThreads::open_connections)
        .unwrap_or_default();
    match &net_threads {
        Some(t) => tracing::info!(
            "connection threads: {} (each connection stays on one)",
            t.len()
        ),
        None => tracing::info!("connection threads: none (connections share the runtime)"),
    }
    let task = tokio::spawn(accept_loop(listener, ctx, connections, stop, net_threads));
    Ok((task, connection_threads))
}

async fn accept_loop(
    listener: TcpListener,
    ctx: Arc<SessionContext>,
    connections: Arc<Connections>,
    mut stop: watch::Receiver<bool>,
    // Dropped when the loop ends: the threads then close their connections and end.
    net_threads: Option<crate::net_threads::NetThreads>,
) {
    let mut backoff = AcceptBackoff::default();
    let mut refusals = Sampled::default();
    let mut evictions = Sampled::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => {
                backoff.succeeded();
                pair
            }
            Err(err) => {
                connections.note_accept_error();
                // EMFILE and friends: keep serving the connections we have, and try again
                // later instead of spinning on a listener that stays readable.
                if let Some(delay) = backoff.failed(&err) {
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = stop.changed() => break,
                    }
                }
                continue;
            }
        };
        let admitted = match connections.admit(peer) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                if let Some(more) = refusals.sample() {
                    tracing::warn!("refusing {peer}: {refusal} ({more} more refused before)");
                }
                drop(stream);
                continue;
            }
        };
        if let Some(evicted) = &admitted.evicted
            && let Some(more) = evictions.sample()
        {
            tracing::info!(
                "closed {evicted}, still negotiating, to make room for {peer} ({more} more evicted before)"
            );
        }
        let ctx = Arc::clone(&ctx);
        let Some(threads) = &net_threads else {
            tokio::spawn(run_session(stream, peer, ctx, admitted));
            continue;
        };
        // The socket moves to the chosen thread's reactor: deregistered here, registered there.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(err) => {
                tracing::info!("session with {peer} ended: {err}");
                continue;
            }
        };
        let placed = threads.spawn(move || async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => run_session(stream, peer, ctx, admitted).await,
                Err(err) => tracing::info!("session with {peer} ended: {err}"),
            }
        });
        if placed.is_none() {
            tracing::error!("no connection thread took {peer}: closed");
        }
    }
}

/// One connection from admission to close, on whichever thread runs it.
async fn run_session(
    stream: TcpStream,
    peer: SocketAddr,
    ctx: Arc<SessionContext>,
    admitted: Admitted,
) {
    let shared = Arc::clone(admitted.shared());
    if let Err(err) = stream.set_nodelay(true) {
        tracing::info!("session with {peer} ended: {}", SessionError::from(err));
        return;
    }
    let served = tokio::select! {
        served = serve_connection(stream, ctx, &admitted) => served,
        () = shared.evicted() => Err(SessionError::Evicted),
    };
    match served {
        Ok(()) => {}
        Err(SessionError::Evicted) => {
            tracing::debug!("session with {peer} ended: {}", SessionError::Evicted);
        }
        Err(err) => tracing::info!("session with {peer} ended: {err}"),
    }
    drop(admitted);
}

/// Delays between failed `accept` calls: none for errors of one connection (it was reset or
/// aborted before we took it), otherwise 10 ms doubling to 1 s until one succeeds. Logs once
/// when a run of failures starts and once when it ends.
#[derive(Debug, Default)]
struct AcceptBackoff {
    failures: u64,
    delay: Option<Duration>,
    since: Option<Instant>,
}

const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

impl AcceptBackoff {
    fn failed(&mut self, err: &std::io::Error) -> Option<Duration> {
        use std::io::ErrorKind;
        if matches!(
            err.kind(),
            ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::Interrupted
        ) {
            tracing::debug!("accept failed: {err}");
            return None;
        }
        self.failures += 1;
        let delay = match self.delay {
            None => {
                tracing::warn!(
                    "accept failed: {err}; retrying after 10 ms, doubling up to 1 s, until it \
                     works (open connections are served meanwhile)"
                );
                self.since = Some(Instant::now());
                ACCEPT_BACKOFF_FIRST
            }
            Some(delay) => (delay * 2).min(ACCEPT_BACKOFF_MAX),
        };
        self.delay = Some(delay);
        Some(delay)
    }

    fn succeeded(&mut self) {
        if self.failures > 0 {
            let ms = self.since.map_or(0, |t| t.elapsed().as_millis());
            tracing::warn!(
                "accept works again after {} failed attempts in {ms} ms",
                self.failures
            );
        }
        *self = AcceptBackoff::default();
    }
}

/// Logs the first of a run of events and then at most one per second, with the count of those
/// not logged, so a flood of connections cannot flood the log.
#[derive(Debug, Default)]
struct Sampled {
    last: Option<Instant>,
    unlogged: u64,
}

impl Sampled {
    /// `Some(events not logged since the last one logged)` when this one should be logged.
    fn sample(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last {
            Some(last) if now.duration_since(last) < Duration::from_secs(1) => {
                self.unlogged += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }
}
