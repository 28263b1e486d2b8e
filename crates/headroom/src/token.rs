//! Where the management API's bearer token comes from, for the server and for the CLI.
//!
//! Server (`serve`, `demo`), first found wins:
//! 1. `$HEADROOM_TOKEN` in the server's environment;
//! 2. `[api] token` in the configuration file;
//! 3. the token file `DATA_DIR/api-token`, created at first start (32 bytes of `/dev/urandom`
//!    in hex, mode 0600) and reused ever after;
//! 4. with `--memory` and no data directory given: a fresh token for this run, printed once
//!    on stderr (there is nowhere to keep it).
//!
//! CLI (`volume ...`, `tenant ...`): `$HEADROOM_TOKEN`, else `--token-file FILE`, else
//! `DATA_DIR/api-token` with `--data-dir` defaulting to `serve`'s default, so the CLI run on
//! the server's machine by a user who may read the data directory needs no flag at all.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use headroom_node::api::ApiToken;

/// The environment variable both the server and the CLI read.
pub const TOKEN_ENV: &str = "HEADROOM_TOKEN";
/// The token file's name in the data directory.
pub const TOKEN_FILE: &str = "api-token";
/// The scoped tokens' file (hashes only) in the data directory (`headroom token ...`).
pub const TOKENS_FILE: &str = "api-tokens.json";
/// The API's audit log in the data directory (`[api] audit_log` moves it).
pub const AUDIT_LOG_FILE: &str = "audit.log";

/// What the server's configuration says about the token (from `serve_config::load`).
#[derive(Clone, Debug, Default)]
pub struct TokenSettings {
    /// `[api] token`, already checked.
    pub configured: Option<String>,
    /// The data directory whose token file to use; `None` with `--memory` and no data
    /// directory given.
    pub data_dir: Option<PathBuf>,
}

/// Where the server's token came from (logged at start; a generated one is printed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Environment,
    ConfigFile,
    /// Read from an existing token file.
    TokenFile(PathBuf),
    /// Written to a new token file.
    CreatedTokenFile(PathBuf),
    /// Made for this run only (`--memory` without a data directory).
    Ephemeral,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Environment => write!(f, "from {TOKEN_ENV}"),
            Origin::ConfigFile => write!(f, "from the configuration file ([api] token)"),
            Origin::TokenFile(path) => write!(f, "from {}", path.display()),
            Origin::CreatedTokenFile(path) => write!(f, "created in {}", path.display()),
            Origin::Ephemeral => write!(f, "generated for this run (not saved)"),
        }
    }
}

/// `$HEADROOM_TOKEN`, unless unset or empty.
fn env_token() -> Option<String> {
    std::env::var(TOKEN_ENV)
        .ok()
        .filter(|t| !t.trim().is_empty())
}

/// The server's token (module doc, "Server").
pub fn server_token(settings: &TokenSettings) -> Result<(ApiToken, Origin)> {
    if let Some(text) = env_token() {
        let token = ApiToken::new(&text).context(TOKEN_ENV)?;
        return Ok((token, Origin::Environment));
    }
    if let Some(text) = &settings.configured {
        let token = ApiToken::new(text).context("[api] token")?;
        return Ok((token, Origin::ConfigFile));
    }
    match &settings.data_dir {
        Some(dir) => load_or_create(dir),
        None => Ok((ApiToken::random()?, Origin::Ephemeral)),
    }
}

/// Reads `DIR/api-token`, or creates it (mode 0600) with a random token.
pub fn load_or_create(dir: &Path) -> Result<(ApiToken, Origin)> {
    let path = dir.join(TOKEN_FILE);
    if path.exists() {
        return Ok((read_token_file(&path)?, Origin::TokenFile(path)));
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the data directory {}", dir.display()))?;
    let token = ApiToken::random()?;
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path);
    let mut file = match created {
        Ok(file) => file,
        // Another process made it between our look and our create: use theirs.
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
            return Ok((read_token_file(&path)?, Origin::TokenFile(path)));
        }
        Err(err) => {
            return Err(err).with_context(|| format!("creating the token file {}", path.display()));
        }
    };
    file.write_all(format!("{}\n", token.expose()).as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing the token file {}", path.display()))?;
    Ok((token, Origin::CreatedTokenFile(path)))
}

/// Reads and checks a token file; warns when others may read it.
pub fn read_token_file(path: &Path) -> Result<ApiToken> {
    let metadata = std::fs::metadata(path)
        .with_context(|| format!("reading the token file {}", path.display()))?;
    if metadata.len() > 4096 {
        bail!(
            "the token file {} is {} bytes; a token file holds one token",
            path.display(),
            metadata.len()
        );
    }
    let mode = metadata.permissions().mode();
    if mode & 0o077 != 0 {
        tracing::warn!(
            "the token file {} is readable by others (mode {:o}): chmod 600 it",
            path.display(),
            mode & 0o777
        );
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the token file {}", path.display()))?;
    ApiToken::new(&text).with_context(|| format!("the token file {}", path.display()))
}

/// The token the CLI found, and where it looked (for the hint on a 401).
#[derive(Clone, Debug)]
pub enum Found {
    Environment(ApiToken),
    File(PathBuf, ApiToken),
    /// No token: `HEADROOM_TOKEN` unset and no token file at this path.
    Nothing(PathBuf),
}

impl Found {
    pub fn token(&self) -> Option<&ApiToken> {
        match self {
            Found::Environment(token) | Found::File(_, token) => Some(token),
            Found::Nothing(_) => None,
        }
    }

    /// Where the token came from, in a sentence.
    pub fn describe(&self) -> String {
        match self {
            Found::Environment(_) => format!("The token came from {TOKEN_ENV}"),
            Found::File(path, _) => format!("The token came from {}", path.display()),
            Found::Nothing(path) => format!(
                "No token was sent: {TOKEN_ENV} is not set and there is no {}",
                path.display()
            ),
        }
    }
}

/// The CLI's token (module doc, "CLI"). A token file named with `--token-file` must be
/// readable; the data directory's is used when present.
pub fn client_token(token_file: Option<&Path>, data_dir: &Path) -> Result<Found> {
    if let Some(text) = env_token() {
        let token = ApiToken::new(&text).context(TOKEN_ENV)?;
        return Ok(Found::Environment(token));
    }
    if let Some(path) = token_file {
        return Ok(Found::File(path.to_path_buf(), read_token_file(path)?));
    }
    let path = data_dir.join(TOKEN_FILE);
    match std::fs::metadata(&path) {
        Ok(_) => Ok(Found::File(path.clone(), read_token_file(&path)?)),
        Err(_) => Ok(Found::Nothing(path)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn token_file_is_created_private_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let (first, origin) = load_or_create(&data).unwrap();
        assert_eq!(origin, Origin::CreatedTokenFile(data.join(TOKEN_FILE)));
        let mode = std::fs::metadata(data.join(TOKEN_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let (second, origin) = load_or_create(&data).unwrap();
        assert_eq!(origin, Origin::TokenFile(data.join(TOKEN_FILE)));
        assert_eq!(first, second);
    }

    #[test]
    fn a_bad_token_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TOKEN_FILE);
        std::fs::write(&path, "short\n").unwrap();
        assert!(read_token_file(&path).is_err());
    }
}
