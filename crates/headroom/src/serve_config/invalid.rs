//! The error every configuration check returns: the key as the file writes it, the value
//! and what is allowed (`qos.workers = 0: must be between 1 and 64`), so an operator fixes
//! the file without reading code. Node and store rules report `InvalidSetting`s in the same
//! words, turned into this here.

use std::fmt;

use headroom_node::setting::InvalidSetting;

/// A value out of range: names the key, the value and what is allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    /// Dotted key as written in the file (`qos.workers`).
    pub key: String,
    /// The value given, as it would be written (empty when the message says it all).
    pub value: String,
    /// What is allowed.
    pub allowed: String,
}

impl Invalid {
    pub(crate) fn new(
        key: impl Into<String>,
        value: impl fmt::Display,
        allowed: impl Into<String>,
    ) -> Self {
        Invalid {
            key: key.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.value.is_empty() {
            write!(f, "{}: {}", self.key, self.allowed)
        } else {
            write!(f, "{} = {}: {}", self.key, self.value, self.allowed)
        }
    }
}

impl std::error::Error for Invalid {}

impl From<InvalidSetting> for Invalid {
    /// A node setting's error, as the node words it (the key is the file's).
    fn from(err: InvalidSetting) -> Invalid {
        Invalid::new(err.key, err.value, err.allowed)
    }
}
