//! Decodes the raw state of a RADOS `cls_lock` lock (the xattr `lock.<name>` of the locked
//! object): who held it, with the client address the OSD recorded from that client's
//! connection.
//!
//! Why raw bytes: lease.rs fences the node that held the lease before it. While the lock is
//! held, `rados_list_lockers` names the holder; but cls_lock drops expired lockers whenever
//! it reads the lock (cls_lock.cc, `read_lock`), so a node that starts only after the lease
//! expired never sees the holder through that call. The xattr itself keeps the expired
//! locker until the next lock call rewrites it, so the node reads it and decodes it here.
//! The address comes from the OSD, not from anything a client wrote (docs/ARCHITECTURE.md,
//! decision 44).
//!
//! **Encoding** (Ceph's `encode`, little-endian; cls/lock/cls_lock_types.h, msg_types.h):
//! `cls_lock_info_t` = ENCODE_START header (u8 struct_v, u8 compat, u32 length), then
//! `map<locker_id_t, locker_info_t>` (u32 count, then pairs), u8 lock type, string tag.
//! `locker_id_t` = header, `entity_name_t` (u8 type, i64 num), string cookie.
//! `locker_info_t` = header, `utime_t` expiration (u32 s, u32 ns), `entity_addr_t`, string
//! description. `entity_addr_t` = u8 marker 1, header, u32 type, u32 nonce, u32 sockaddr
//! length, then the sockaddr with its family as a little-endian u16 (marker 0: the legacy
//! form, u8 0 + 3 pad bytes, u32 nonce, 128-byte sockaddr_storage with a big-endian
//! family). Strings are a u32 length and the bytes. Every length is checked against what is
//! left, so a short or corrupt value is an error, never a read out of bounds; fields a
//! newer Ceph appends inside a header's length are skipped.

use std::net::{Ipv4Addr, Ipv6Addr};

/// One holder of a lock, as the xattr records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LockHolder {
    /// `client.<num>` (entity type 8 is a client).
    pub(crate) client: String,
    pub(crate) cookie: String,
    /// As `rados_list_lockers` and `ceph osd blocklist` write it: `IP:PORT/NONCE`
    /// (`[IPv6]:PORT/NONCE`).
    pub(crate) addr: String,
    /// When the lock runs out, seconds since the epoch (`Some(0)`: never; `None`: not
    /// known, as from `rados_list_lockers`).
    pub(crate) expires_unix_s: Option<u32>,
}

/// Why the bytes are not a lock this decoder understands.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("cannot decode the lock's state (cls_lock_info_t) at byte {at}: {what}")]
pub(crate) struct DecodeError {
    at: usize,
    what: String,
}

/// The struct versions this decoder reads (every one Ceph has had so far is 1).
const MAX_COMPAT: u8 = 1;
/// `entity_addr_t` families: AF_INET, AF_INET6 (Linux numbering, which Ceph puts on the wire).
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
/// Most lockers accepted (an exclusive lock has one; this bounds allocation on bad input).
const MAX_LOCKERS: u32 = 1024;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Where the innermost open ENCODE_START section ends.
    ends: Vec<usize>,
}

impl<'a> Reader<'a> {
    fn fail<T>(&self, what: impl Into<String>) -> Result<T, DecodeError> {
        Err(DecodeError {
            at: self.at,
            what: what.into(),
        })
    }

    fn limit(&self) -> usize {
        self.ends.last().copied().unwrap_or(self.bytes.len())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = match self.at.checked_add(n) {
            Some(end) if end <= self.limit() => end,
            _ => return self.fail(format!("{n} more bytes needed, the value ends first")),
        };
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn i64(&mut self) -> Result<i64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(i64::from_le_bytes(a))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => self.fail("a string that is not UTF-8"),
        }
    }

    /// ENCODE_START: checks the version and opens a section of the given length.
    fn start(&mut self, what: &str) -> Result<(), DecodeError> {
        let _struct_v = self.u8()?;
        let compat = self.u8()?;
        if compat > MAX_COMPAT {
            return self.fail(format!(
                "{what} needs a decoder of version {compat} (this one reads {MAX_COMPAT})"
            ));
        }
        let len = self.u32()? as usize;
        let end = match self.at.checked_add(len) {
            Some(end) if end <= self.limit() => end,
            _ => return self.fail(format!("{what} claims {len} bytes, more than are left")),
        };
        self.ends.push(end);
        Ok(())
    }

    /// ENCODE_FINISH: skips what a newer encoder appended, closes the section.
    fn finish(&mut self) {
        if let Some(end) = self.ends.pop() {
            self.at = end;
        }
    }

    fn addr(&mut self) -> Result<String, DecodeError> {
        let marker = self.u8()?;
        let (nonce, family, data): (u32, u16, &[u8]) = match marker {
            1 => {
                self.start("entity_addr_t")?;
                let _type = self.u32()?;
                let nonce = self.u32()?;
                let len = self.u32()? as usize;
                if len < 2 {
                    return self.fail(format!("a sockaddr of {len} bytes"));
                }
                let family = self.u16()?;
                let data = self.take(len - 2)?;
                self.finish();
                (nonce, family, data)
            }
            0 => {
                self.take(3)?;
                let nonce = self.u32()?;
                let storage = self.take(128)?;
                let family = u16::from_be_bytes([storage[0], storage[1]]);
                (nonce, family, &storage[2..])
            }
            m => return self.fail(format!("an address marker {m} (not 0 or 1)")),
        };
        // sockaddr_in: port (network order), address; sockaddr_in6: port, flowinfo, address.
        match family {
            AF_INET if data.len() >= 6 => {
                let port = u16::from_be_bytes([data[0], data[1]]);
                let ip = Ipv4Addr::new(data[2], data[3], data[4], data[5]);
                Ok(format!("{ip}:{port}/{nonce}"))
            }
            AF_INET6 if data.len() >= 22 => {
                let port = u16::from_be_bytes([data[0], data[1]]);
                let mut octets = [0u8; 16];
                octets.copy_from_slice(&data[6..22]);
                Ok(format!("[{}]:{port}/{nonce}", Ipv6Addr::from(octets)))
            }
            f => self.fail(format!(
                "an address of family {f} and {} bytes (not IPv4 or IPv6)",
                data.len()
            )),
        }
    }
}

/// Every holder the raw lock state `bytes` records, expired ones included.
pub(crate) fn decode_holders(bytes: &[u8]) -> Result<Vec<LockHolder>, DecodeError> {
    let mut r = Reader {
        bytes,
        at: 0,
        ends: Vec::new(),
    };
    r.start("cls_lock_info_t")?;
    let count = r.u32()?;
    if count > MAX_LOCKERS {
        return r.fail(format!("{count} lockers (at most {MAX_LOCKERS} expected)"));
    }
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        r.start("locker_id_t")?;
        let entity_type = r.u8()?;
        let num = r.i64()?;
        let cookie = r.string()?;
        r.finish();
        r.start("locker_info_t")?;
        let expires_unix_s = r.u32()?;
        let _ns = r.u32()?;
        let addr = r.addr()?;
        let _description = r.string()?;
        r.finish();
        let kind = match entity_type {
            8 => "client",
            4 => "osd",
            1 => "mon",
            2 => "mds",
            _ => "entity",
        };
        out.push(LockHolder {
            client: format!("{kind}.{num}"),
            cookie,
            addr,
            expires_unix_s: Some(expires_unix_s),
        });
    }
    let _lock_type = r.u8()?;
    let _tag = r.string()?;
    r.finish();
    if r.at != bytes.len() {
        return r.fail(format!("{} bytes after the lock", bytes.len() - r.at));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Captured from the test cluster (Ceph 16.2.15): `rados getxattr lease lock.headroom`
    /// after `rados lock get lease headroom --lock-cookie 4242-headroom-00112233aabbccdd
    /// --lock-description "headroom lease" --lock-duration 3`, while `rados lock info` said
    /// `client.4240`, addr `127.0.0.1:0/2610098069`. The same bytes were still there after
    /// the lock expired (when `lock info` listed no locker any more).
    const CAPTURED: &[u8] = include_bytes!("../tests/fixtures/cls_lock_info.headroom.bin");

    fn captured_holder() -> LockHolder {
        LockHolder {
            client: "client.4240".into(),
            cookie: "4242-headroom-00112233aabbccdd".into(),
            addr: "127.0.0.1:0/2610098069".into(),
            expires_unix_s: Some(0x6b0f_8e39),
        }
    }

    #[test]
    fn decodes_the_bytes_the_cluster_wrote() {
        assert_eq!(decode_holders(CAPTURED).unwrap(), vec![captured_holder()]);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        for n in 0..CAPTURED.len() {
            assert!(decode_holders(&CAPTURED[..n]).is_err(), "{n} bytes decoded");
        }
        let mut longer = CAPTURED.to_vec();
        longer.push(0);
        let e = decode_holders(&longer).unwrap_err().to_string();
        assert!(e.contains("1 bytes after the lock"), "{e}");
    }

    #[test]
    fn every_single_byte_change_decodes_or_fails_cleanly() {
        // No input may panic or read past the end; most changes are refused.
        for i in 0..CAPTURED.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut b = CAPTURED.to_vec();
                b[i] = v;
                let _ = decode_holders(&b);
            }
        }
    }

    #[test]
    fn a_newer_compat_version_and_bad_markers_are_refused() {
        let mut b = CAPTURED.to_vec();
        b[1] = 2;
        let e = decode_holders(&b).unwrap_err().to_string();
        assert!(e.contains("version 2"), "{e}");
        // The address marker: byte 0x49 of the capture.
        let mut b = CAPTURED.to_vec();
        assert_eq!(b[0x49], 1, "the marker of the captured address");
        b[0x49] = 7;
        let e = decode_holders(&b).unwrap_err().to_string();
        assert!(e.contains("address marker 7"), "{e}");
    }

    /// A lock without lockers (what an unlock leaves).
    #[test]
    fn an_empty_lock_has_no_holders() {
        let empty = [1u8, 1, 9, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        assert_eq!(decode_holders(&empty).unwrap(), vec![]);
    }

    /// The IPv6 and legacy encodings of the address.
    #[test]
    fn ipv6_and_legacy_addresses() {
        // marker 1, struct_v 1, compat 1, then the u32 length of what follows.
        let mut addr6 = vec![1u8, 1, 1, 0, 0, 0, 0];
        // type 1, nonce 7, len 28, family 10, port 6800, flowinfo, ::1, scope
        let mut body = Vec::new();
        body.extend(1u32.to_le_bytes());
        body.extend(7u32.to_le_bytes());
        body.extend(28u32.to_le_bytes());
        body.extend(AF_INET6.to_le_bytes());
        body.extend(6800u16.to_be_bytes());
        body.extend([0u8; 4]);
        body.extend(Ipv6Addr::LOCALHOST.octets());
        body.extend([0u8; 4]);
        addr6[3..7].copy_from_slice(&(body.len() as u32).to_le_bytes());
        addr6.extend(&body);
        let mut r = Reader {
            bytes: &addr6,
            at: 0,
            ends: Vec::new(),
        };
        assert_eq!(r.addr().unwrap(), "[::1]:6800/7");
        let mut legacy = vec![0u8, 0, 0, 0];
        legacy.extend(9u32.to_le_bytes());
        let mut storage = [0u8; 128];
        storage[0..2].copy_from_slice(&AF_INET.to_be_bytes());
        storage[2..4].copy_from_slice(&6789u16.to_be_bytes());
        storage[4..8].copy_from_slice(&[10, 0, 0, 1]);
        legacy.extend(storage);
        let mut r = Reader {
            bytes: &legacy,
            at: 0,
            ends: Vec::new(),
        };
        assert_eq!(r.addr().unwrap(), "10.0.0.1:6789/9");
    }
}
