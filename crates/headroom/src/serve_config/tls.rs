//! `[tls]`: TLS on the NBD port (needs a build with `--features tls`): the credentials, who a
//! client certificate acts for, the suites and the handshake rate, declared once here (file
//! name, flag, help, check, the node's [`TlsConfig`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::str::FromStr;

use clap::Args;
use headroom_node::TlsConfig;
use merge::Merge;
use serde::{Deserialize, Deserializer};

use super::Invalid;

/// `[tls]`: TLS on the NBD port (needs a build with `--features tls`).
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct TlsSection {
    /// Offer TLS with these pre-shared keys: `identity:hexkey` lines, as qemu's `keys.psk`
    /// (needs a build with --features tls).
    #[arg(long = "tls-psk-file", value_name = "FILE")]
    pub psk_file: Option<PathBuf>,
    /// Offer TLS with the X.509 credentials in DIR: server-cert.pem, server-key.pem, and
    /// ca-cert.pem to require and verify client certificates (qemu's layout).
    #[arg(long = "tls-cert-dir", value_name = "DIR")]
    pub cert_dir: Option<PathBuf>,
    /// Refuse clients that do not start TLS (NBD_REP_ERR_TLS_REQD).
    #[arg(long = "tls-required", num_args = 0, default_missing_value = "true")]
    pub required: Option<bool>,
    /// The tenant a client certificate acts for: CN=TENANT, split at the first `=`
    /// (repeatable; required with ca-cert.pem; a CN holding `=` needs the configuration
    /// file's [tls.certificate_tenants]). Taken whole from the highest layer that has it.
    #[arg(long = "tls-cert-tenant", value_name = "CN=TENANT")]
    #[serde(deserialize_with = "de_certificate_tenants")]
    pub certificate_tenants: Option<Vec<CertificateTenant>>,
    /// Also offer TLS 1.2 suites without forward secrecy (plain PSK) and CBC suites.
    #[arg(
        long = "tls-legacy-ciphers",
        num_args = 0,
        default_missing_value = "true"
    )]
    pub legacy_cipher_suites: Option<bool>,
    /// TLS handshakes per second per client address group (bursts of twice); 0: no limit.
    #[arg(skip)]
    pub handshakes_per_s_per_address: Option<u32>,
}

/// One entry of `tls.certificate_tenants`: a client certificate's common name and the tenant
/// it acts for (in the file a table `"CN" = "tenant"`, on the command line `CN=TENANT`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertificateTenant {
    pub common_name: String,
    pub tenant: String,
}

impl FromStr for CertificateTenant {
    type Err = String;

    /// Split at the first `=`; without one the tenant is empty, which the check refuses
    /// naming the key.
    fn from_str(pair: &str) -> Result<CertificateTenant, String> {
        let (cn, tenant) = pair.split_once('=').unwrap_or((pair, ""));
        Ok(CertificateTenant {
            common_name: cn.to_string(),
            tenant: tenant.to_string(),
        })
    }
}

fn de_certificate_tenants<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<CertificateTenant>>, D::Error> {
    let map = BTreeMap::<String, String>::deserialize(d)?;
    Ok(Some(
        map.into_iter()
            .map(|(common_name, tenant)| CertificateTenant {
                common_name,
                tenant,
            })
            .collect(),
    ))
}

impl TlsSection {
    /// `None` unless credentials are given; `tls.required` alone has nothing to require.
    pub(super) fn tls_config(&self) -> Result<Option<TlsConfig>, Invalid> {
        let t = self;
        let required = t.required.unwrap_or(false);
        let legacy = t.legacy_cipher_suites.unwrap_or(false);
        let asked = t.psk_file.is_some()
            || t.cert_dir.is_some()
            || required
            || legacy
            || t.certificate_tenants.is_some()
            || t.handshakes_per_s_per_address.is_some();
        if !headroom_node::TLS_SUPPORTED && asked {
            return Err(Invalid::new(
                "tls",
                "",
                "this headroom was built without TLS; rebuild with --features tls \
             (cargo build --release -p headroom --features tls; needs libssl-dev and pkg-config)",
            ));
        }
        if t.psk_file.is_none() && t.cert_dir.is_none() {
            if required {
                return Err(Invalid::new(
                    "tls.required",
                    true,
                    "needs tls.psk_file or tls.cert_dir (--tls-psk-file, --tls-cert-dir)",
                ));
            }
            if let Some(key) = [
                ("tls.legacy_cipher_suites", legacy),
                ("tls.certificate_tenants", t.certificate_tenants.is_some()),
                (
                    "tls.handshakes_per_s_per_address",
                    t.handshakes_per_s_per_address.is_some(),
                ),
            ]
            .into_iter()
            .find_map(|(key, set)| set.then_some(key))
            {
                return Err(Invalid::new(
                    key,
                    "",
                    "needs tls.psk_file or tls.cert_dir (--tls-psk-file, --tls-cert-dir)",
                ));
            }
            return Ok(None);
        }
        let certificate_tenants: Option<BTreeMap<String, String>> =
            t.certificate_tenants.as_ref().map(|pairs| {
                pairs
                    .iter()
                    .map(|p| (p.common_name.clone(), p.tenant.clone()))
                    .collect()
            });
        if let Some(map) = &certificate_tenants {
            for (cn, tenant) in map {
                if cn.is_empty() || cn.len() > 1024 {
                    return Err(Invalid::new(
                        "tls.certificate_tenants",
                        cn,
                        "a certificate common name of 1 to 1024 bytes",
                    ));
                }
                headroom_store::validate_tenant_id(tenant).map_err(|e| {
                    Invalid::new(
                        "tls.certificate_tenants",
                        tenant,
                        format!("a tenant id for CN {cn:?} ({e})"),
                    )
                })?;
            }
        }
        Ok(Some(TlsConfig {
            psk_file: t.psk_file.clone(),
            cert_dir: t.cert_dir.clone(),
            required,
            certificate_tenants,
            legacy_cipher_suites: legacy,
            handshakes_per_s_per_address: t
                .handshakes_per_s_per_address
                .unwrap_or(headroom_node::handshake_limit::DEFAULT_HANDSHAKES_PER_S_PER_ADDRESS),
        }))
    }
}
