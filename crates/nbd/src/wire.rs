//! Bounds-checked big-endian reading and the spec's string rules.
//!
//! Why: every decoder in this crate walks untrusted bytes. Funnelling all reads through
//! one cursor that returns `None` instead of indexing out of range is what lets the
//! decoders promise "never panic on any input" without sprinkling checks everywhere.

use crate::consts::MAX_STRING_BYTES;

/// A forward-only cursor over an input slice. Every read is bounds-checked.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { rest: buf }
    }

    /// Bytes not consumed yet.
    pub(crate) fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// Takes exactly `n` bytes, or `None` (consuming nothing) if fewer remain.
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.rest.len() {
            return None;
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Some(head)
    }

    fn take_array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, tail) = self.rest.split_first_chunk::<N>()?;
        self.rest = tail;
        Some(*head)
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.take_array::<2>().map(u16::from_be_bytes)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take_array::<4>().map(u32::from_be_bytes)
    }
}

/// Why a string from the client was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StringError {
    /// "MUST be no longer than 4096 bytes".
    #[error("longer than {MAX_STRING_BYTES} bytes ({0} bytes)")]
    TooLong(usize),
    /// "a sequence of UTF-8 code points".
    #[error("not valid UTF-8")]
    NotUtf8,
    /// "MUST NOT contain `NUL` characters".
    #[error("contains a NUL character")]
    ContainsNul,
}

/// Validates an NBD string: "a sequence of UTF-8 code points, which is not `NUL`
/// terminated, MUST NOT contain `NUL` characters, SHOULD be no longer than 256 bytes
/// and MUST be no longer than 4096 bytes" (spec, Conventions).
pub(crate) fn parse_string(bytes: &[u8]) -> Result<&str, StringError> {
    if bytes.len() > MAX_STRING_BYTES {
        return Err(StringError::TooLong(bytes.len()));
    }
    let text = std::str::from_utf8(bytes).map_err(|_| StringError::NotUtf8)?;
    if text.contains('\0') {
        return Err(StringError::ContainsNul);
    }
    Ok(text)
}

/// The longest prefix of `text` that is at most `max_bytes` long and ends on a
/// character boundary. Used so that encoders never emit a string longer than the
/// spec allows and never split a UTF-8 sequence.
pub(crate) fn truncate_utf8(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        // `end > 0` here: index 0 is always a char boundary.
        end -= 1;
    }
    // `end` is a char boundary no larger than `text.len()`, so this cannot panic.
    let (head, _) = text.split_at(end);
    head
}

/// `len` as a `u32` length field, saturating; callers bound their inputs far below this.
pub(crate) fn len_u32(len: usize) -> u32 {
    // Clamped first, so the cast is exact.
    len.min(u32::MAX as usize) as u32
}

/// `len` as a `u16` length field, saturating.
pub(crate) fn len_u16(len: usize) -> u16 {
    // Clamped first, so the cast is exact.
    len.min(usize::from(u16::MAX)) as u16
}

/// The first `n` items of `items`, or all of them if there are fewer.
pub(crate) fn prefix<T>(items: &[T], n: usize) -> &[T] {
    let (head, _) = items.split_at(n.min(items.len()));
    head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_reads_big_endian_and_stops_at_the_end() {
        let bytes = [0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.u16(), Some(0x0102));
        assert_eq!(r.u32(), Some(0x0304_0506));
        assert_eq!(r.remaining(), 1);
        assert_eq!(r.u16(), None, "a short read must fail");
        assert_eq!(r.remaining(), 1, "a failed read consumes nothing");
        assert_eq!(r.take(2), None);
        assert_eq!(r.take(1), Some(&[0x07][..]));
        assert_eq!(r.u32(), None);
        assert_eq!(r.take(0), Some(&[][..]));
    }

    #[test]
    fn strings_follow_the_spec_rules() {
        assert_eq!(parse_string(b"vol1"), Ok("vol1"));
        assert_eq!(parse_string(b""), Ok(""));
        assert_eq!(parse_string(b"a\0b"), Err(StringError::ContainsNul));
        assert_eq!(parse_string(&[0xff, 0xfe]), Err(StringError::NotUtf8));
        let long = vec![b'a'; MAX_STRING_BYTES + 1];
        assert_eq!(parse_string(&long), Err(StringError::TooLong(4097)));
        let max = vec![b'a'; MAX_STRING_BYTES];
        assert!(parse_string(&max).is_ok());
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate_utf8("hello", 10), "hello");
        assert_eq!(truncate_utf8("hello", 3), "hel");
        // "é" is two bytes; cutting inside it must back off to before it.
        assert_eq!(truncate_utf8("aé", 2), "a");
        assert_eq!(truncate_utf8("é", 0), "");
    }
}
