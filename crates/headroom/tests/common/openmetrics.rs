//! The server's `GET /metrics` text, parsed for assertions with the lab's parser
//! (`headroom_lab::openmetrics`, the one in the workspace), strictly: a line it does not
//! understand fails the test instead of being skipped.

#[allow(unused_imports)] // each test binary uses what it needs of the two
pub use headroom_lab::openmetrics::{Sample, value};

/// Every sample of `text`; panics at the first line that is not one.
pub fn parse(text: &str) -> Vec<Sample> {
    headroom_lab::openmetrics::parse(text).unwrap_or_else(|err| panic!("{err}"))
}
