//! The `cls_lock` guard a metadata commit carries: `lock.assert_locked`, run by the OSD in
//! the same compound write operation as the commit, so the commit applies only while this
//! node's exclusive lock on the object is current (not expired, not taken over).
//!
//! Why: fencing rests on blocklisting the previous holder (lease.rs), and a blocklist entry
//! ends; a node paused past it whose librados resends a commit would land it over its
//! successor's. The assertion is checked by the OSD against the lock itself, at the moment
//! the write applies, whatever the blocklist says. cls_lock guards only operations on the
//! locked object, so the node holds its lock on the metadata object as well as on `lease`.
//!
//! **Encoding** (Ceph's `encode`, little-endian; cls/lock/cls_lock_ops.h,
//! `cls_lock_assert_op`): ENCODE_START(1, 1) (u8 struct_v 1, u8 compat 1, u32 length of what
//! follows), string name, u8 lock type (1: exclusive), string cookie, string tag (empty:
//! `rados_lock_exclusive` takes no tag). Strings are a u32 length and the bytes.

/// `cls_lock`'s exclusive lock type.
const LOCK_EXCLUSIVE: u8 = 1;

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s);
}

/// The input of `lock.assert_locked` for the exclusive lock `name` held with `cookie`.
pub(crate) fn encode_assert_exclusive(name: &[u8], cookie: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(16 + name.len() + cookie.len());
    put_string(&mut body, name);
    body.push(LOCK_EXCLUSIVE);
    put_string(&mut body, cookie);
    put_string(&mut body, b"");
    let mut out = Vec::with_capacity(6 + body.len());
    out.extend_from_slice(&[1, 1]);
    out.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_assert_op_is_ceph_s_encoding() {
        let bytes = encode_assert_exclusive(b"headroom", b"c1");
        let mut want = vec![1u8, 1, 23, 0, 0, 0];
        want.extend_from_slice(&[8, 0, 0, 0]);
        want.extend_from_slice(b"headroom");
        want.push(1);
        want.extend_from_slice(&[2, 0, 0, 0]);
        want.extend_from_slice(b"c1");
        want.extend_from_slice(&[0, 0, 0, 0]);
        assert_eq!(bytes, want);
    }
}
