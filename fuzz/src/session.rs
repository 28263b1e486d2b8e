//! What the `session` fuzz target checks: the node's real NBD session
//! (`headroom_node::session::serve_connection`) over an in-memory stream, with tenants and TLS.
//!
//! Why a file of its own: the fuzz target (through the `headroom_fuzz` library) and the corpus
//! replay test `crates/node/tests/fuzz_session_corpus.rs` (through `#[path]`) include this same
//! file, so CI checks every committed input exactly as the fuzzer did. It uses only the public
//! APIs of `headroom_node`, `headroom_store`, `headroom_qos` and `headroom_nbd`.
//!
//! One node per process ([`Harness`]): a memory store with two tenants (`alice`, `bob`) and
//! volumes of each and of no tenant (some with QoS, one read-only), the real QoS scheduler,
//! executor and buffer pool, and a TLS acceptor with one PSK per tenant. Each input is one
//! connection on a `tokio::io::duplex` pipe:
//!
//! - byte 0, the mode: `% 8` = 1 or 2 (TLS builds): the harness is an OpenSSL PSK client as
//!   `alice` (1) or `bob` (2): it reads the greeting, sends the client flags and
//!   `NBD_OPT_STARTTLS`, does the handshake, and the rest of the input goes inside TLS
//!   (option haggling starts afresh there). Otherwise plaintext: the rest of the input is the
//!   whole client stream, client flags first. In a build without TLS the TLS modes are skipped.
//! - byte 1: how the client writes: 0 in one write, `n` in writes of `n` bytes with a yield
//!   between them (so the server's reads end at other boundaries), at most 64 writes.
//! - the rest: the client's bytes, after which the harness closes its side.
//!
//! Checks: nothing panics; the session ends within [`SESSION_DEADLINE`] (a hang is a finding);
//! every server byte parses as the protocol says, given the client's bytes (the greeting;
//! option replies that name the option being answered and end with one final reply;
//! export-name replies; simple or, when negotiated, structured replies only for cookies the
//! client sent, READ replies that carry exactly the requested length, block status only with
//! the negotiated context); and the tenant wall: `NBD_OPT_LIST` lists exactly the volumes of
//! the session's tenant (none for plaintext: the volumes without a tenant), and INFO, GO,
//! EXPORT_NAME and the meta-context options succeed exactly for those names.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use headroom_nbd::consts::{
    NBD_CMD_BLOCK_STATUS, NBD_CMD_DISC, NBD_CMD_FLAG_REQ_ONE, NBD_CMD_READ, NBD_CMD_WRITE,
    NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES, NBD_FLAG_READ_ONLY, NBD_INFO_EXPORT,
    NBD_INFO_NAME, NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_SET_META_CONTEXT, NBD_REP_ACK,
    NBD_REP_ERR_UNKNOWN, NBD_REP_INFO, NBD_REP_META_CONTEXT, NBD_REP_SERVER,
    NBD_REPLY_TYPE_BLOCK_STATUS, NBD_REPLY_TYPE_ERROR, NBD_REPLY_TYPE_ERROR_OFFSET,
    NBD_REPLY_TYPE_NONE, NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_TYPE_OFFSET_HOLE, OPTION_HEADER_LEN,
    OPTION_REPLY_HEADER_LEN, SIMPLE_REPLY_HEADER_LEN, SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_HEADER_LEN, STRUCTURED_REPLY_MAGIC,
};
use headroom_nbd::{
    BASE_ALLOCATION, BASE_ALLOCATION_CONTEXT_ID, ClientOption, Command, InfoRequest,
    MetaContextRequest, OptionDataAction, REQUEST_HEADER_LEN, RequestHeader, decode_client_flags,
    decode_option, decode_option_header, decode_option_reply_header, decode_request_header,
    decode_simple_reply_header, decode_structured_chunk_header, encode_client_option,
    encode_option_header, encode_request_header, encode_server_greeting, option_data_action,
};
use headroom_node::admission::Connections;
use headroom_node::pipeline::{IoRunner, IoRuntime, Pipeline, ReadRouter};
use headroom_node::session::SessionContext;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A session that has not ended this long after the client closed its side hangs.
pub const SESSION_DEADLINE: Duration = Duration::from_secs(20);

/// The most writes the client's bytes are split into (byte 1 of the input).
const MAX_WRITES: usize = 64;

/// The tenants, each with a PSK (its identity is the tenant's name).
pub const TENANTS: [&str; 2] = ["alice", "bob"];

/// One volume the harness created.
#[derive(Clone, Debug)]
pub struct FuzzVolume {
    pub name: &'static str,
    pub tenant: Option<&'static str>,
    pub size_bytes: u64,
    pub read_only: bool,
    /// QoS (generous: a fuzz input must never wait long for its turn).
    pub qos: bool,
}

/// The volumes: small (reads stay cheap), two tenants and none.
pub const VOLUMES: [FuzzVolume; 5] = [
    FuzzVolume {
        name: "public",
        tenant: None,
        size_bytes: 1 << 20,
        read_only: false,
        qos: true,
    },
    FuzzVolume {
        name: "alice-a",
        tenant: Some("alice"),
        size_bytes: 1 << 20,
        read_only: false,
        qos: true,
    },
    FuzzVolume {
        name: "alice-ro",
        tenant: Some("alice"),
        size_bytes: 256 << 10,
        read_only: true,
        qos: false,
    },
    FuzzVolume {
        name: "bob-a",
        tenant: Some("bob"),
        size_bytes: 512 << 10,
        read_only: false,
        qos: true,
    },
    FuzzVolume {
        name: "bob-b",
        tenant: Some("bob"),
        size_bytes: 64 << 10,
        read_only: false,
        qos: false,
    },
];

#[cfg(feature = "tls")]
/// The PSK of `tenant` (32 bytes derived from its name; only ever used in process).
fn psk_of(tenant: &str) -> [u8; 32] {
    let mut key = [0u8; 32];
    for (i, byte) in key.iter_mut().enumerate() {
        *byte = tenant.as_bytes()[i % tenant.len()] ^ (i as u8).wrapping_mul(37);
    }
    key
}

/// The node every input talks to, built once per process.
pub struct Harness {
    runtime: tokio::runtime::Runtime,
    ctx: Arc<SessionContext>,
    connections: Arc<Connections>,
}

/// The process's harness.
pub fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(Harness::new)
}

impl Harness {
    fn new() -> Harness {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let _entered = runtime.enter();
        let limits = headroom_node::Limits::default();
        let store = Arc::new(headroom_store::Store::open_memory(64 << 20).expect("memory store"));
        for tenant in TENANTS {
            store.create_tenant(tenant).expect("tenant");
        }
        let clock = headroom_node::clock::Clock::new();
        let io = Arc::new(IoRuntime {
            lanes: Some(headroom_node::exec::Lanes::start(1).expect("executor lanes")),
            inline_max_bytes: 64 << 10,
            buffers: Arc::new(headroom_node::buffers::BufferPool::new(
                limits.max_request_bytes as usize,
            )),
            emulation: headroom_node::pipeline::Emulation::Off,
            clock,
            runtime: runtime.handle().clone(),
            reads: ReadRouter::new(headroom_qos::routing::ReadRouting::Primary),
            work: Default::default(),
        });
        let runner = Arc::new(IoRunner(Arc::clone(&io)));
        let scheduler = headroom_node::scheduler::Scheduler::start(
            &headroom_node::config::QosConfig::default(),
            clock,
            runner,
            None,
        )
        .expect("scheduler");
        for volume in &VOLUMES {
            let stored = volume.qos.then(|| {
                let spec = headroom_qos::QosSpec {
                    baseline_iops: Some(200_000),
                    baseline_mbps: Some(20_000),
                    weight: Some(100),
                    ..headroom_qos::QosSpec::default()
                };
                headroom_node::volume_qos::StoredQos::resolve(spec, volume.size_bytes).expect("QoS")
            });
            let options = headroom_store::NewVolume {
                qos: stored
                    .as_ref()
                    .map(headroom_node::volume_qos::StoredQos::to_json),
                tenant: volume.tenant.map(str::to_string),
                read_only: volume.read_only,
                replicas: 1,
            };
            let info = store
                .create_volume_with(volume.name, volume.size_bytes, options)
                .expect("volume");
            let qos = stored.map_or_else(headroom_qos::VolumeQos::default, |s| s.qos);
            scheduler.add_volume(info.id, &qos);
        }
        let budget = headroom_node::budget::Budget::with_reserve(
            limits.max_inflight_bytes_per_tenant,
            limits.max_inflight_bytes_per_node,
            limits.reserved_inflight_bytes_per_conn(),
            limits.max_connections,
        );
        let metrics = headroom_node::metrics::MetricsRegistry::new(
            headroom_node::metrics::MetricsConfig::default(),
            clock,
        );
        metrics.attach_scheduler(&scheduler);
        let connections = Connections::new(limits.max_connections, limits.max_connections);
        let ctx = Arc::new(SessionContext {
            store,
            pipeline: Arc::new(Pipeline {
                limits,
                io,
                scheduler: Some(scheduler),
                budget,
                metrics,
            }),
            tls: tls_acceptor(),
            tls_required: false,
        });
        drop(_entered);
        Harness {
            runtime,
            ctx,
            connections,
        }
    }
}

#[cfg(feature = "tls")]
fn tls_acceptor() -> Option<Arc<headroom_node::session::Tls>> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("headroom-fuzz-session-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("PSK directory");
    let path = dir.join("keys.psk");
    let lines: String = TENANTS
        .iter()
        .map(|tenant| {
            let hex: String = psk_of(tenant).iter().map(|b| format!("{b:02x}")).collect();
            format!("{tenant}:{hex}\n")
        })
        .collect();
    std::fs::write(&path, lines).expect("PSK file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let acceptor = headroom_node::tls::TlsAcceptor::new(&headroom_node::TlsConfig {
        psk_file: Some(path),
        ..headroom_node::TlsConfig::default()
    });
    // The keys are in memory now.
    let _ = std::fs::remove_dir_all(&dir);
    Some(Arc::new(acceptor.expect("TLS acceptor")))
}

#[cfg(not(feature = "tls"))]
fn tls_acceptor() -> Option<Arc<headroom_node::session::Tls>> {
    None
}

/// How the harness talks to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Plaintext,
    /// PSK TLS as this tenant.
    Tls(&'static str),
}

/// Runs one input: see the module comment for the layout and the checks.
pub fn check_session(data: &[u8]) {
    let [mode_byte, chunk_byte, client @ ..] = data else {
        return;
    };
    let mode = match mode_byte % 8 {
        1 => Mode::Tls(TENANTS[0]),
        2 => Mode::Tls(TENANTS[1]),
        _ => Mode::Plaintext,
    };
    if matches!(mode, Mode::Tls(_)) && !cfg!(feature = "tls") {
        return;
    }
    let chunk_bytes = usize::from(*chunk_byte);
    let h = harness();
    let server_bytes = h.runtime.block_on(async {
        match tokio::time::timeout(SESSION_DEADLINE, converse(h, mode, chunk_bytes, client)).await {
            Ok(bytes) => bytes,
            Err(_) => panic!("the session did not end within {SESSION_DEADLINE:?}: a hang"),
        }
    });
    let tenant = match mode {
        Mode::Plaintext => None,
        Mode::Tls(tenant) => Some(tenant),
    };
    Oracle::new(&h.ctx, tenant).check(mode, client, &server_bytes);
}

/// One connection: returns every byte the server sent after the harness's own prefix (in TLS
/// mode: the plaintext inside TLS).
async fn converse(h: &Harness, mode: Mode, chunk_bytes: usize, client: &[u8]) -> Vec<u8> {
    let (ours, theirs) = tokio::io::duplex(64 << 10);
    let peer: SocketAddr = ([127, 0, 0, 1], 10809).into();
    let admitted = h.connections.admit(peer).expect("admitted");
    let ctx = Arc::clone(&h.ctx);
    let server = tokio::spawn(async move {
        // Errors are the client's garbage answered: only panics and hangs are findings.
        let _ = headroom_node::session::serve_connection(theirs, ctx, &admitted).await;
    });
    let received = match mode {
        Mode::Plaintext => exchange(ours, chunk_bytes, client).await,
        Mode::Tls(tenant) => tls_exchange(ours, tenant, chunk_bytes, client).await,
    };
    if let Err(err) = server.await {
        std::panic::resume_unwind(err.into_panic());
    }
    received
}

/// Writes `client` (then closes) while reading everything the server sends until it closes.
async fn exchange<S: AsyncRead + AsyncWrite + Send + 'static>(
    stream: S,
    chunk_bytes: usize,
    client: &[u8],
) -> Vec<u8> {
    let (mut reader, mut writer) = tokio::io::split(stream);
    let reading = tokio::spawn(async move {
        let mut received = Vec::new();
        // A reset or a TLS error ends the stream as well as EOF does.
        let _ = reader.read_to_end(&mut received).await;
        received
    });
    // At most MAX_WRITES writes: each is a TLS record, and a yield.
    let step = if chunk_bytes == 0 {
        client.len().max(1)
    } else {
        chunk_bytes.max(client.len().div_ceil(MAX_WRITES))
    };
    for chunk in client.chunks(step) {
        // The server may have closed already: the rest is not read.
        if writer.write_all(chunk).await.is_err() {
            break;
        }
        if chunk_bytes != 0 {
            let _ = writer.flush().await;
            tokio::task::yield_now().await;
        }
    }
    let _ = writer.shutdown().await;
    match reading.await {
        Ok(received) => received,
        Err(err) => std::panic::resume_unwind(err.into_panic()),
    }
}

#[cfg(feature = "tls")]
async fn tls_exchange(
    mut stream: tokio::io::DuplexStream,
    tenant: &'static str,
    chunk_bytes: usize,
    client: &[u8],
) -> Vec<u8> {
    use std::pin::Pin;
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).await.expect("greeting");
    let mut expected = Vec::new();
    encode_server_greeting(&mut expected);
    assert_eq!(greeting[..], expected[..], "greeting");
    let mut out = (NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    encode_client_option(&mut out, &ClientOption::StartTls);
    stream.write_all(&out).await.expect("STARTTLS");
    let mut reply = [0u8; OPTION_REPLY_HEADER_LEN];
    stream.read_exact(&mut reply).await.expect("STARTTLS reply");
    let reply = decode_option_reply_header(&reply).expect("STARTTLS reply header");
    assert_eq!(
        (reply.option, reply.reply_type, reply.length),
        (headroom_nbd::consts::NBD_OPT_STARTTLS, NBD_REP_ACK, 0),
        "STARTTLS answered"
    );
    let ssl = tls_connector(tenant)
        .configure()
        .and_then(|mut config| {
            config.set_verify_hostname(false);
            config.set_use_server_name_indication(false);
            config.into_ssl("headroom")
        })
        .expect("client SSL");
    let mut tls = tokio_openssl::SslStream::new(ssl, stream).expect("TLS stream");
    Pin::new(&mut tls).connect().await.expect("TLS handshake");
    exchange(tls, chunk_bytes, client).await
}

/// The client side of the PSK handshake as `tenant` (one of [`TENANTS`]), built once.
#[cfg(feature = "tls")]
fn tls_connector(tenant: &'static str) -> &'static openssl::ssl::SslConnector {
    static CONNECTORS: [OnceLock<openssl::ssl::SslConnector>; TENANTS.len()] =
        [const { OnceLock::new() }; TENANTS.len()];
    let index = TENANTS
        .iter()
        .position(|t| *t == tenant)
        .expect("a configured tenant");
    CONNECTORS[index].get_or_init(|| {
        use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode, SslVersion};
        let mut b = SslConnector::builder(SslMethod::tls_client()).expect("connector");
        b.set_min_proto_version(Some(SslVersion::TLS1_3))
            .expect("TLS 1.3");
        b.set_verify(SslVerifyMode::NONE);
        b.set_ciphersuites("TLS_AES_128_GCM_SHA256").expect("suite");
        let key = psk_of(tenant);
        b.set_psk_client_callback(move |_, _, identity, psk| {
            let id = tenant.as_bytes();
            identity[..id.len()].copy_from_slice(id);
            identity[id.len()] = 0;
            psk[..key.len()].copy_from_slice(&key);
            Ok(key.len())
        });
        b.build()
    })
}

#[cfg(not(feature = "tls"))]
async fn tls_exchange(
    _stream: tokio::io::DuplexStream,
    _tenant: &'static str,
    _chunk_bytes: usize,
    _client: &[u8],
) -> Vec<u8> {
    unreachable!("TLS inputs are skipped without the tls feature")
}

// ---------------------------------------------------------------- the oracle

/// Takes the first `n` bytes of `rest`, or `None` (taking nothing) if fewer remain.
fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if n > rest.len() {
        return None;
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Some(head)
}

fn be_u16(bytes: &[u8]) -> u16 {
    u16::from_be_bytes([bytes[0], bytes[1]])
}

fn be_u32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

fn be_u64(bytes: &[u8]) -> u64 {
    u64::from_be_bytes(bytes[..8].try_into().expect("8 bytes"))
}

/// A volume as a session of the oracle's tenant may see it.
#[derive(Clone, Debug)]
struct Visible {
    size_bytes: u64,
    read_only: bool,
}

/// Checks the server's bytes against the client's, as an NBD client would read them.
struct Oracle {
    /// The volumes the session's tenant may see, by name.
    visible: HashMap<String, Visible>,
    /// Every volume's tenant, by name (to name the other tenant's volume in a failure).
    owners: HashMap<String, Option<String>>,
    tenant: Option<String>,
    structured: bool,
    /// (export, base:allocation selected) from the last SET_META_CONTEXT.
    meta_selection: Option<(String, bool)>,
}

/// A request the client sent in transmission, awaiting its reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sent {
    command: u16,
    flags: u16,
    offset: u64,
    length: u32,
}

/// Where option haggling left the conversation.
enum AfterOptions {
    /// Nothing more to check (the session ended, or went to TLS the harness does not speak).
    Done,
    /// Transmission with these settings.
    Transmit {
        structured: bool,
        allocation_context: bool,
    },
}

impl Oracle {
    fn new(ctx: &SessionContext, tenant: Option<&str>) -> Oracle {
        let mut visible = HashMap::new();
        let mut owners = HashMap::new();
        for info in ctx.store.list_volumes() {
            owners.insert(info.name.clone(), info.tenant.clone());
            if info.tenant.as_deref() == tenant {
                let volume = ctx.store.open_volume(&info.name).expect("open volume");
                visible.insert(
                    info.name.clone(),
                    Visible {
                        size_bytes: info.size_bytes,
                        read_only: volume.read_only(),
                    },
                );
            }
        }
        // The harness's own volumes are all there, and the wall is drawn where it made it.
        for volume in &VOLUMES {
            assert_eq!(
                owners.get(volume.name),
                Some(&volume.tenant.map(str::to_string)),
                "volume {} lost its tenant",
                volume.name
            );
        }
        Oracle {
            visible,
            owners,
            tenant: tenant.map(str::to_string),
            structured: false,
            meta_selection: None,
        }
    }

    fn check(mut self, mode: Mode, client: &[u8], server: &[u8]) {
        let mut c = client;
        let mut s = server;
        let no_zeroes;
        let fixed_newstyle;
        match mode {
            Mode::Plaintext => {
                let mut greeting = Vec::new();
                encode_server_greeting(&mut greeting);
                assert_eq!(
                    take(&mut s, greeting.len()),
                    Some(&greeting[..]),
                    "the server's first bytes are not the greeting"
                );
                let Some(flags) = take(&mut c, 4) else {
                    assert!(s.is_empty(), "bytes before the client flags: {s:02x?}");
                    return;
                };
                let Ok(flags) = decode_client_flags(be_u32(flags)) else {
                    assert!(s.is_empty(), "bytes after bad client flags: {s:02x?}");
                    return;
                };
                no_zeroes = flags.no_zeroes;
                fixed_newstyle = flags.fixed_newstyle;
            }
            Mode::Tls(_) => {
                no_zeroes = true;
                fixed_newstyle = true;
            }
        }
        let tls = matches!(mode, Mode::Tls(_));
        match self.options(&mut c, &mut s, tls, fixed_newstyle, no_zeroes) {
            AfterOptions::Done => {}
            AfterOptions::Transmit {
                structured,
                allocation_context,
            } => check_transmission(c, s, structured, allocation_context),
        }
    }

    fn is_visible(&self, name: &str) -> Option<&Visible> {
        self.visible.get(name)
    }

    /// A name this session succeeded with must be one of its tenant's.
    fn assert_visible(&self, name: &str, what: &str) -> Visible {
        match self.is_visible(name) {
            Some(volume) => volume.clone(),
            None => panic!(
                "{what} {name:?} succeeded for tenant {:?}, but it belongs to {:?}",
                self.tenant,
                self.owners.get(name)
            ),
        }
    }

    /// Option haggling: one option of the client's at a time, with all its replies.
    fn options(
        &mut self,
        c: &mut &[u8],
        s: &mut &[u8],
        tls: bool,
        fixed_newstyle: bool,
        no_zeroes: bool,
    ) -> AfterOptions {
        loop {
            if s.is_empty() {
                return AfterOptions::Done;
            }
            let Some(header_bytes) = take(c, OPTION_HEADER_LEN) else {
                panic!(
                    "server sent {:02x?} with no option to answer",
                    &s[..s.len().min(64)]
                );
            };
            let header_bytes: &[u8; OPTION_HEADER_LEN] = header_bytes.try_into().expect("16");
            let Ok(header) = decode_option_header(header_bytes) else {
                panic!("server answered an option with a bad magic: {s:02x?}");
            };
            match option_data_action(&header) {
                OptionDataAction::Read => {}
                OptionDataAction::DiscardThenReply { .. } => {
                    let _ = take(c, header.length as usize);
                    self.replies(s, header.option, &[]);
                    continue;
                }
                OptionDataAction::Close => {
                    if !s.is_empty() {
                        self.replies(s, header.option, &[]);
                    }
                    assert!(s.is_empty(), "bytes after an option too large: {s:02x?}");
                    return AfterOptions::Done;
                }
            }
            let Some(data) = take(c, header.length as usize) else {
                assert!(s.is_empty(), "reply to an option the client never finished");
                return AfterOptions::Done;
            };
            let option = match decode_option(&header, data) {
                Ok(option) => option,
                Err(err) if err.closes_connection() => {
                    assert!(
                        s.is_empty(),
                        "bytes after a malformed EXPORT_NAME: {s:02x?}"
                    );
                    return AfterOptions::Done;
                }
                Err(_) => {
                    let finals = self.replies(s, header.option, &[]);
                    assert!(
                        finals.iter().all(|r| r.is_error()),
                        "a malformed option was not refused"
                    );
                    continue;
                }
            };
            if let ClientOption::ExportName(name) = &option {
                let Some(volume) = self.is_visible(name).cloned() else {
                    assert!(
                        s.is_empty(),
                        "EXPORT_NAME of {name:?} (not visible to {:?}) was answered",
                        self.tenant
                    );
                    return AfterOptions::Done;
                };
                let reply_bytes = if no_zeroes { 10 } else { 134 };
                let Some(reply) = take(s, reply_bytes) else {
                    panic!("EXPORT_NAME reply cut short: {s:02x?}");
                };
                assert_eq!(
                    be_u64(reply),
                    volume.size_bytes,
                    "EXPORT_NAME size of {name}"
                );
                let flags = be_u16(&reply[8..10]);
                assert_eq!(
                    flags & NBD_FLAG_READ_ONLY != 0,
                    volume.read_only,
                    "read-only flag of {name}"
                );
                assert!(reply[10..].iter().all(|&b| b == 0), "EXPORT_NAME padding");
                return AfterOptions::Transmit {
                    structured: self.structured,
                    allocation_context: self.structured && self.selected_for(name),
                };
            }
            let Some(step) = self.answer(s, header.option, option, tls, fixed_newstyle) else {
                return AfterOptions::Done;
            };
            if let Some(transmit) = step {
                return transmit;
            }
        }
    }

    fn selected_for(&self, export: &str) -> bool {
        matches!(&self.meta_selection, Some((name, true)) if name == export)
    }

    /// Checks the replies to one decoded option. `None`: the conversation is over (for the
    /// oracle); `Some(None)`: next option; `Some(Some(_))`: transmission.
    fn answer(
        &mut self,
        s: &mut &[u8],
        number: u32,
        option: ClientOption,
        tls: bool,
        fixed_newstyle: bool,
    ) -> Option<Option<AfterOptions>> {
        match option {
            ClientOption::ExportName(_) => unreachable!("handled by the caller"),
            ClientOption::List => {
                let (finals, names) = self.list_replies(s, number);
                let last = finals?;
                assert_eq!(last.reply_type, NBD_REP_ACK, "LIST refused");
                let mut expected: Vec<&String> = self.visible.keys().collect();
                expected.sort();
                let mut listed: Vec<&String> = names.iter().collect();
                listed.sort();
                assert_eq!(
                    listed, expected,
                    "LIST for tenant {:?} is not exactly its volumes",
                    self.tenant
                );
                Some(None)
            }
            ClientOption::Info(request) | ClientOption::Go(request) => {
                self.info_or_go(s, number, &request)
            }
            ClientOption::Abort => {
                let finals = self.replies(s, number, &[]);
                if let Some(last) = finals.last() {
                    assert_eq!(last.reply_type, NBD_REP_ACK, "ABORT not acknowledged");
                }
                assert!(s.is_empty(), "bytes after ABORT: {s:02x?}");
                None
            }
            ClientOption::StructuredReply => {
                let finals = self.replies(s, number, &[]);
                let last = finals.last()?;
                assert_eq!(
                    last.reply_type == NBD_REP_ACK,
                    !self.structured,
                    "STRUCTURED_REPLY answered {:#x} with structured {}",
                    last.reply_type,
                    self.structured
                );
                self.structured = true;
                Some(None)
            }
            ClientOption::ListMetaContext(request) | ClientOption::SetMetaContext(request) => {
                self.meta_context(s, number, request)
            }
            ClientOption::StartTls => {
                let finals = self.replies(s, number, &[]);
                let last = finals.last()?;
                let tls_configured = cfg!(feature = "tls");
                if last.reply_type == NBD_REP_ACK {
                    assert!(
                        !tls && fixed_newstyle && tls_configured,
                        "STARTTLS acknowledged over TLS, without fixed newstyle, or without TLS"
                    );
                    // The rest is a TLS handshake the fuzzed client does not speak.
                    return None;
                }
                assert!(last.is_error(), "STARTTLS answered {:#x}", last.reply_type);
                Some(None)
            }
            ClientOption::ExtendedHeaders | ClientOption::Unknown(_) => {
                let finals = self.replies(s, number, &[]);
                let last = finals.last()?;
                assert!(last.is_error(), "option {number} not refused");
                Some(None)
            }
        }
    }

    fn list_replies(
        &self,
        s: &mut &[u8],
        number: u32,
    ) -> (Option<headroom_nbd::OptionReplyHeader>, Vec<String>) {
        let mut names = Vec::new();
        loop {
            let Some((reply, data)) = option_reply(s, number) else {
                return (None, names);
            };
            if reply.reply_type == NBD_REP_SERVER {
                assert!(data.len() >= 4, "REP_SERVER too short");
                let len = be_u32(data) as usize;
                assert!(4 + len <= data.len(), "REP_SERVER name past its data");
                let name = std::str::from_utf8(&data[4..4 + len]).expect("UTF-8 name");
                self.assert_visible(name, "listing");
                names.push(name.to_string());
                continue;
            }
            assert!(
                reply.reply_type == NBD_REP_ACK || reply.is_error(),
                "LIST answered with reply type {:#x}",
                reply.reply_type
            );
            return (Some(reply), names);
        }
    }

    fn info_or_go(
        &mut self,
        s: &mut &[u8],
        number: u32,
        request: &InfoRequest,
    ) -> Option<Option<AfterOptions>> {
        let name = &request.export_name;
        let mut export_size = None;
        let last = loop {
            let (reply, data) = option_reply(s, number)?;
            if reply.reply_type == NBD_REP_INFO {
                assert!(data.len() >= 2, "REP_INFO too short");
                match be_u16(data) {
                    NBD_INFO_EXPORT => {
                        assert_eq!(data.len(), 12, "INFO_EXPORT length");
                        export_size = Some((be_u64(&data[2..]), be_u16(&data[10..])));
                    }
                    NBD_INFO_NAME => {
                        let shown = std::str::from_utf8(&data[2..]).expect("UTF-8 name");
                        self.assert_visible(shown, "INFO_NAME");
                    }
                    _ => {}
                }
                continue;
            }
            break reply;
        };
        if last.reply_type != NBD_REP_ACK {
            assert!(last.is_error(), "INFO/GO answered {:#x}", last.reply_type);
            assert!(
                self.is_visible(name).is_none() || last.reply_type != NBD_REP_ERR_UNKNOWN,
                "INFO/GO of {name:?}, a volume of tenant {:?}, answered unknown",
                self.tenant
            );
            return Some(None);
        }
        let volume = self.assert_visible(name, "INFO/GO");
        let Some((size, flags)) = export_size else {
            panic!("INFO/GO of {name:?} acknowledged without INFO_EXPORT");
        };
        assert_eq!(size, volume.size_bytes, "INFO_EXPORT size of {name}");
        assert_eq!(
            flags & NBD_FLAG_READ_ONLY != 0,
            volume.read_only,
            "read-only flag"
        );
        if number != NBD_OPT_GO {
            return Some(None);
        }
        Some(Some(AfterOptions::Transmit {
            structured: self.structured,
            allocation_context: self.structured && self.selected_for(name),
        }))
    }

    fn meta_context(
        &mut self,
        s: &mut &[u8],
        number: u32,
        request: MetaContextRequest,
    ) -> Option<Option<AfterOptions>> {
        let mut contexts = 0;
        let last = loop {
            let (reply, data) = option_reply(s, number)?;
            if reply.reply_type == NBD_REP_META_CONTEXT {
                assert!(data.len() >= 4, "REP_META_CONTEXT too short");
                assert_eq!(be_u32(data), BASE_ALLOCATION_CONTEXT_ID, "context id");
                assert_eq!(&data[4..], BASE_ALLOCATION.as_bytes(), "context name");
                contexts += 1;
                continue;
            }
            break reply;
        };
        if last.reply_type != NBD_REP_ACK {
            assert!(
                last.is_error(),
                "meta context answered {:#x}",
                last.reply_type
            );
            return Some(None);
        }
        assert!(
            self.structured,
            "meta context acknowledged before structured replies"
        );
        self.assert_visible(&request.export_name, "meta context of");
        assert!(contexts <= 1, "{contexts} contexts for one we serve");
        if number == NBD_OPT_SET_META_CONTEXT {
            self.meta_selection = Some((request.export_name, contexts == 1));
        }
        Some(None)
    }

    /// Reads replies to `number` up to its final one; returns the final ones seen (one, or
    /// none if the server closed first). `non_final` are the reply types allowed before it.
    fn replies(
        &self,
        s: &mut &[u8],
        number: u32,
        non_final: &[u32],
    ) -> Vec<headroom_nbd::OptionReplyHeader> {
        loop {
            let Some((reply, _)) = option_reply(s, number) else {
                return Vec::new();
            };
            if non_final.contains(&reply.reply_type) {
                continue;
            }
            assert!(
                reply.reply_type == NBD_REP_ACK || reply.is_error(),
                "option {number} answered with reply type {:#x}",
                reply.reply_type
            );
            return vec![reply];
        }
    }
}

/// One option reply to `number` and its data; `None` if the server closed before it.
fn option_reply<'a>(
    s: &mut &'a [u8],
    number: u32,
) -> Option<(headroom_nbd::OptionReplyHeader, &'a [u8])> {
    if s.is_empty() {
        return None;
    }
    let Some(header) = take(s, OPTION_REPLY_HEADER_LEN) else {
        panic!("option reply header cut short: {s:02x?}");
    };
    let header: &[u8; OPTION_REPLY_HEADER_LEN] = header.try_into().expect("20");
    let reply = match decode_option_reply_header(header) {
        Ok(reply) => reply,
        Err(err) => panic!("not an option reply: {err}: {header:02x?}"),
    };
    assert_eq!(
        reply.option, number,
        "a reply names another option than the one asked"
    );
    let Some(data) = take(s, reply.length as usize) else {
        panic!("option reply data cut short: {reply:?}");
    };
    Some((reply, data))
}

/// Transmission: every reply answers a request the client sent, as the protocol frames it.
fn check_transmission(c: &[u8], mut s: &[u8], structured: bool, allocation_context: bool) {
    let mut c = c;
    let mut outstanding: HashMap<u64, Vec<Sent>> = HashMap::new();
    while let Some(header) = take(&mut c, REQUEST_HEADER_LEN) {
        let header: &[u8; REQUEST_HEADER_LEN] = header.try_into().expect("28");
        let Ok(header) = decode_request_header(header) else {
            break;
        };
        if header.command == NBD_CMD_DISC {
            break;
        }
        if header.command == NBD_CMD_WRITE && take(&mut c, header.length as usize).is_none() {
            // The payload ends with the stream: the server answers nothing more.
            c = &[];
        }
        outstanding.entry(header.cookie).or_default().push(Sent {
            command: header.command,
            flags: header.flags,
            offset: header.offset,
            length: header.length,
        });
    }
    // Structured replies in progress: cookie to (request, bytes of the read covered, error).
    let mut partial: HashMap<u64, (Sent, u64, bool)> = HashMap::new();
    while !s.is_empty() {
        assert!(s.len() >= 4, "a reply cut short: {s:02x?}");
        match be_u32(s) {
            SIMPLE_REPLY_MAGIC => {
                let Some(header) = take(&mut s, SIMPLE_REPLY_HEADER_LEN) else {
                    panic!("simple reply header cut short: {s:02x?}");
                };
                let header: &[u8; SIMPLE_REPLY_HEADER_LEN] = header.try_into().expect("16");
                let reply = decode_simple_reply_header(header).expect("simple reply");
                let Some(sent) = pick(&mut outstanding, reply.cookie) else {
                    return;
                };
                if sent.command == NBD_CMD_READ && reply.error == 0 {
                    assert!(
                        !structured,
                        "a simple reply with data after structured replies"
                    );
                    let Some(_) = take(&mut s, sent.length as usize) else {
                        panic!("READ reply of {} bytes cut short", sent.length);
                    };
                }
            }
            STRUCTURED_REPLY_MAGIC => {
                assert!(structured, "a structured reply that was not negotiated");
                let Some(header) = take(&mut s, STRUCTURED_REPLY_HEADER_LEN) else {
                    panic!("structured reply header cut short: {s:02x?}");
                };
                let header: &[u8; STRUCTURED_REPLY_HEADER_LEN] = header.try_into().expect("20");
                let chunk = decode_structured_chunk_header(header).expect("chunk header");
                let Some(payload) = take(&mut s, chunk.length as usize) else {
                    panic!("structured chunk cut short: {chunk:?}");
                };
                let entry = match partial.remove(&chunk.cookie) {
                    Some(entry) => entry,
                    None => {
                        let Some(sent) = pick(&mut outstanding, chunk.cookie) else {
                            return;
                        };
                        (sent, 0, false)
                    }
                };
                let (sent, mut covered, mut failed) = entry;
                let end = sent.offset.saturating_add(u64::from(sent.length));
                match chunk.chunk_type {
                    NBD_REPLY_TYPE_NONE => {
                        assert!(payload.is_empty(), "NONE with a payload");
                        assert!(chunk.is_done(), "NONE without DONE");
                    }
                    NBD_REPLY_TYPE_OFFSET_DATA => {
                        assert_eq!(sent.command, NBD_CMD_READ, "data for a {sent:?}");
                        assert!(payload.len() > 8, "OFFSET_DATA without data");
                        let offset = be_u64(payload);
                        let len = (payload.len() - 8) as u64;
                        assert!(
                            offset >= sent.offset && offset.saturating_add(len) <= end,
                            "data at {offset}+{len} outside {sent:?}"
                        );
                        covered += len;
                    }
                    NBD_REPLY_TYPE_OFFSET_HOLE => {
                        assert_eq!(sent.command, NBD_CMD_READ, "hole for a {sent:?}");
                        assert_eq!(payload.len(), 12, "OFFSET_HOLE length");
                        let offset = be_u64(payload);
                        let len = u64::from(be_u32(&payload[8..]));
                        assert!(len > 0, "an empty hole");
                        assert!(
                            offset >= sent.offset && offset.saturating_add(len) <= end,
                            "hole at {offset}+{len} outside {sent:?}"
                        );
                        covered += len;
                    }
                    NBD_REPLY_TYPE_BLOCK_STATUS => {
                        assert_eq!(sent.command, NBD_CMD_BLOCK_STATUS, "status for {sent:?}");
                        assert!(allocation_context, "block status without a context");
                        assert!(
                            payload.len() >= 12 && (payload.len() - 4) % 8 == 0,
                            "BLOCK_STATUS length {}",
                            payload.len()
                        );
                        assert_eq!(be_u32(payload), BASE_ALLOCATION_CONTEXT_ID, "context id");
                        let descriptors = (payload.len() - 4) / 8;
                        if sent.flags & NBD_CMD_FLAG_REQ_ONE != 0 {
                            assert_eq!(descriptors, 1, "REQ_ONE answered {descriptors}");
                        }
                        for d in payload[4..].chunks(8) {
                            assert!(be_u32(d) > 0, "an empty extent");
                        }
                    }
                    NBD_REPLY_TYPE_ERROR | NBD_REPLY_TYPE_ERROR_OFFSET => {
                        assert!(payload.len() >= 6, "error chunk too short");
                        assert_ne!(be_u32(payload), 0, "an error chunk with errno 0");
                        let message = usize::from(be_u16(&payload[4..]));
                        let extra = if chunk.chunk_type == NBD_REPLY_TYPE_ERROR {
                            0
                        } else {
                            8
                        };
                        assert_eq!(payload.len(), 6 + message + extra, "error chunk length");
                        if extra == 8 {
                            let offset = be_u64(&payload[6 + message..]);
                            assert!(
                                offset >= sent.offset
                                    && offset < end.max(sent.offset.saturating_add(1)),
                                "error offset {offset} outside {sent:?}"
                            );
                        }
                        failed = true;
                    }
                    other => panic!("chunk type {other:#x}"),
                }
                if chunk.is_done() {
                    if sent.command == NBD_CMD_READ && !failed {
                        assert_eq!(
                            covered,
                            u64::from(sent.length),
                            "a successful READ {sent:?} carried {covered} bytes"
                        );
                    }
                } else {
                    partial.insert(chunk.cookie, (sent, covered, failed));
                }
            }
            magic => panic!(
                "not a reply: magic {magic:#x} in {:02x?}",
                &s[..s.len().min(32)]
            ),
        }
    }
    assert!(
        partial.is_empty(),
        "structured replies without DONE: {partial:?}"
    );
}

/// The request `cookie` answers. Panics for a cookie the client never sent; `None` when two
/// requests with this cookie differ in what their reply carries (the oracle cannot tell
/// which one is answered and stops there).
fn pick(outstanding: &mut HashMap<u64, Vec<Sent>>, cookie: u64) -> Option<Sent> {
    let Some(sent) = outstanding.get_mut(&cookie).filter(|sent| !sent.is_empty()) else {
        panic!("a reply for cookie {cookie:#x}, which no outstanding request has");
    };
    if sent.iter().any(|other| *other != sent[0]) {
        return None;
    }
    Some(sent.remove(0))
}

// ---------------------------------------------------------------- seeds

/// Real conversations, encoded with `headroom_nbd`'s encoders: what nbdinfo, qemu-img and
/// nbdcopy send (fixed newstyle, structured replies, meta contexts, every command), in
/// plaintext and inside TLS as each tenant, and in small writes.
pub fn session_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    let flags = (NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes();
    let option = |out: &mut Vec<u8>, option: ClientOption| encode_client_option(out, &option);
    let go = |name: &str| {
        ClientOption::Go(InfoRequest {
            export_name: name.to_string(),
            info_types: vec![NBD_INFO_NAME, headroom_nbd::consts::NBD_INFO_DESCRIPTION],
        })
    };
    let set_meta = |name: &str| {
        ClientOption::SetMetaContext(MetaContextRequest {
            export_name: name.to_string(),
            queries: vec![BASE_ALLOCATION.to_string()],
        })
    };
    let list_meta = |name: &str| {
        ClientOption::ListMetaContext(MetaContextRequest {
            export_name: name.to_string(),
            queries: vec![],
        })
    };
    let request =
        |out: &mut Vec<u8>, command: Command, flags: u16, cookie: u64, offset: u64, length: u32| {
            encode_request_header(
                out,
                &RequestHeader {
                    flags,
                    command: command as u16,
                    cookie,
                    offset,
                    length,
                },
            );
        };
    // Every command, pipelined, with a written block read back.
    let commands = |out: &mut Vec<u8>| {
        request(out, Command::Write, 0, 1, 4096, 1024);
        out.extend(std::iter::repeat_n(0xa5, 1024));
        request(out, Command::Read, 0, 2, 4096, 1024);
        request(out, Command::Read, 0, 3, 0, 65536);
        request(out, Command::BlockStatus, 0, 4, 0, 65536);
        request(out, Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 5, 0, 65536);
        request(out, Command::WriteZeroes, 0, 6, 8192, 8192);
        request(
            out,
            Command::WriteZeroes,
            headroom_nbd::consts::NBD_CMD_FLAG_NO_HOLE,
            7,
            16384,
            4096,
        );
        request(out, Command::Trim, 0, 8, 8192, 4096);
        request(out, Command::Cache, 0, 9, 0, 4096);
        request(
            out,
            Command::Write,
            headroom_nbd::consts::NBD_CMD_FLAG_FUA,
            10,
            0,
            512,
        );
        out.extend(std::iter::repeat_n(0x5a, 512));
        request(out, Command::Flush, 0, 11, 0, 0);
        request(
            out,
            Command::Read,
            headroom_nbd::consts::NBD_CMD_FLAG_DF,
            12,
            0,
            1024,
        );
        // Past the end, and unaligned: answered with errors.
        request(out, Command::Read, 0, 13, 1 << 40, 512);
        request(out, Command::Disc, 0, 14, 0, 0);
    };
    // qemu-img / nbdcopy style: structured replies, base:allocation, GO, commands.
    let modern = |name: &str| {
        let mut out = Vec::new();
        option(&mut out, ClientOption::StructuredReply);
        option(&mut out, list_meta(name));
        option(&mut out, set_meta(name));
        option(&mut out, go(name));
        commands(&mut out);
        out
    };
    // nbdinfo --list style.
    let listing = || {
        let mut out = Vec::new();
        option(&mut out, ClientOption::List);
        option(
            &mut out,
            ClientOption::Info(InfoRequest {
                export_name: "public".into(),
                info_types: vec![NBD_INFO_NAME],
            }),
        );
        option(&mut out, ClientOption::Abort);
        out
    };
    // Old style: EXPORT_NAME and simple replies.
    let old = |name: &str| {
        let mut out = Vec::new();
        option(&mut out, ClientOption::ExportName(name.into()));
        commands(&mut out);
        out
    };
    let plain = |body: Vec<u8>| [flags.as_slice(), &body].concat();
    let with_mode = |mode: u8, chunk: u8, body: &[u8]| [&[mode, chunk][..], body].concat();
    seeds.push((
        "plain-modern".to_string(),
        with_mode(0, 0, &plain(modern("public"))),
    ));
    seeds.push(("plain-list".to_string(), with_mode(0, 0, &plain(listing()))));
    seeds.push((
        "plain-export-name".to_string(),
        with_mode(0, 0, &plain(old("public"))),
    ));
    seeds.push((
        "plain-small-writes".to_string(),
        with_mode(0, 7, &plain(modern("public"))),
    ));
    // Another tenant's volume over plaintext: answered as unknown.
    seeds.push((
        "plain-foreign".to_string(),
        with_mode(0, 0, &plain(modern("alice-a"))),
    ));
    // A plaintext STARTTLS from the fuzzed client itself (followed by no handshake).
    let mut starttls = plain(Vec::new());
    option(&mut starttls, ClientOption::StartTls);
    seeds.push(("plain-starttls".to_string(), with_mode(0, 0, &starttls)));
    for (mode, tenant) in [(1u8, "alice"), (2u8, "bob")] {
        let own = if tenant == "alice" {
            "alice-a"
        } else {
            "bob-a"
        };
        let other = if tenant == "alice" {
            "bob-a"
        } else {
            "alice-a"
        };
        seeds.push((
            format!("tls-{tenant}-modern"),
            with_mode(mode, 0, &modern(own)),
        ));
        seeds.push((format!("tls-{tenant}-list"), with_mode(mode, 0, &listing())));
        seeds.push((
            format!("tls-{tenant}-foreign"),
            with_mode(mode, 0, &modern(other)),
        ));
        seeds.push((
            format!("tls-{tenant}-public"),
            with_mode(mode, 0, &old("public")),
        ));
    }
    seeds.push((
        "tls-alice-read-only".to_string(),
        with_mode(1, 3, &modern("alice-ro")),
    ));
    let mut again = Vec::new();
    option(&mut again, ClientOption::StartTls);
    option(&mut again, ClientOption::List);
    seeds.push((
        "tls-bob-starttls-again".to_string(),
        with_mode(2, 0, &again),
    ));
    let mut header = Vec::new();
    encode_option_header(&mut header, NBD_OPT_INFO, 0);
    seeds.push((
        "plain-short-info".to_string(),
        with_mode(0, 0, &plain(header)),
    ));
    seeds
}
