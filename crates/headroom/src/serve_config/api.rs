//! `[api]`: the management API's token, connection cap, read timeouts and audit log,
//! declared once here (file name, help, check, the node's `ApiLimits`). None has a flag: the
//! token belongs in the environment or the token file, not in a process listing.

use std::fmt;
use std::path::PathBuf;

use clap::Args;
use headroom_node::NodeConfig;
use headroom_node::api::conn::ApiLimits;
use merge::Merge;
use serde::Deserialize;

use super::Invalid;

/// `[api]`: the management API.
#[derive(Args, Clone, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct ApiSection {
    /// The bearer token (under `$HEADROOM_TOKEN`, over the data directory's token file).
    #[arg(skip)]
    pub token: Option<String>,
    /// Most API connections at once (lowered at start to keep the descriptor reserve).
    #[arg(skip)]
    pub max_connections: Option<usize>,
    /// From accept (or a later request's first byte) to the request's complete head.
    #[arg(skip)]
    pub header_read_timeout_ms: Option<u64>,
    /// From a request's head to the end of its body.
    #[arg(skip)]
    pub body_read_timeout_ms: Option<u64>,
    /// A kept-alive connection between requests.
    #[arg(skip)]
    pub idle_timeout_ms: Option<u64>,
    /// The audit log of changes [default: DATA_DIR/audit.log].
    #[arg(skip)]
    pub audit_log: Option<PathBuf>,
}

impl fmt::Debug for ApiSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiSection")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("max_connections", &self.max_connections)
            .field("header_read_timeout_ms", &self.header_read_timeout_ms)
            .field("body_read_timeout_ms", &self.body_read_timeout_ms)
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .field("audit_log", &self.audit_log)
            .finish()
    }
}

impl ApiSection {
    /// Checks every value on its own.
    pub(super) fn check(&self) -> Result<(), Invalid> {
        if let Some(token) = &self.token {
            headroom_node::api::ApiToken::new(token)
                .map_err(|err| Invalid::new("api.token", "(hidden)", err.to_string()))?;
        }
        // The node's rule, on this layer's values over the defaults (which pass it).
        self.limits().validate()?;
        Ok(())
    }

    /// The connection cap and timeouts over [`ApiLimits::default`].
    pub(super) fn apply(&self, config: &mut NodeConfig) {
        config.api_limits = self.limits();
    }

    fn limits(&self) -> ApiLimits {
        let d = ApiLimits::default();
        ApiLimits {
            max_connections: self.max_connections.unwrap_or(d.max_connections),
            header_read_timeout_ms: self
                .header_read_timeout_ms
                .unwrap_or(d.header_read_timeout_ms),
            body_read_timeout_ms: self.body_read_timeout_ms.unwrap_or(d.body_read_timeout_ms),
            idle_timeout_ms: self.idle_timeout_ms.unwrap_or(d.idle_timeout_ms),
        }
    }
}
