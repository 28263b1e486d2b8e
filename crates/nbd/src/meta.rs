//! Metadata contexts: which of Headroom's contexts a LIST/SET query selects.
//!
//! Why: the spec leaves query syntax to each namespace but fixes the `base:` namespace
//! rules (wildcard on LIST, ignored on SET, unknown leaves and namespaces ignored).
//! Encoding those rules once, as a pure function, keeps the session free of string
//! matching and lets the table of cases be unit-tested.
//!
//! Query syntax Headroom supports (documented as the spec asks: "Server
//! implementations SHOULD ensure the syntax for query strings they support ... is
//! documented"): exactly the `base:` namespace; `base:allocation` selects the one
//! context; `base:` lists all `base:` contexts on LIST and selects nothing on SET;
//! anything else, including queries without a colon, selects nothing.

/// The one context Headroom serves.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// Context ID the session assigns to `base:allocation` on `NBD_OPT_SET_META_CONTEXT`
/// (IDs are "transient", so a constant is allowed). LIST replies use 0 ("The metadata
/// context ID in these replies is reserved and SHOULD be set to zero").
pub const BASE_ALLOCATION_CONTEXT_ID: u32 = 1;

/// A metadata context Headroom can report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaContext {
    /// `base:allocation`: `NBD_STATE_HOLE` / `NBD_STATE_ZERO` per extent.
    BaseAllocation,
}

impl MetaContext {
    /// Every context, in the order replies list them.
    pub const ALL: [Self; 1] = [Self::BaseAllocation];

    /// The context's name on the wire.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::BaseAllocation => BASE_ALLOCATION,
        }
    }

    /// The context ID used in `NBD_REP_META_CONTEXT` after SET and in block status chunks.
    #[must_use]
    pub const fn context_id(self) -> u32 {
        match self {
            Self::BaseAllocation => BASE_ALLOCATION_CONTEXT_ID,
        }
    }

    fn namespace(self) -> &'static str {
        match self {
            Self::BaseAllocation => "base",
        }
    }
}

/// Which option the queries came with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaContextOp {
    /// `NBD_OPT_LIST_META_CONTEXT`.
    List,
    /// `NBD_OPT_SET_META_CONTEXT`.
    Set,
}

/// The contexts selected by `queries`, each at most once, in [`MetaContext::ALL`] order.
///
/// - LIST with no query: all contexts ("If zero queries are sent, then the server MUST
///   return all the metadata contexts that are available").
/// - SET with no query: none ("If zero queries are sent, the server MUST select no
///   metadata contexts").
/// - `base:` on LIST: all `base:` contexts; on SET: ignored ("the server MUST ignore
///   this form during `NBD_OPT_SET_META_CONTEXT`, and MUST support this as a wildcard
///   during `NBD_OPT_LIST_META_CONTEXT`").
/// - unknown `base:` leaf: ignored ("the server MUST ignore it rather than report an
///   error"); unknown namespace: ignored ("the server MUST ignore query strings
///   belonging to an unknown namespace"); no colon: ignored (the spec allows, but does
///   not require, `NBD_REP_ERR_INVALID` for this).
///
/// Preconditions the session checks itself: structured replies negotiated (SET without
/// them: "a server SHOULD send `NBD_REP_ERR_INVALID`"; LIST: "MAY"), and the export
/// exists.
#[must_use]
pub fn select_meta_contexts(op: MetaContextOp, queries: &[String]) -> Vec<MetaContext> {
    if queries.is_empty() {
        return match op {
            MetaContextOp::List => MetaContext::ALL.to_vec(),
            MetaContextOp::Set => Vec::new(),
        };
    }
    MetaContext::ALL
        .into_iter()
        .filter(|context| queries.iter().any(|q| query_selects(op, q, *context)))
        .collect()
}

/// Whether `queries` select `base:allocation`: the same rules as
/// [`select_meta_contexts`], for sessions that track just this one context.
/// `is_set` is true for `NBD_OPT_SET_META_CONTEXT`, false for LIST.
#[must_use]
pub fn allocation_context_matches(queries: &[String], is_set: bool) -> bool {
    let op = if is_set {
        MetaContextOp::Set
    } else {
        MetaContextOp::List
    };
    select_meta_contexts(op, queries).contains(&MetaContext::BaseAllocation)
}

fn query_selects(op: MetaContextOp, query: &str, context: MetaContext) -> bool {
    let Some((namespace, leaf)) = query.split_once(':') else {
        return false;
    };
    if namespace != context.namespace() {
        return false;
    }
    if leaf.is_empty() {
        return op == MetaContextOp::List;
    }
    query == context.name()
}

#[cfg(test)]
mod tests {
    use super::*;
    use MetaContextOp::{List, Set};

    fn q(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn selection_table() {
        let all = vec![MetaContext::BaseAllocation];
        let none: Vec<MetaContext> = Vec::new();
        let cases: Vec<(MetaContextOp, Vec<String>, Vec<MetaContext>)> = vec![
            (List, q(&[]), all.clone()),
            (Set, q(&[]), none.clone()),
            (List, q(&["base:"]), all.clone()),
            (Set, q(&["base:"]), none.clone()),
            (List, q(&["base:allocation"]), all.clone()),
            (Set, q(&["base:allocation"]), all.clone()),
            (Set, q(&["base:allocation", "base:allocation"]), all.clone()),
            (Set, q(&["base:unknown"]), none.clone()),
            (List, q(&["qemu:dirty-bitmap:x"]), none.clone()),
            (
                Set,
                q(&["qemu:allocation-depth", "base:allocation"]),
                all.clone(),
            ),
            (Set, q(&["allocation"]), none.clone()),
            (List, q(&["BASE:allocation"]), none.clone()),
            (List, q(&["base:allocationX"]), none),
        ];
        for (op, queries, expected) in cases {
            assert_eq!(
                select_meta_contexts(op, &queries),
                expected,
                "{op:?} {queries:?}"
            );
        }
    }

    #[test]
    fn allocation_shortcut_agrees() {
        assert!(allocation_context_matches(&q(&[]), false));
        assert!(!allocation_context_matches(&q(&[]), true));
        assert!(allocation_context_matches(&q(&["base:"]), false));
        assert!(!allocation_context_matches(&q(&["base:"]), true));
        assert!(allocation_context_matches(
            &q(&["x-foo:bar", "base:allocation"]),
            true
        ));
    }

    #[test]
    fn names_and_ids() {
        assert_eq!(MetaContext::BaseAllocation.name(), "base:allocation");
        assert_ne!(MetaContext::BaseAllocation.context_id(), 0);
    }
}
