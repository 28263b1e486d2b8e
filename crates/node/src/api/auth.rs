//! Bearer-token authentication of the management API.
//!
//! Why: the API creates, resizes and deletes volumes; anyone who can reach its port could
//! destroy every tenant's data. One node-wide token (`Authorization: Bearer <token>`) is the
//! smallest thing that closes that door without an identity system: the operator's tools and
//! the dashboard hold it, nothing else does (docs/ARCHITECTURE.md, decision "API bearer token").
//!
//! The check is one middleware layer over the whole router ([`require_token`]), so routes
//! other modules merge in later are covered without doing anything. A short allow-list
//! ([`is_public`]) names what needs no token: `/healthz` and `/readyz` (probes carry no secret) and
//! the dashboard's static page and assets (they hold no data; the page asks for the token and
//! sends it on its data requests). Tokens are compared in constant time.
//!
//! The same layer then applies the token's scope (`tokens`: a `read` token gets 403 on every
//! method but GET and HEAD) and writes the audit record of every authenticated request that
//! could change something (`audit_log`) before the response leaves, so no route can be
//! added that escapes either.

use std::fmt;
use std::io::Read;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::audit_log::{self, AuditRecord};
use super::tokens::Identity;
use super::{ApiErrorBody, ApiState};

/// Bytes of randomness in a generated token (hex-encoded: 64 characters).
pub const TOKEN_BYTES: usize = 32;
/// Longest token accepted from configuration (a bound on what we compare per request).
pub const MAX_TOKEN_LEN: usize = 512;
/// Shortest token accepted from configuration: a guessable token is no token.
pub const MIN_TOKEN_LEN: usize = 16;

/// The node's API token. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(String);

/// A token from configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error(
        "the API token must be {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} characters, has {0} (use 32 random bytes in hex: `head -c 32 /dev/urandom | xxd -p -c 64`)"
    )]
    Length(usize),
    #[error(
        "the API token may only hold printable ASCII without spaces (it travels in an HTTP header)"
    )]
    Characters,
    #[error("reading /dev/urandom for a new API token: {0}")]
    Random(std::io::Error),
}

impl ApiToken {
    /// A token given by the operator (environment, configuration or token file), checked.
    pub fn new(text: &str) -> Result<ApiToken, TokenError> {
        let text = text.trim();
        if !(MIN_TOKEN_LEN..=MAX_TOKEN_LEN).contains(&text.len()) {
            return Err(TokenError::Length(text.len()));
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Characters);
        }
        Ok(ApiToken(text.to_string()))
    }

    /// A fresh token: [`TOKEN_BYTES`] bytes of `/dev/urandom`, hex-encoded.
    pub fn random() -> Result<ApiToken, TokenError> {
        let mut bytes = [0u8; TOKEN_BYTES];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(TokenError::Random)?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(ApiToken(hex))
    }

    /// The secret itself (to write into a token file or print once).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `offered` is this token, in time independent of where they differ.
    pub fn matches(&self, offered: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), offered)
    }
}

impl fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

/// Equality whose running time depends only on the lengths, not on the contents: every byte
/// position up to the longer length is visited and the differences are OR-ed together.
pub(super) fn constant_time_eq(expected: &[u8], offered: &[u8]) -> bool {
    let len = expected.len().max(offered.len());
    let mut diff = u8::from(expected.len() != offered.len());
    for i in 0..len {
        let a = expected.get(i).copied().unwrap_or(0);
        let b = offered.get(i).copied().unwrap_or(0xff);
        diff |= a ^ b;
    }
    std::hint::black_box(diff) == 0
}

/// Paths served without a token to GET and HEAD: liveness, readiness, and the dashboard's
/// static files (no data).
pub fn is_public(path: &str) -> bool {
    path == "/healthz" || path == "/readyz" || path == "/" || path.starts_with("/assets/")
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    Missing,
    Malformed,
    Wrong,
}

/// The middleware: public paths pass; anything else needs `Authorization: Bearer <token>` of
/// a token whose scope allows the method; requests that may change something are audited.
pub async fn require_token(
    State(state): State<ApiState>,
    request: Request,
    next: Next,
) -> Response {
    let reads = request.method() == Method::GET || request.method() == Method::HEAD;
    // Public paths are public to read only: any other method needs a token like any route.
    if reads && is_public(request.uri().path()) {
        return next.run(request).await;
    }
    let identity = match check(&state, &request) {
        Ok(identity) => identity,
        Err(refusal) => return unauthorized(refusal),
    };
    let method = request.method().clone();
    if reads {
        return next.run(request).await;
    }
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string());
    let path = request.uri().path().to_string();
    let (request, body_target) = peek_target(request).await;
    let target = route
        .as_deref()
        .and_then(|route| audit_log::path_target(route, &path))
        .or(body_target);
    let response = if identity.scope.allows(&method) {
        next.run(request).await
    } else {
        forbidden(&identity, &method)
    };
    let Some(log) = state.audit.clone() else {
        return response;
    };
    let unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let record = AuditRecord {
        time: audit_log::rfc3339_utc(unix_ms),
        unix_ms,
        token_id: identity.id,
        token_name: identity.name,
        scope: identity.scope.as_str().to_string(),
        method: method.to_string(),
        route,
        path,
        target,
        status: response.status().as_u16(),
    };
    // Written (and synced) before the response is sent.
    let written = tokio::task::spawn_blocking(move || log.append(&record)).await;
    match written {
        Ok(Ok(())) => {}
        Ok(Err(err)) => tracing::error!("not audited: {err}"),
        Err(err) => tracing::error!("not audited: {err}"),
    }
    response
}

/// The body's `name`/`id`/`path` for the audit record, when the body says its length and is
/// within the limit; the request is rebuilt with the same bytes.
async fn peek_target(request: Request) -> (Request, Option<String>) {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if !declared.is_some_and(|n| n > 0 && n <= super::body::MAX_BODY_BYTES) {
        return (request, None);
    }
    let (parts, body) = request.into_parts();
    let limit = usize::try_from(super::body::MAX_BODY_BYTES).unwrap_or(usize::MAX);
    match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => {
            let target = audit_log::body_target(&bytes);
            (
                Request::from_parts(parts, axum::body::Body::from(bytes)),
                target,
            )
        }
        // The body did not arrive: the handler sees an empty one and answers for it.
        Err(_) => (Request::from_parts(parts, axum::body::Body::empty()), None),
    }
}

fn check(state: &ApiState, request: &Request) -> Result<Identity, Refusal> {
    let mut values = request.headers().get_all(header::AUTHORIZATION).iter();
    let value = values.next().ok_or(Refusal::Missing)?;
    if values.next().is_some() {
        return Err(Refusal::Malformed);
    }
    let bytes = value.as_bytes();
    // RFC 7235: the scheme is case-insensitive; one or more spaces before the credentials.
    let scheme_len = "Bearer ".len();
    if bytes.len() <= scheme_len || !bytes[..scheme_len].eq_ignore_ascii_case(b"bearer ") {
        return Err(Refusal::Malformed);
    }
    let offered = bytes[scheme_len..].trim_ascii();
    if offered.is_empty() || offered.len() > MAX_TOKEN_LEN {
        return Err(Refusal::Malformed);
    }
    state.tokens.authenticate(offered).ok_or(Refusal::Wrong)
}

fn forbidden(identity: &Identity, method: &Method) -> Response {
    let body = ApiErrorBody {
        error: format!(
            "token {} has scope {}, which allows GET and HEAD only, not {method}: use an admin token",
            identity.name.as_deref().unwrap_or(&identity.id),
            identity.scope.as_str()
        ),
        kind: "forbidden".to_string(),
    };
    (StatusCode::FORBIDDEN, axum::Json(body)).into_response()
}

fn unauthorized(refusal: Refusal) -> Response {
    let (reason, challenge) = match refusal {
        Refusal::Missing => (
            "this API needs a bearer token: send `Authorization: Bearer <token>` (the token is \
             HEADROOM_TOKEN, [api] token, or the api-token file in the server's data directory)",
            "Bearer realm=\"headroom\"",
        ),
        Refusal::Malformed => (
            "malformed Authorization header: expected one `Authorization: Bearer <token>`",
            "Bearer realm=\"headroom\", error=\"invalid_request\"",
        ),
        Refusal::Wrong => (
            "the bearer token is not one of this server's API tokens (revoked, or never made)",
            "Bearer realm=\"headroom\", error=\"invalid_token\"",
        ),
    };
    let body = ApiErrorBody {
        error: reason.to_string(),
        kind: "unauthorized".to_string(),
    };
    let mut response = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(challenge),
    );
    response
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn equal_only_when_identical() {
        assert!(constant_time_eq(b"abcdef", b"abcdef"));
        assert!(!constant_time_eq(b"abcdef", b"abcdeg"));
        assert!(!constant_time_eq(b"abcdef", b"abcde"));
        assert!(!constant_time_eq(b"abcde", b"abcdef"));
        assert!(!constant_time_eq(b"", b"\xff"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn random_tokens_are_hex_and_differ() {
        let a = ApiToken::random().unwrap();
        let b = ApiToken::random().unwrap();
        assert_eq!(a.expose().len(), 2 * TOKEN_BYTES);
        assert!(a.expose().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert!(!format!("{a:?}").contains(a.expose()));
    }

    #[test]
    fn operator_tokens_are_checked() {
        assert!(ApiToken::new("short").is_err());
        assert!(ApiToken::new("has a space in the middle").is_err());
        assert!(ApiToken::new(&"x".repeat(MAX_TOKEN_LEN + 1)).is_err());
        assert_eq!(
            ApiToken::new("  0123456789abcdef\n").unwrap().expose(),
            "0123456789abcdef"
        );
    }

    #[test]
    fn public_paths() {
        assert!(is_public("/healthz"));
        assert!(is_public("/readyz"));
        assert!(is_public("/"));
        assert!(is_public("/assets/app.js"));
        assert!(!is_public("/v1/volumes"));
        assert!(!is_public("/healthz/x"));
        assert!(!is_public("/readyz/x"));
        assert!(!is_public("/assetsx"));
        assert!(!is_public("/openapi.json"));
    }
}
