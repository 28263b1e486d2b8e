//! `[server]`: the listeners and the threads that carry requests. Each key is declared once
//! here: its file name (serde), its flag (clap), its help (the doc comment), its check and
//! where it lands in the `NodeConfig`. The NBD Unix socket's keys (`nbd_unix`, its mode,
//! owner and uid map) are here too, beside the TCP listener they stand beside or replace.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use clap::Args;
use headroom_node::{NodeConfig, UnixSocketConfig, setting};
use merge::Merge;
use serde::{Deserialize, Deserializer};

use super::{Invalid, Size};

/// `[server]`: listeners and the I/O threads.
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct ServerSection {
    /// NBD listen address, or `off` for no TCP listener (then --nbd-unix is the only way in)
    /// [default: 127.0.0.1:10809].
    #[arg(long, value_name = "ADDR|off")]
    pub nbd_listen: Option<NbdListen>,
    /// Also serve NBD on a Unix socket at PATH (nbd+unix:///EXPORT?socket=PATH); a stale
    /// socket there is replaced, any other file refused [default: none].
    #[arg(long, value_name = "PATH")]
    pub nbd_unix: Option<PathBuf>,
    /// The Unix socket's permission bits, octal (`0660`: its owner and group may connect)
    /// [default: what the umask leaves].
    #[arg(long, value_name = "MODE")]
    pub nbd_unix_mode: Option<FileMode>,
    /// The Unix socket's owner: UID, UID:GID or :GID, numeric (changing the owner needs
    /// root) [default: the server's].
    #[arg(long, value_name = "UID[:GID]")]
    pub nbd_unix_owner: Option<SocketOwner>,
    /// The tenant a Unix socket client acts for by its uid (SO_PEERCRED): UID=TENANT
    /// (repeatable); other uids are anonymous, like a TCP client without TLS. Taken whole
    /// from the highest layer that has it.
    #[arg(long = "nbd-unix-tenant", value_name = "UID=TENANT")]
    #[serde(deserialize_with = "de_uid_tenants")]
    pub nbd_unix_tenants: Option<Vec<UidTenant>>,
    /// Management API listen address [default: 127.0.0.1:10810].
    #[arg(long, value_name = "ADDR")]
    pub api_listen: Option<SocketAddr>,
    /// Worker threads executing block I/O (0 = inline on the network threads) [default: 2].
    #[arg(long, value_name = "N")]
    pub io_threads: Option<usize>,
    /// Requests moving at most this many bytes run inline on the network threads
    /// [default: 64KiB when every device is in RAM (--memory, or device files on tmpfs), else 0].
    #[arg(long, value_name = "SIZE")]
    pub inline_max_bytes: Option<Size>,
    /// Microseconds a network thread about to sleep waits for more requests, to answer
    /// several per wake-up; adaptive, 0 = off
    /// [default: 10 with --memory or --rados-conf, 0 with device files].
    #[arg(long, value_name = "US")]
    pub coalesce_us: Option<u64>,
    /// Threads that own the NBD connections and the vhost-user-blk queues (each lives on
    /// one, reader and writer together); 0 = they share the async runtime's threads
    /// [default: one per CPU].
    #[arg(long, value_name = "N")]
    pub net_threads: Option<usize>,
}

/// `server.nbd_listen`: an address, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NbdListen {
    Addr(SocketAddr),
    Off,
}

impl FromStr for NbdListen {
    type Err = String;

    fn from_str(s: &str) -> Result<NbdListen, String> {
        if s == "off" {
            return Ok(NbdListen::Off);
        }
        s.parse().map(NbdListen::Addr).map_err(|_| {
            format!("{s:?} is neither an address (127.0.0.1:10809, [::1]:10809) nor \"off\"")
        })
    }
}

impl<'de> Deserialize<'de> for NbdListen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<NbdListen, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// `server.nbd_unix_mode`: permission bits, written in octal (a string `"0660"` in the
/// file and on the command line; a TOML octal integer `0o660` also works).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileMode(pub u32);

impl FromStr for FileMode {
    type Err = String;

    fn from_str(s: &str) -> Result<FileMode, String> {
        let digits = s.strip_prefix("0o").unwrap_or(s);
        u32::from_str_radix(digits, 8)
            .map(FileMode)
            .map_err(|_| format!("{s:?} is not an octal mode such as 0660"))
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<FileMode, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Number(u32),
        }
        match Raw::deserialize(d)? {
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
            Raw::Number(n) => Ok(FileMode(n)),
        }
    }
}

/// `server.nbd_unix_owner`: `UID`, `UID:GID` or `:GID`, numeric (names would need the
/// system's user database at start; `id -u NAME` gives the number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketOwner {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl FromStr for SocketOwner {
    type Err = String;

    fn from_str(s: &str) -> Result<SocketOwner, String> {
        let bad = || format!("{s:?} is not UID, UID:GID or :GID (numbers; `id -u NAME` gives one)");
        let number = |part: &str| -> Result<Option<u32>, String> {
            match part {
                "" => Ok(None),
                n => n.parse().map(Some).map_err(|_| bad()),
            }
        };
        let (uid, gid) = match s.split_once(':') {
            Some((uid, gid)) => (number(uid)?, number(gid)?),
            None => (number(s)?, None),
        };
        if uid.is_none() && gid.is_none() {
            return Err(bad());
        }
        Ok(SocketOwner { uid, gid })
    }
}

impl<'de> Deserialize<'de> for SocketOwner {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SocketOwner, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// One entry of `server.nbd_unix_tenants`: a local uid and the tenant its connections act
/// for (in the file a table `"UID" = "tenant"`, on the command line `UID=TENANT`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UidTenant {
    pub uid: u32,
    pub tenant: String,
}

impl FromStr for UidTenant {
    type Err = String;

    fn from_str(pair: &str) -> Result<UidTenant, String> {
        let (uid, tenant) = pair
            .split_once('=')
            .ok_or_else(|| format!("{pair:?} is not UID=TENANT"))?;
        Ok(UidTenant {
            uid: parse_uid(uid)?,
            tenant: tenant.to_string(),
        })
    }
}

fn parse_uid(uid: &str) -> Result<u32, String> {
    uid.parse()
        .map_err(|_| format!("{uid:?} is not a numeric uid (`id -u NAME` gives one)"))
}

fn de_uid_tenants<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<UidTenant>>, D::Error> {
    let map = BTreeMap::<String, String>::deserialize(d)?;
    map.into_iter()
        .map(|(uid, tenant)| {
            Ok(UidTenant {
                uid: parse_uid(&uid).map_err(serde::de::Error::custom)?,
                tenant,
            })
        })
        .collect::<Result<Vec<_>, D::Error>>()
        .map(Some)
}

impl ServerSection {
    /// The Unix socket the layer asks for, checked whole (its keys may come from different
    /// layers, so this runs on the merged one): the node's rules on the values
    /// (`UnixSocketConfig::validate`), and the keys that need `nbd_unix`.
    pub(super) fn unix_config(&self) -> Result<Option<UnixSocketConfig>, Invalid> {
        let Some(path) = &self.nbd_unix else {
            let orphan = [
                ("server.nbd_unix_mode", self.nbd_unix_mode.is_some()),
                ("server.nbd_unix_owner", self.nbd_unix_owner.is_some()),
                ("server.nbd_unix_tenants", self.nbd_unix_tenants.is_some()),
                ("server.nbd_listen", self.nbd_listen == Some(NbdListen::Off)),
            ]
            .into_iter()
            .find_map(|(key, set)| set.then_some(key));
            return match orphan {
                Some(key) => Err(Invalid::new(key, "", "needs server.nbd_unix (--nbd-unix)")),
                None => Ok(None),
            };
        };
        let mut tenants = BTreeMap::new();
        for entry in self.nbd_unix_tenants.iter().flatten() {
            if tenants.insert(entry.uid, entry.tenant.clone()).is_some() {
                return Err(Invalid::new(
                    "server.nbd_unix_tenants",
                    entry.uid,
                    "a uid may be mapped once",
                ));
            }
        }
        let config = UnixSocketConfig {
            path: path.clone(),
            mode: self.nbd_unix_mode.map(|m| m.0),
            uid: self.nbd_unix_owner.and_then(|o| o.uid),
            gid: self.nbd_unix_owner.and_then(|o| o.gid),
            tenants,
        };
        config.validate()?;
        Ok(Some(config))
    }

    /// Checks every value on its own (the thread and wait rules are the node's:
    /// `headroom_node::setting`).
    pub(super) fn check(&self) -> Result<(), Invalid> {
        if let Some(FileMode(mode)) = self.nbd_unix_mode
            && mode > 0o777
        {
            return Err(Invalid::new(
                "server.nbd_unix_mode",
                format!("{mode:o} (octal)"),
                "permission bits only, 0 to 0777; write it as a string, \"0660\", or as 0o660",
            ));
        }
        if let Some(n) = self.io_threads {
            setting::check_io_threads(n)?;
        }
        if let Some(size) = self.inline_max_bytes
            && u32::try_from(size.0).is_err()
        {
            return Err(Invalid::new(
                "server.inline_max_bytes",
                size,
                "must be less than 4GiB",
            ));
        }
        if let Some(us) = self.coalesce_us {
            setting::check_coalesce_us(us)?;
        }
        if let Some(n) = self.net_threads {
            setting::check_net_threads(n)?;
        }
        Ok(())
    }

    /// Sets what this layer has over the node's defaults.
    pub(super) fn apply(&self, config: &mut NodeConfig) {
        match self.nbd_listen {
            Some(NbdListen::Addr(addr)) => config.nbd_listen = Some(addr),
            Some(NbdListen::Off) => config.nbd_listen = None,
            None => {}
        }
        if let Some(addr) = self.api_listen {
            config.api_listen = addr;
        }
        if let Some(n) = self.io_threads {
            config.io_threads = n;
        }
        if let Some(us) = self.coalesce_us {
            config.coalesce_us = Some(us);
        }
        if let Some(n) = self.net_threads {
            config.net_threads = Some(n);
        }
        // `check` made sure it fits.
        config.inline_max_bytes = self
            .inline_max_bytes
            .map(|s| u32::try_from(s.0).unwrap_or(u32::MAX));
    }
}
