//! A size as a setting: bytes (`65536`) or a string with a unit (`"64KiB"`, `"2GB"`), the same
//! syntax in the file (serde) and on the command line (clap, through `FromStr`), and shown
//! back in errors as the file would write it.

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use crate::size::{format_size, parse_size};

/// A size: bytes (`65536`) or a string with a unit (`"64KiB"`, `"2GB"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = format_size(self.0);
        if text.ends_with("iB") {
            write!(f, "\"{text}\"")
        } else {
            write!(f, "{}", self.0)
        }
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: bytes, or a string such as \"64KiB\", \"4GiB\" or \"2GB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                parse_size(v).map(Size).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

impl FromStr for Size {
    type Err = String;

    fn from_str(text: &str) -> Result<Size, String> {
        parse_size(text).map(Size).map_err(|err| err.to_string())
    }
}
