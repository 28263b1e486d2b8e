//! What the `router` fuzz target checks: the whole management API, in process.
//!
//! Why a file of its own: the fuzz target (through the `headroom_fuzz` library) and the corpus
//! replay test `crates/node/tests/fuzz_router_corpus.rs` (through `#[path]`) include this same
//! file, so CI checks every committed corpus input exactly as the fuzzer did.
//!
//! The target drives the real router (`headroom_node::api::router`) over the real state of a
//! real node (`Node::start` on the memory store: two RAM devices, the default scheduler, the
//! rebuild and scrub tasks), started once per process on a current-thread Tokio runtime.
//! Nothing is sent over a socket: each request is handed to the router as a `tower` service
//! call. The node has three tokens: its bootstrap token, an `admin` token (`ops`) and a `read`
//! token (`grafana`).
//!
//! An input is up to [`MAX_REQUESTS`] requests, each decoded from a few header bytes and three
//! length-prefixed fields ([`RequestSpec::decode`]): the method, one of the documented routes
//! with a fuzzed path parameter (raw or percent-encoded, or one of the names that exist) and a
//! fuzzed query string, or a wholly fuzzed path; the `Authorization` header (none, each of the
//! three tokens, a wrong token, a malformed one, two of them); the `Content-Type`; a
//! `Content-Length` that is right, absent, wrong or over the body limit; and the body.
//!
//! Checked for every request: nothing panics; no 5xx (507 only as `no_space` or
//! `overcommitted`); every error has the documented JSON body (`{"error", "kind"}`, both
//! non-empty, `application/json`); a request without a valid token to anything but a public
//! path gets 401 `unauthorized`; a `read` token gets 403 `forbidden` for every method but GET
//! and HEAD; nothing refused (any 4xx), and no GET or HEAD, changes the node's state (volumes,
//! tenants, tokens, devices, rebuild and scrub rates); a successful GET of a documented route
//! parses as its documented body (and shows the volume or tenant asked for).
//!
//! Bounded: after an input that changed anything, the node is put back to the same starting
//! state through the API itself (delete what was made, recreate the baseline), so every input
//! starts from the same state, a crash reproduces from its input alone, and long runs neither
//! grow memory nor touch the disk (the memory store keeps its metadata in RAM; the tokens are
//! kept in memory; there is no audit log).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Method, Request, StatusCode, Uri, header};
use headroom_node::api::node::{DeviceView, NodeView, PoolView};
use headroom_node::api::tenants::TenantView;
use headroom_node::api::tokens::{CreatedToken, Scope, TokenView};
use headroom_node::api::{ApiErrorBody, ApiState, ApiToken, HealthBody, ReadyBody, VolumeView};
use headroom_node::config::{NodeConfig, StoreBackend};
use headroom_node::repair::RebuildView;
use headroom_node::scrub::ScrubStatus;
use headroom_node::server::{Node, RunningNode};
use headroom_node::timeline::StatsReport;
use serde::de::DeserializeOwned;

/// Requests decoded from one input at most.
pub const MAX_REQUESTS: usize = 4;

/// The node's bootstrap token.
const BOOTSTRAP: &str = "fuzz-bootstrap-token-0123456789";
/// Name of the `admin` and the `read` scoped token.
const ADMIN_NAME: &str = "ops";
const READ_NAME: &str = "grafana";

/// The memory store's size: two RAM devices of 128 MiB (thin volumes take nothing until
/// written, and nothing is written here).
const POOL_BYTES: u64 = 256 << 20;

/// The documented routes, `{p}` standing for the path parameter; the last entry is the raw
/// path (the parameter is the whole path).
const ROUTES: [&str; 25] = [
    "/healthz",
    "/readyz",
    "/v1/health",
    "/openapi.json",
    "/v1/connections",
    "/v1/volumes",
    "/v1/volumes/{p}",
    "/v1/volumes/{p}/scrub",
    "/v1/pool",
    "/v1/devices",
    "/v1/devices/{p}/fail",
    "/v1/devices/{p}/restore",
    "/v1/node",
    "/v1/arbitration",
    "/v1/rebuild",
    "/v1/scrub",
    "/v1/tenants",
    "/v1/tenants/{p}",
    "/v1/tokens",
    "/v1/tokens/{p}",
    "/metrics",
    "/v1/stats",
    "/",
    "/assets/{p}",
    "{p}",
];

/// Path parameters that name something that exists (or nearly), chosen by index 1-15.
const KNOWN_PARAMS: [&str; 15] = [
    "vol1",
    "avol",
    "rep2",
    "nope",
    "alice",
    "bob",
    ADMIN_NAME,
    READ_NAME,
    "bootstrap",
    "0",
    "1",
    "2",
    "app.js",
    "style.css",
    "a b/c%",
];

const METHODS: [&str; 8] = [
    "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "PURGE",
];

/// Which `Authorization` header a request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Auth {
    None,
    Bootstrap,
    Admin,
    Read,
    /// A well-formed bearer token that is none of the node's.
    Wrong,
    /// Not a bearer token at all.
    Malformed,
    /// The admin token, with the scheme in lower case and extra spaces (valid, RFC 7235).
    AdminOddSpelling,
    /// The bootstrap token with a byte added.
    Longer,
}

const AUTHS: [Auth; 8] = [
    Auth::None,
    Auth::Bootstrap,
    Auth::Admin,
    Auth::Read,
    Auth::Wrong,
    Auth::Malformed,
    Auth::AdminOddSpelling,
    Auth::Longer,
];

const CONTENT_TYPES: [Option<&str>; 4] = [
    None,
    Some("application/json"),
    Some("text/plain"),
    Some("application/json; charset=utf-8"),
];

/// What the `Content-Length` header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Length {
    /// The body's length.
    Right,
    Absent,
    /// The body's length plus this many bytes (1-256).
    Wrong(u16),
    /// Over the 2 MiB body limit (64 MiB + 1 when `true`: over what is drained too).
    OverLimit(bool),
}

/// One request, as decoded from the fuzz input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub method: usize,
    pub route: usize,
    pub auth: Auth,
    /// A second `Authorization` header (the bootstrap token).
    pub second_auth: bool,
    /// Percent-encode the parameter (else it goes in raw when that makes a valid URI).
    pub encode_param: bool,
    pub content_type: usize,
    pub length: Length,
    /// 0: `param` as given; 1-15: `KNOWN_PARAMS[known - 1]`.
    pub known: usize,
    pub param: Vec<u8>,
    /// Empty: no `?`.
    pub query: Vec<u8>,
    pub body: Vec<u8>,
}

/// A cursor over the fuzz input; reads past its end give zeros and empty fields.
struct Reader<'a> {
    data: &'a [u8],
}

impl Reader<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&first, rest) = self.data.split_first()?;
        self.data = rest;
        Some(first)
    }

    fn field(&mut self, len: usize) -> Vec<u8> {
        let len = len.min(self.data.len());
        let (field, rest) = self.data.split_at(len);
        self.data = rest;
        field.to_vec()
    }
}

impl RequestSpec {
    /// Decodes the requests of one input: per request three header bytes, a parameter and a
    /// query (a length byte each) and a body (two length bytes, little-endian).
    pub fn decode(data: &[u8]) -> Vec<RequestSpec> {
        let mut reader = Reader { data };
        let mut requests = Vec::new();
        while requests.len() < MAX_REQUESTS {
            let Some(b0) = reader.byte() else { break };
            let b1 = reader.byte().unwrap_or(0);
            let b2 = reader.byte().unwrap_or(0);
            let b3 = reader.byte().unwrap_or(0);
            let param_len = usize::from(reader.byte().unwrap_or(0));
            let param = reader.field(param_len);
            let query_len = usize::from(reader.byte().unwrap_or(0));
            let query = reader.field(query_len);
            let body_len = usize::from(u16::from_le_bytes([
                reader.byte().unwrap_or(0),
                reader.byte().unwrap_or(0),
            ]));
            let body = reader.field(body_len);
            let length = match (b2 >> 2) & 3 {
                0 => Length::Right,
                1 => Length::Absent,
                2 => Length::Wrong(u16::from(b3) + 1),
                _ => Length::OverLimit(b3 & 1 == 1),
            };
            requests.push(RequestSpec {
                method: usize::from(b0 & 7),
                auth: AUTHS[usize::from((b0 >> 3) & 7)],
                encode_param: b0 & 0x40 != 0,
                second_auth: b0 & 0x80 != 0,
                route: usize::from(b1) % ROUTES.len(),
                content_type: usize::from(b2 & 3),
                length,
                known: usize::from(b2 >> 4),
                param,
                query,
                body,
            });
        }
        requests
    }

    /// The bytes [`decode`](Self::decode) reads back as this request (fields truncated to
    /// what their length bytes can say).
    pub fn encode(&self) -> Vec<u8> {
        let auth = AUTHS.iter().position(|&a| a == self.auth).unwrap_or(0) as u8;
        let b0 = (self.method as u8 & 7)
            | (auth << 3)
            | if self.encode_param { 0x40 } else { 0 }
            | if self.second_auth { 0x80 } else { 0 };
        let (mode, b3) = match self.length {
            Length::Right => (0, 0),
            Length::Absent => (1, 0),
            Length::Wrong(n) => (2, n.clamp(1, 256) - 1),
            Length::OverLimit(drained) => (3, u16::from(drained)),
        };
        let b2 = (self.content_type as u8 & 3) | (mode << 2) | ((self.known as u8 & 15) << 4);
        let mut out = vec![b0, self.route as u8, b2, b3 as u8];
        let param = &self.param[..self.param.len().min(255)];
        out.push(param.len() as u8);
        out.extend_from_slice(param);
        let query = &self.query[..self.query.len().min(255)];
        out.push(query.len() as u8);
        out.extend_from_slice(query);
        let body = &self.body[..self.body.len().min(usize::from(u16::MAX))];
        out.extend_from_slice(&(body.len() as u16).to_le_bytes());
        out.extend_from_slice(body);
        out
    }

    fn method(&self) -> Method {
        Method::from_bytes(METHODS[self.method].as_bytes()).unwrap_or(Method::GET)
    }

    /// The parameter's bytes: a known name or the fuzzed bytes.
    fn param_bytes(&self) -> &[u8] {
        match self.known {
            0 => &self.param,
            k => KNOWN_PARAMS[(k - 1) % KNOWN_PARAMS.len()].as_bytes(),
        }
    }

    /// The request's URI, and the parameter as the router will see it (decoded) when it went
    /// into a documented route.
    fn uri(&self) -> (Uri, Option<String>) {
        let template = ROUTES[self.route];
        let param = self.param_bytes();
        let raw_query = (!self.query.is_empty()).then(|| self.query.clone());
        let build = |param: &[u8], query: Option<&[u8]>| {
            let mut text = template.replace("{p}", &String::from_utf8_lossy(param));
            if template == "{p}" && !text.starts_with('/') {
                text.insert(0, '/');
            }
            if let Some(query) = query {
                text.push('?');
                text.push_str(&String::from_utf8_lossy(query));
            }
            text
        };
        let encoded = percent_encode(param, b"");
        let query_encoded = raw_query.as_deref().map(|q| percent_encode(q, b"=&"));
        let candidates = [
            (!self.encode_param).then(|| build(param, raw_query.as_deref())),
            (!self.encode_param).then(|| build(param, query_encoded.as_deref())),
            Some(build(&encoded, raw_query.as_deref())),
            Some(build(&encoded, query_encoded.as_deref())),
        ];
        for text in candidates.into_iter().flatten() {
            if let Ok(uri) = text.parse::<Uri>() {
                // The parameter the handler gets: percent-decoded, when it is valid UTF-8.
                let decoded = (template.contains("{p}") && template != "{p}")
                    .then(|| String::from_utf8(param.to_vec()).ok())
                    .flatten();
                return (uri, decoded);
            }
        }
        (Uri::from_static("/"), None)
    }
}

/// `bytes` with everything but the unreserved characters (RFC 3986) and `keep` as `%XX`.
fn percent_encode(bytes: &[u8], keep: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || keep.contains(&b) {
            out.push(b);
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
    out
}

/// What a request may change of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
struct VolumeState {
    name: String,
    size_bytes: u64,
    qos: Option<String>,
    tenant: Option<String>,
    read_only: bool,
    replicas: u8,
}

/// The node's state a request may change (ids and clocks left out).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Snapshot {
    volumes: Vec<VolumeState>,
    tenants: Vec<String>,
    tokens: Vec<TokenView>,
    /// Id, failed, failure domain.
    devices: Vec<(u32, bool, Option<String>)>,
    rebuild_rate_bytes_per_s: Option<u64>,
    scrub_rate_bytes_per_s: Option<u64>,
}

fn snapshot(state: &ApiState) -> Snapshot {
    Snapshot {
        volumes: state
            .store
            .list_volumes()
            .into_iter()
            .map(|v| VolumeState {
                name: v.name,
                size_bytes: v.size_bytes,
                qos: v.qos,
                tenant: v.tenant,
                read_only: v.read_only,
                replicas: v.replicas,
            })
            .collect(),
        tenants: state
            .store
            .list_tenants()
            .into_iter()
            .map(|t| t.id)
            .collect(),
        tokens: state.tokens.list(),
        devices: state
            .store
            .pool_info()
            .devices
            .into_iter()
            .map(|d| (d.id, d.failed, d.failure_domain))
            .collect(),
        rebuild_rate_bytes_per_s: state.rebuild.as_ref().map(|r| r.rate_bytes_per_s()),
        scrub_rate_bytes_per_s: state.scrub.as_ref().map(|s| s.rate_bytes_per_s()),
    }
}

/// A response, read whole.
struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    body: Bytes,
}

/// The node, its router and what the checks need to know about its tokens.
struct Harness {
    runtime: tokio::runtime::Runtime,
    node: RunningNode,
    router: Router,
    admin: ScopedToken,
    read: ScopedToken,
    /// The state every input starts from (`None` while it is being made).
    baseline: Option<Snapshot>,
}

/// A scoped token the harness made: its id (to tell whether it still exists) and secret.
#[derive(Default)]
struct ScopedToken {
    id: String,
    secret: String,
}

/// The volumes and tenants every input starts with.
const BASELINE_TENANTS: [&str; 1] = [r#"{"id":"alice"}"#];
const BASELINE_VOLUMES: [&str; 3] = [
    r#"{"name":"vol1","size_bytes":1073741824,"qos":{"preset":"gp2"}}"#,
    r#"{"name":"avol","size_bytes":67108864,"tenant":"alice","read_only":true,"qos":{"baseline_iops":100,"ceiling_iops":1000,"burst":"credits"}}"#,
    r#"{"name":"rep2","size_bytes":16777216,"replicas":2}"#,
];

fn call(router: &Router, request: Request<Body>) -> impl Future<Output = Answer> + use<> {
    let mut service = router.clone();
    async move {
        let response = match tower_service::Service::call(&mut service, request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = match axum::body::to_bytes(response.into_body(), usize::MAX).await {
            Ok(body) => body,
            Err(err) => panic!("the response body failed: {err}"),
        };
        Answer {
            status,
            content_type,
            body,
        }
    }
}

impl Harness {
    fn start() -> Harness {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(err) => panic!("no Tokio runtime: {err}"),
        };
        let mut config = NodeConfig::new(StoreBackend::Memory {
            capacity_bytes: POOL_BYTES,
        });
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        config.nbd_listen = Some(loopback);
        config.api_listen = loopback;
        config.io_threads = 0;
        config.net_threads = Some(0);
        config.scrub_interval_s = 0;
        config.api_token = ApiToken::new(BOOTSTRAP).ok();
        let node = match runtime.block_on(Node::start(config)) {
            Ok(node) => node,
            Err(err) => panic!("the node does not start: {err}"),
        };
        let router = headroom_node::api::router(node.api_state().clone());
        let mut harness = Harness {
            runtime,
            node,
            router,
            admin: ScopedToken::default(),
            read: ScopedToken::default(),
            baseline: None,
        };
        harness.make_volumes();
        harness.make_tokens();
        harness.baseline = Some(snapshot(harness.state()));
        harness
    }

    fn state(&self) -> &ApiState {
        self.node.api_state()
    }

    /// A request with the bootstrap token that must succeed (the harness's own bookkeeping).
    fn must(&self, method: Method, path: &str, body: &str) -> Bytes {
        let mut request = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {BOOTSTRAP}"));
        if !body.is_empty() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = match request.body(Body::from(body.to_string())) {
            Ok(request) => request,
            Err(err) => panic!("{method} {path}: {err}"),
        };
        let answer = self.runtime.block_on(call(&self.router, request));
        assert!(
            answer.status.is_success(),
            "resetting the node: {method} {path} {body} got {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
        answer.body
    }

    /// The baseline tenants and volumes.
    fn make_volumes(&self) {
        for body in BASELINE_TENANTS {
            self.must(Method::POST, "/v1/tenants", body);
        }
        for body in BASELINE_VOLUMES {
            self.must(Method::POST, "/v1/volumes", body);
        }
    }

    /// The `admin` and the `read` token.
    fn make_tokens(&mut self) {
        for (scope, name) in [("admin", ADMIN_NAME), ("read", READ_NAME)] {
            let body = format!(r#"{{"scope":"{scope}","name":"{name}"}}"#);
            let created: CreatedToken =
                parse(&self.must(Method::POST, "/v1/tokens", &body), "a token");
            let token = ScopedToken {
                id: created.token.id,
                secret: created.secret,
            };
            match scope {
                "admin" => self.admin = token,
                _ => self.read = token,
            }
        }
    }

    /// Puts the node back to the baseline state, through the API: what a request changed is
    /// deleted or undone and the baseline made again. Only the parts that changed are touched.
    fn reset(&mut self, baseline: &Snapshot) {
        let now = snapshot(self.state());
        // Devices first: a replicated baseline volume needs both.
        for (id, failed, _) in &now.devices {
            if *failed {
                self.must(Method::POST, &format!("/v1/devices/{id}/restore"), "");
            }
        }
        if now.volumes != baseline.volumes || now.tenants != baseline.tenants {
            for volume in &now.volumes {
                let path = format!("/v1/volumes/{}", encoded(&volume.name));
                self.must(Method::DELETE, &path, "");
            }
            for tenant in &now.tenants {
                let path = format!("/v1/tenants/{}", encoded(tenant));
                self.must(Method::DELETE, &path, "");
            }
            self.make_volumes();
        }
        if now.tokens != baseline.tokens {
            for token in now.tokens.iter().filter(|t| t.revocable) {
                let path = format!("/v1/tokens/{}", encoded(&token.id));
                self.must(Method::DELETE, &path, "");
            }
            self.make_tokens();
        }
        if now.rebuild_rate_bytes_per_s != baseline.rebuild_rate_bytes_per_s
            && let Some(rate) = baseline.rebuild_rate_bytes_per_s
        {
            let body = format!(r#"{{"rate_bytes_per_s":{rate}}}"#);
            self.must(Method::PUT, "/v1/rebuild", &body);
        }
        if now.scrub_rate_bytes_per_s != baseline.scrub_rate_bytes_per_s
            && let Some(rate) = baseline.scrub_rate_bytes_per_s
        {
            let body = format!(r#"{{"rate_bytes_per_s":{rate}}}"#);
            self.must(Method::PUT, "/v1/scrub", &body);
        }
        // Token ids and creation times are new after the tokens were made again; the rest
        // must be as it was.
        let mut after = snapshot(self.state());
        let tokens = std::mem::take(&mut after.tokens);
        let mut wanted = baseline.clone();
        let wanted_tokens = std::mem::take(&mut wanted.tokens);
        let names = |t: &[TokenView]| -> Vec<(Option<String>, Scope)> {
            t.iter().map(|t| (t.name.clone(), t.scope)).collect()
        };
        assert!(
            after == wanted && names(&tokens) == names(&wanted_tokens),
            "the reset did not restore the node: {after:?} {tokens:?}\nwanted {wanted:?}"
        );
        after.tokens = tokens;
        self.baseline = Some(after);
    }

    /// Whether `auth` authenticates now (a scoped token may have been revoked by an earlier
    /// request of the same input), and whether it is the `read` token.
    fn identity(&self, auth: Auth, now: &Snapshot) -> Option<Scope> {
        let has = |id: &str| now.tokens.iter().find(|t| t.id == id).map(|t| t.scope);
        match auth {
            Auth::Bootstrap => Some(Scope::Admin),
            Auth::Admin | Auth::AdminOddSpelling => has(&self.admin.id),
            Auth::Read => has(&self.read.id),
            Auth::None | Auth::Wrong | Auth::Malformed | Auth::Longer => None,
        }
    }

    fn authorization(&self, auth: Auth) -> Option<String> {
        match auth {
            Auth::None => None,
            Auth::Bootstrap => Some(format!("Bearer {BOOTSTRAP}")),
            Auth::Admin => Some(format!("Bearer {}", self.admin.secret)),
            Auth::Read => Some(format!("Bearer {}", self.read.secret)),
            Auth::Wrong => Some(format!("Bearer hrt_{}", "0".repeat(64))),
            Auth::Malformed => Some("Basic b3BzOm9wcw==".to_string()),
            Auth::AdminOddSpelling => Some(format!("bearer    {}  ", self.admin.secret)),
            Auth::Longer => Some(format!("Bearer {BOOTSTRAP}x")),
        }
    }

    fn build(&self, spec: &RequestSpec) -> (Request<Body>, Option<String>) {
        let (uri, param) = spec.uri();
        let mut builder = Request::builder().method(spec.method()).uri(uri);
        if let Some(value) = self.authorization(spec.auth) {
            builder = builder.header(header::AUTHORIZATION, value);
        }
        if spec.second_auth {
            builder = builder.header(header::AUTHORIZATION, format!("Bearer {BOOTSTRAP}"));
        }
        if let Some(content_type) = CONTENT_TYPES[spec.content_type] {
            builder = builder.header(header::CONTENT_TYPE, content_type);
        }
        let declared = match spec.length {
            Length::Right => Some(spec.body.len() as u64),
            Length::Absent => None,
            Length::Wrong(n) => Some(spec.body.len() as u64 + u64::from(n)),
            Length::OverLimit(false) => Some(headroom_node::api::body::MAX_BODY_BYTES + 1),
            Length::OverLimit(true) => Some(headroom_node::api::body::MAX_DRAIN_BYTES + 1),
        };
        if let Some(declared) = declared {
            builder = builder.header(header::CONTENT_LENGTH, HeaderValue::from(declared));
        }
        match builder.body(Body::from(spec.body.clone())) {
            Ok(request) => (request, param),
            Err(err) => panic!("cannot build {spec:?}: {err}"),
        }
    }

    fn run(&mut self, data: &[u8]) {
        for spec in RequestSpec::decode(data) {
            self.check_one(&spec);
        }
        if let Some(baseline) = self.baseline.take() {
            if snapshot(self.state()) == baseline {
                self.baseline = Some(baseline);
            } else {
                self.reset(&baseline);
            }
        }
    }

    fn check_one(&self, spec: &RequestSpec) {
        let before = snapshot(self.state());
        let (request, param) = self.build(spec);
        let method = request.method().clone();
        let path = request.uri().path().to_string();
        let reads = method == Method::GET || method == Method::HEAD;
        let public = reads && headroom_node::api::auth::is_public(&path);
        let identity = match (spec.second_auth, spec.auth) {
            (false, auth) => self.identity(auth, &before),
            // The second header is the only one.
            (true, Auth::None) => self.identity(Auth::Bootstrap, &before),
            // Two Authorization headers are malformed, whatever they hold.
            (true, _) => None,
        };
        let answer = self.runtime.block_on(call(&self.router, request));
        let after = snapshot(self.state());
        let what = format!(
            "{method} {path} ({spec:?}) got {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body[..answer.body.len().min(512)])
        );
        let status = answer.status;

        if status.is_server_error() {
            let error = error_body(&answer, &what, &method);
            assert!(
                status == StatusCode::INSUFFICIENT_STORAGE
                    && error
                        .as_ref()
                        .is_some_and(|e| e.kind == "no_space" || e.kind == "overcommitted"),
                "a server error: {what}"
            );
        }
        if status.is_client_error() || status.is_server_error() {
            error_body(&answer, &what, &method);
            assert_eq!(before, after, "a refused request changed the node: {what}");
        }
        if reads {
            assert_eq!(before, after, "a {method} changed the node: {what}");
        }
        if !public && identity.is_none() {
            assert_eq!(status, StatusCode::UNAUTHORIZED, "no valid token: {what}");
            if let Some(error) = error_body(&answer, &what, &method) {
                assert_eq!(error.kind, "unauthorized", "{what}");
            }
        }
        if identity == Some(Scope::Read) && !reads {
            assert_eq!(status, StatusCode::FORBIDDEN, "a read token: {what}");
            if let Some(error) = error_body(&answer, &what, &method) {
                assert_eq!(error.kind, "forbidden", "{what}");
            }
        }
        if status == StatusCode::OK && method == Method::GET {
            check_body(spec.route, param.as_deref(), spec, &answer, &what);
        }
    }
}

/// Checks an error's body: JSON `{"error", "kind"}`, both non-empty (HEAD answers carry none).
fn error_body(answer: &Answer, what: &str, method: &Method) -> Option<ApiErrorBody> {
    if method == Method::HEAD {
        assert!(answer.body.is_empty(), "a HEAD answer with a body: {what}");
        return None;
    }
    assert!(
        answer
            .content_type
            .as_deref()
            .is_some_and(|t| t.starts_with("application/json")),
        "an error that is not JSON ({:?}): {what}",
        answer.content_type
    );
    let error: ApiErrorBody = parse(&answer.body, what);
    assert!(
        !error.error.is_empty() && !error.kind.is_empty(),
        "an empty error: {what}"
    );
    Some(error)
}

fn parse<T: DeserializeOwned>(body: &[u8], what: &str) -> T {
    match serde_json::from_slice(body) {
        Ok(value) => value,
        Err(err) => panic!(
            "not the documented {}: {err}: {what}",
            std::any::type_name::<T>()
        ),
    }
}

/// A successful GET of a documented route: its body parses as documented.
fn check_body(route: usize, param: Option<&str>, spec: &RequestSpec, answer: &Answer, what: &str) {
    let body = &answer.body;
    match ROUTES[route] {
        "/healthz" | "/v1/health" => {
            let health: HealthBody = parse(body, what);
            assert_eq!(health.status, "ok", "{what}");
        }
        "/readyz" => {
            let ready: ReadyBody = parse(body, what);
            assert_eq!(ready.status == "ready", ready.reasons.is_empty(), "{what}");
        }
        "/openapi.json" => {
            let doc: serde_json::Value = parse(body, what);
            assert!(doc["openapi"].is_string(), "{what}");
        }
        "/v1/volumes" => {
            let volumes: Vec<VolumeView> = parse(body, what);
            let names: Vec<&str> = volumes.iter().map(|v| v.info.name.as_str()).collect();
            assert!(names.is_sorted(), "volumes not sorted by name: {what}");
            if spec.query.is_empty() {
                assert!(
                    !volumes.is_empty(),
                    "the baseline volumes are missing: {what}"
                );
            }
        }
        "/v1/volumes/{p}" => {
            let volume: VolumeView = parse(body, what);
            if let Some(name) = param {
                assert_eq!(volume.info.name, name, "another volume: {what}");
            }
        }
        "/v1/pool" => {
            let pool: PoolView = parse(body, what);
            assert_eq!(pool.capacity_bytes, POOL_BYTES, "{what}");
        }
        "/v1/devices" => {
            let devices: Vec<DeviceView> = parse(body, what);
            assert_eq!(devices.len(), 2, "{what}");
        }
        "/v1/node" => {
            let node: NodeView = parse(body, what);
            assert_eq!(node.backend, "memory", "{what}");
        }
        "/v1/rebuild" => {
            let _: RebuildView = parse(body, what);
        }
        "/v1/scrub" => {
            let _: ScrubStatus = parse(body, what);
        }
        "/v1/tenants" => {
            let _: Vec<TenantView> = parse(body, what);
        }
        "/v1/tenants/{p}" => {
            let tenant: TenantView = parse(body, what);
            if let Some(id) = param {
                assert_eq!(tenant.id, id, "another tenant: {what}");
            }
        }
        "/v1/tokens" => {
            let tokens: Vec<TokenView> = parse(body, what);
            assert!(!tokens.is_empty(), "{what}");
            assert!(
                !String::from_utf8_lossy(body).contains("hrt_"),
                "a token list shows a secret: {what}"
            );
        }
        "/v1/stats" => {
            let _: StatsReport = parse(body, what);
        }
        "/v1/connections" | "/v1/arbitration" => {
            let value: serde_json::Value = parse(body, what);
            assert!(value.is_object(), "{what}");
        }
        "/metrics" => {
            assert!(body.ends_with(b"# EOF\n"), "not OpenMetrics text: {what}");
        }
        _ => {}
    }
}

/// `text` percent-encoded for a path segment.
fn encoded(text: &str) -> String {
    String::from_utf8_lossy(&percent_encode(text.as_bytes(), b"")).into_owned()
}

/// The process's node, started on first use.
fn harness() -> &'static Mutex<Harness> {
    static HARNESS: OnceLock<Mutex<Harness>> = OnceLock::new();
    HARNESS.get_or_init(|| Mutex::new(Harness::start()))
}

/// Target `router`: the requests decoded from `data`, through the real router of a real node.
pub fn check_router(data: &[u8]) {
    let mut harness = harness().lock().unwrap_or_else(|p| p.into_inner());
    harness.run(data);
}

// ---------------------------------------------------------------- seeds

fn seed(method: &str, route: &str, auth: Auth, known: usize, query: &str, body: &str) -> Vec<u8> {
    let spec = RequestSpec {
        method: METHODS.iter().position(|&m| m == method).unwrap_or(0),
        route: ROUTES.iter().position(|&r| r == route).unwrap_or(0),
        auth,
        second_auth: false,
        encode_param: true,
        content_type: usize::from(!body.is_empty()),
        length: Length::Right,
        known,
        param: Vec::new(),
        query: query.as_bytes().to_vec(),
        body: body.as_bytes().to_vec(),
    };
    spec.encode()
}

/// An input of one request with the bootstrap token and the parameter `param`
/// (percent-encoded).
fn seed_param(method: &str, route: &str, param: &[u8]) -> Vec<u8> {
    let mut decoded = RequestSpec::decode(&seed(method, route, Auth::Bootstrap, 0, "", ""));
    decoded[0].param = param.to_vec();
    decoded[0].encode()
}

/// Inputs that found bugs, kept in the corpus as `regression-<name>` (outside `cmin`):
/// path parameters that do not parse (a device id of `-1`, a volume name of `%FF`) got
/// axum's plain-text 400 instead of the JSON error body.
pub fn router_regressions() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        (
            "path-not-u32",
            seed_param("POST", "/v1/devices/{p}/fail", b"-1"),
        ),
        (
            "path-not-utf8",
            seed_param("GET", "/v1/volumes/{p}", b"\xff"),
        ),
    ]
}

/// The index of a known parameter, for `seed`.
fn known(name: &str) -> usize {
    KNOWN_PARAMS
        .iter()
        .position(|&k| k == name)
        .map_or(0, |i| i + 1)
}

/// One input per documented route, what the CLI sends, with the bootstrap token (and a few
/// with the other tokens and none).
pub fn router_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use Auth::{Bootstrap as B, None as N, Read as R};
    vec![
        ("healthz", seed("GET", "/healthz", N, 0, "", "")),
        ("readyz", seed("GET", "/readyz", N, 0, "", "")),
        ("health", seed("GET", "/v1/health", B, 0, "", "")),
        ("openapi", seed("GET", "/openapi.json", B, 0, "", "")),
        ("connections", seed("GET", "/v1/connections", B, 0, "", "")),
        ("volume_list", seed("GET", "/v1/volumes", B, 0, "", "")),
        (
            "volume_list_tenant",
            seed("GET", "/v1/volumes", R, 0, "tenant=alice", ""),
        ),
        (
            "volume_create",
            seed(
                "POST",
                "/v1/volumes",
                B,
                0,
                "",
                r#"{"name":"new","size_bytes":1073741824,"qos":{"preset":"gp3"}}"#,
            ),
        ),
        (
            "volume_show",
            seed("GET", "/v1/volumes/{p}", B, known("vol1"), "", ""),
        ),
        (
            "volume_resize",
            seed(
                "PATCH",
                "/v1/volumes/{p}",
                B,
                known("vol1"),
                "",
                r#"{"size_bytes":2147483648}"#,
            ),
        ),
        (
            "volume_qos",
            seed(
                "PATCH",
                "/v1/volumes/{p}",
                B,
                known("avol"),
                "",
                r#"{"qos":{"baseline_iops":500,"ceiling_iops":2000,"burst":"on-demand"}}"#,
            ),
        ),
        (
            "volume_delete",
            seed("DELETE", "/v1/volumes/{p}", B, known("rep2"), "", ""),
        ),
        (
            "volume_scrub",
            seed("POST", "/v1/volumes/{p}/scrub", B, known("rep2"), "", ""),
        ),
        ("pool", seed("GET", "/v1/pool", B, 0, "", "")),
        ("devices", seed("GET", "/v1/devices", B, 0, "", "")),
        (
            "device_add",
            seed(
                "POST",
                "/v1/devices",
                B,
                0,
                "",
                r#"{"size_bytes":134217728}"#,
            ),
        ),
        (
            "device_fail",
            seed("POST", "/v1/devices/{p}/fail", B, known("1"), "", ""),
        ),
        (
            "device_restore",
            seed("POST", "/v1/devices/{p}/restore", B, known("1"), "", ""),
        ),
        ("node", seed("GET", "/v1/node", B, 0, "", "")),
        ("arbitration", seed("GET", "/v1/arbitration", B, 0, "", "")),
        ("rebuild_show", seed("GET", "/v1/rebuild", B, 0, "", "")),
        (
            "rebuild_set",
            seed(
                "PUT",
                "/v1/rebuild",
                B,
                0,
                "",
                r#"{"rate_bytes_per_s":104857600}"#,
            ),
        ),
        ("scrub_show", seed("GET", "/v1/scrub", B, 0, "", "")),
        (
            "scrub_set",
            seed(
                "PUT",
                "/v1/scrub",
                B,
                0,
                "",
                r#"{"rate_bytes_per_s":52428800}"#,
            ),
        ),
        ("scrub_start", seed("POST", "/v1/scrub", B, 0, "", "")),
        ("tenant_list", seed("GET", "/v1/tenants", B, 0, "", "")),
        (
            "tenant_create",
            seed("POST", "/v1/tenants", B, 0, "", r#"{"id":"bob"}"#),
        ),
        (
            "tenant_show",
            seed("GET", "/v1/tenants/{p}", B, known("alice"), "", ""),
        ),
        (
            "tenant_delete",
            seed("DELETE", "/v1/tenants/{p}", B, known("alice"), "", ""),
        ),
        ("token_list", seed("GET", "/v1/tokens", B, 0, "", "")),
        (
            "token_create",
            seed(
                "POST",
                "/v1/tokens",
                B,
                0,
                "",
                r#"{"scope":"read","name":"scraper"}"#,
            ),
        ),
        (
            "token_revoke",
            seed("DELETE", "/v1/tokens/{p}", B, known(READ_NAME), "", ""),
        ),
        ("metrics", seed("GET", "/metrics", R, 0, "", "")),
        (
            "stats",
            seed("GET", "/v1/stats", B, 0, "seconds=10&limit=5", ""),
        ),
        ("dashboard", seed("GET", "/", N, 0, "", "")),
        (
            "dashboard_asset",
            seed("GET", "/assets/{p}", N, known("app.js"), "", ""),
        ),
        (
            "read_token_delete",
            seed("DELETE", "/v1/volumes/{p}", R, known("vol1"), "", ""),
        ),
        (
            "no_token_create",
            seed(
                "POST",
                "/v1/volumes",
                N,
                0,
                "",
                r#"{"name":"x","size_bytes":4096}"#,
            ),
        ),
    ]
}
