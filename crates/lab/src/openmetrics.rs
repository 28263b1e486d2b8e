//! OpenMetrics text as the server writes it (`GET /metrics`), parsed into samples.
//!
//! The one parser of the exposition in the workspace: the lab reads the server's counters
//! with it ([`crate::server::volume_ops`]), and the end-to-end tests assert on what it
//! returns. It is the subset the server writes (no exemplars, no timestamps); a line outside
//! it is a [`ParseError`] for that line only, so the lab can skip it and the tests can fail.

use std::collections::BTreeMap;

/// One sample of the exposition: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The series' name (with its `_total`, `_bucket`, ... suffix).
    pub name: String,
    /// Label names to values (unescaped only as far as the server escapes: not at all).
    pub labels: BTreeMap<String, String>,
    /// The value (`+Inf` is infinity).
    pub value: f64,
}

/// A sample line the parser does not understand.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an OpenMetrics sample line ({what}): {line:?}")]
pub struct ParseError {
    /// What is wrong with it.
    pub what: &'static str,
    /// The line.
    pub line: String,
}

/// Every sample line of `text` (comments and blank lines skipped), each parsed or not.
pub fn samples(text: &str) -> impl Iterator<Item = Result<Sample, ParseError>> + '_ {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(parse_line)
}

/// All samples of `text`, or the first line that is not one.
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    samples(text).collect()
}

/// One sample line: `name{k="v",...} value` or `name value`.
pub fn parse_line(line: &str) -> Result<Sample, ParseError> {
    let error = |what| ParseError {
        what,
        line: line.to_string(),
    };
    let (series, value) = line.rsplit_once(' ').ok_or_else(|| error("no value"))?;
    let value = match value {
        "+Inf" | "inf" => f64::INFINITY,
        v => v.parse().map_err(|_| error("bad value"))?,
    };
    let (name, labels) = match series.split_once('{') {
        None => (series.to_string(), BTreeMap::new()),
        Some((name, rest)) => {
            let body = rest
                .strip_suffix('}')
                .ok_or_else(|| error("no closing brace"))?;
            let mut labels = BTreeMap::new();
            for pair in body.split("\",") {
                let (k, v) = pair.split_once("=\"").ok_or_else(|| error("bad label"))?;
                labels.insert(k.to_string(), v.trim_end_matches('"').to_string());
            }
            (name.to_string(), labels)
        }
    };
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// The value of the first sample named `name` with these labels (besides any not given).
#[must_use]
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_with_and_without_labels_and_bad_lines() {
        let text = "# TYPE x counter\nx_total 3\ny{a=\"1\",b=\"two\"} +Inf\n\nz{a=\"1\" 2\n";
        let all: Vec<_> = samples(text).collect();
        assert_eq!(all.len(), 3);
        let x = all[0].as_ref().ok();
        assert_eq!(
            x.map(|s| (s.name.as_str(), s.value)),
            Some(("x_total", 3.0))
        );
        let y = all[1]
            .as_ref()
            .ok()
            .map(std::slice::from_ref)
            .unwrap_or(&[]);
        assert_eq!(value(y, "y", &[("b", "two")]), Some(f64::INFINITY));
        assert_eq!(value(y, "y", &[("b", "one")]), None);
        assert!(all[2].is_err());
        assert!(parse(text).is_err());
    }
}
