//! Scoped API tokens: `admin` (everything) and `read` (GET and HEAD only), each created,
//! listed and revoked through the API itself, so a change takes effect on the next request,
//! without a restart.
//!
//! Why: one all-powerful token cannot be handed to a dashboard or a metrics scraper without
//! handing it the power to delete every volume, and cannot be rotated without restarting the
//! node. The secret of a token is 32 bytes of `/dev/urandom`, shown once when it is created;
//! the node keeps only its SHA-256 (a random 256-bit secret needs no slow hash: there is
//! nothing to guess) in `DATA_DIR/api-tokens.json` (mode 0600, replaced atomically), and
//! compares hashes in constant time. The node's original token (`HEADROOM_TOKEN`, `[api]
//! token` or the `api-token` file) stays an `admin` token under the name "bootstrap token";
//! it is configuration, not state, so it is changed where it is configured, not revoked here.
//!
//! The scope rule is by method, not by route (`Scope::allows`): a `read` token may do what
//! does not change anything (GET, HEAD), and nothing else. A route added later is covered
//! without doing anything.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{Method, StatusCode};
use axum::routing::{delete, get};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use utoipa::ToSchema;

use super::auth::{ApiToken, constant_time_eq};
use super::{ApiError, ApiErrorBody, ApiState};

use crate::sync::lock;

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Everything.
    Admin,
    /// GET and HEAD: metrics, the dashboard's data, lists, single objects.
    Read,
}

impl Scope {
    /// Whether a request with `method` is allowed under this scope.
    pub fn allows(self, method: &Method) -> bool {
        match self {
            Scope::Admin => true,
            Scope::Read => method == Method::GET || method == Method::HEAD,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Admin => "admin",
            Scope::Read => "read",
        }
    }
}

/// Who sent a request (the audit log's "who").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// `bootstrap` for the node's configured token.
    pub id: String,
    pub name: Option<String>,
    pub scope: Scope,
}

/// The id and name the bootstrap token is shown under.
pub const BOOTSTRAP_ID: &str = "bootstrap";
pub const BOOTSTRAP_NAME: &str = "bootstrap token";

/// A token as stored (its hash, never its secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    scope: Scope,
    /// SHA-256 of the secret, hex.
    sha256: String,
    created_unix_ms: u64,
}

/// The token file's contents.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    tokens: Vec<Record>,
}

/// A token as `GET /v1/tokens` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TokenView {
    pub id: String,
    /// Absent: unnamed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub scope: Scope,
    /// 0 for the bootstrap token.
    pub created_unix_ms: u64,
    /// False for the bootstrap token (change it where it is configured).
    pub revocable: bool,
}

/// Body of `POST /v1/tokens`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    pub scope: Scope,
    /// 1-64 characters of `[A-Za-z0-9._-]`, unique among the node's tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Answer of `POST /v1/tokens`: the token and, this once, its secret.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct CreatedToken {
    #[serde(flatten)]
    pub token: TokenView,
    /// The bearer token to send; the node keeps only its hash and cannot show it again.
    pub secret: String,
}

/// Failures of the token store.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("no token with id or name {0:?}")]
    NotFound(String),
    #[error("a token named {0:?} exists")]
    NameTaken(String),
    #[error(
        "invalid token name {0:?}: 1-64 characters of A-Z a-z 0-9 . _ -, not starting with . or -"
    )]
    InvalidName(String),
    #[error(
        "the bootstrap token cannot be revoked here: change HEADROOM_TOKEN, [api] token or the api-token file and restart"
    )]
    Bootstrap,
    #[error("reading /dev/urandom: {0}")]
    Random(std::io::Error),
    #[error("the token file {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the token file {path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// The node's tokens: the bootstrap one and the scoped ones.
#[derive(Debug)]
pub struct Tokens {
    bootstrap: ApiToken,
    /// `None`: kept in memory only (a memory node without a data directory).
    path: Option<PathBuf>,
    records: Mutex<Vec<Record>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_hex(len_bytes: usize) -> Result<String, TokensError> {
    let mut bytes = vec![0u8; len_bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(TokensError::Random)?;
    Ok(hex(&bytes))
}

fn sha256_hex(secret: &[u8]) -> String {
    hex(&Sha256::digest(secret))
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Tokens {
    /// The bootstrap token and the scoped tokens kept in `path` (read now if it exists).
    pub fn open(bootstrap: ApiToken, path: Option<PathBuf>) -> Result<Tokens, TokensError> {
        let records = match &path {
            Some(path) if path.exists() => {
                let text = std::fs::read_to_string(path).map_err(|source| TokensError::File {
                    path: path.clone(),
                    source,
                })?;
                let file: TokenFile =
                    serde_json::from_str(&text).map_err(|source| TokensError::Parse {
                        path: path.clone(),
                        source,
                    })?;
                file.tokens
            }
            _ => Vec::new(),
        };
        Ok(Tokens {
            bootstrap,
            path,
            records: Mutex::new(records),
        })
    }

    /// Only the bootstrap token, in memory (tests, embedded nodes).
    pub fn bootstrap_only(bootstrap: ApiToken) -> Tokens {
        Tokens {
            bootstrap,
            path: None,
            records: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Record>> {
        lock(&self.records)
    }

    /// Who `offered` is, if anyone. Every stored hash is compared, in constant time.
    pub fn authenticate(&self, offered: &[u8]) -> Option<Identity> {
        if self.bootstrap.matches(offered) {
            return Some(Identity {
                id: BOOTSTRAP_ID.to_string(),
                name: Some(BOOTSTRAP_NAME.to_string()),
                scope: Scope::Admin,
            });
        }
        let hash = sha256_hex(offered);
        let mut found = None;
        for record in self.lock().iter() {
            if constant_time_eq(record.sha256.as_bytes(), hash.as_bytes()) && found.is_none() {
                found = Some(Identity {
                    id: record.id.clone(),
                    name: record.name.clone(),
                    scope: record.scope,
                });
            }
        }
        found
    }

    /// Every token, the bootstrap one first, then by creation.
    pub fn list(&self) -> Vec<TokenView> {
        let mut views = vec![TokenView {
            id: BOOTSTRAP_ID.to_string(),
            name: Some(BOOTSTRAP_NAME.to_string()),
            scope: Scope::Admin,
            created_unix_ms: 0,
            revocable: false,
        }];
        views.extend(self.lock().iter().map(view));
        views
    }

    /// A new token; its secret is in the answer and nowhere else. Blocking (writes the file).
    pub fn create(&self, scope: Scope, name: Option<String>) -> Result<CreatedToken, TokensError> {
        if let Some(name) = &name
            && (!valid_name(name) || name == BOOTSTRAP_ID)
        {
            return Err(TokensError::InvalidName(name.clone()));
        }
        let secret = format!("hrt_{}", random_hex(32)?);
        let mut records = self.lock();
        if let Some(name) = &name
            && records.iter().any(|r| r.name.as_ref() == Some(name))
        {
            return Err(TokensError::NameTaken(name.clone()));
        }
        let record = Record {
            id: format!("tok-{}", random_hex(8)?),
            name,
            scope,
            sha256: sha256_hex(secret.as_bytes()),
            created_unix_ms: now_unix_ms(),
        };
        let mut next = records.clone();
        next.push(record.clone());
        self.save(&next)?;
        *records = next;
        Ok(CreatedToken {
            token: view(&record),
            secret,
        })
    }

    /// Revokes the token with this id (or, failing that, this name): the next request with it
    /// is refused. Blocking (writes the file).
    pub fn revoke(&self, id_or_name: &str) -> Result<TokenView, TokensError> {
        if id_or_name == BOOTSTRAP_ID || id_or_name == BOOTSTRAP_NAME {
            return Err(TokensError::Bootstrap);
        }
        let mut records = self.lock();
        let index = records
            .iter()
            .position(|r| r.id == id_or_name)
            .or_else(|| {
                records
                    .iter()
                    .position(|r| r.name.as_deref() == Some(id_or_name))
            })
            .ok_or_else(|| TokensError::NotFound(id_or_name.to_string()))?;
        let mut next = records.clone();
        let removed = next.remove(index);
        self.save(&next)?;
        *records = next;
        Ok(view(&removed))
    }

    /// Writes the records to a temporary file, syncs it, and renames it over the file.
    fn save(&self, records: &[Record]) -> Result<(), TokensError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let err = |source| TokensError::File {
            path: path.clone(),
            source,
        };
        let file = TokenFile {
            tokens: records.to_vec(),
        };
        let text =
            serde_json::to_string_pretty(&file).map_err(|e| err(std::io::Error::other(e)))?;
        let tmp = path.with_extension("json.tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(err)?;
        out.write_all(text.as_bytes())
            .and_then(|()| out.write_all(b"\n"))
            .and_then(|()| out.sync_all())
            .map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(err)?;
        }
        Ok(())
    }

    /// Where the tokens are kept (`None`: memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
}

fn view(record: &Record) -> TokenView {
    TokenView {
        id: record.id.clone(),
        name: record.name.clone(),
        scope: record.scope,
        created_unix_ms: record.created_unix_ms,
        revocable: true,
    }
}

/// The routes of this module (merged into `api::routes`): `GET /v1/tokens`,
/// `POST /v1/tokens`, `DELETE /v1/tokens/{id}`.
pub(super) fn routes() -> Router<ApiState> {
    Router::new()
        .route("/v1/tokens", get(list_tokens).post(create_token))
        .route("/v1/tokens/{id}", delete(revoke_token))
}

impl From<TokensError> for ApiError {
    fn from(err: TokensError) -> Self {
        let (status, kind) = match &err {
            TokensError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            TokensError::NameTaken(_) => (StatusCode::CONFLICT, "already_exists"),
            TokensError::InvalidName(_) => (StatusCode::BAD_REQUEST, "invalid_name"),
            TokensError::Bootstrap => (StatusCode::CONFLICT, "not_revocable"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::Request(status, kind, err.to_string())
    }
}

/// Every token (never a secret), the bootstrap one first.
#[utoipa::path(get, path = "/v1/tokens", tag = "tokens",
    responses((status = 200, body = Vec<TokenView>),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn list_tokens(State(state): State<ApiState>) -> Json<Vec<TokenView>> {
    Json(state.tokens.list())
}

/// Creates a token; the answer holds its secret, which is never shown again.
#[utoipa::path(post, path = "/v1/tokens", tag = "tokens", request_body = CreateToken,
    responses((status = 201, body = CreatedToken),
        (status = 400, description = "Bad name", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 403, description = "A read token", body = ApiErrorBody),
        (status = 409, description = "The name is taken", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape, unknown field or unknown scope", body = ApiErrorBody)))]
pub(super) async fn create_token(
    State(state): State<ApiState>,
    body: Result<Json<CreateToken>, JsonRejection>,
) -> Result<(StatusCode, Json<CreatedToken>), ApiError> {
    let Json(body) = body?;
    let tokens = std::sync::Arc::clone(&state.tokens);
    let created = tokio::task::spawn_blocking(move || tokens.create(body.scope, body.name))
        .await
        .map_err(|err| {
            ApiError::Request(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                err.to_string(),
            )
        })??;
    Ok((StatusCode::CREATED, Json(created)))
}

/// Revokes a token by id or name: the next request with it gets 401.
#[utoipa::path(delete, path = "/v1/tokens/{id}", tag = "tokens",
    params(("id" = String, Path, description = "Token id or name")),
    responses((status = 200, description = "Revoked", body = TokenView),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 403, description = "A read token", body = ApiErrorBody),
        (status = 404, description = "No such token", body = ApiErrorBody),
        (status = 409, description = "The bootstrap token (`not_revocable`)", body = ApiErrorBody)))]
pub(super) async fn revoke_token(
    State(state): State<ApiState>,
    super::ApiPath(id): super::ApiPath<String>,
) -> Result<Json<TokenView>, ApiError> {
    let tokens = std::sync::Arc::clone(&state.tokens);
    let revoked = tokio::task::spawn_blocking(move || tokens.revoke(&id))
        .await
        .map_err(|err| {
            ApiError::Request(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                err.to_string(),
            )
        })??;
    Ok(Json(revoked))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn bootstrap() -> ApiToken {
        ApiToken::new("bootstrap-token-0123456789").unwrap()
    }

    #[test]
    fn created_tokens_authenticate_with_their_scope_until_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api-tokens.json");
        let tokens = Tokens::open(bootstrap(), Some(path.clone())).unwrap();
        let read = tokens.create(Scope::Read, Some("grafana".into())).unwrap();
        let admin = tokens.create(Scope::Admin, None).unwrap();
        assert_eq!(
            tokens.authenticate(read.secret.as_bytes()).unwrap().scope,
            Scope::Read
        );
        assert_eq!(
            tokens.authenticate(admin.secret.as_bytes()).unwrap().id,
            admin.token.id
        );
        assert_eq!(
            tokens
                .authenticate(b"bootstrap-token-0123456789")
                .unwrap()
                .id,
            BOOTSTRAP_ID
        );
        assert!(tokens.authenticate(b"hrt_nothing").is_none());
        // Only the hash is stored.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&read.secret[4..]), "{text}");
        // Reopened, the tokens are still there; revoked, they are gone at once.
        let reopened = Tokens::open(bootstrap(), Some(path.clone())).unwrap();
        assert!(reopened.authenticate(read.secret.as_bytes()).is_some());
        assert_eq!(reopened.revoke("grafana").unwrap().id, read.token.id);
        assert!(reopened.authenticate(read.secret.as_bytes()).is_none());
        assert!(reopened.authenticate(admin.secret.as_bytes()).is_some());
        let again = Tokens::open(bootstrap(), Some(path)).unwrap();
        assert!(again.authenticate(read.secret.as_bytes()).is_none());
        assert_eq!(again.list().len(), 2, "bootstrap + admin");
    }

    #[test]
    fn names_are_checked_and_the_bootstrap_token_stays() {
        let tokens = Tokens::bootstrap_only(bootstrap());
        assert!(matches!(
            tokens.create(Scope::Read, Some("has space".into())),
            Err(TokensError::InvalidName(_))
        ));
        tokens.create(Scope::Read, Some("a".into())).unwrap();
        assert!(matches!(
            tokens.create(Scope::Admin, Some("a".into())),
            Err(TokensError::NameTaken(_))
        ));
        assert!(matches!(
            tokens.revoke(BOOTSTRAP_ID),
            Err(TokensError::Bootstrap)
        ));
        assert!(matches!(
            tokens.revoke("nobody"),
            Err(TokensError::NotFound(_))
        ));
    }

    #[test]
    fn read_allows_only_methods_that_change_nothing() {
        for method in [Method::GET, Method::HEAD] {
            assert!(Scope::Read.allows(&method));
        }
        for method in [
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
            Method::OPTIONS,
        ] {
            assert!(!Scope::Read.allows(&method), "{method}");
            assert!(Scope::Admin.allows(&method));
        }
    }

    #[test]
    fn sha256_is_sha256() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
