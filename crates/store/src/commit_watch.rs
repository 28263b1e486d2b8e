//! When each metadata commit in progress started: how readiness sees a commit that hangs.
//!
//! Why: a commit that *fails* is recorded (`Meta::health` names the error), but one that
//! *hangs* never returns: the disk under the data directory stopped answering (a hung NFS or
//! iSCSI mount, a dying disk, a FUSE daemon that stopped), or the RADOS cluster did. Nothing
//! records it, a probe commit would only queue behind it, and the node would keep saying
//! "ready" while every FLUSH waits. So every commit registers its start here before its
//! first I/O and unregisters when it returns (a guard: an error or a panic unregisters too),
//! and the health asks for the oldest start: one short lock, no I/O, so the question is
//! answered while the commit hangs. A commit older than [`COMMIT_HUNG_AFTER_MS`] is named.
//!
//! Several commits can be in progress at once: the store's commits are serialised by its
//! commit mutex, but saves of the node's QoS state and readiness probes are transactions of
//! their own beside them (and wait behind a hung one), so each start is kept, not one slot.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sync::lock;

/// A metadata commit in progress for longer than this counts as hung: the store is not
/// ready (`Store::commit_health`). The same bound as the node's readiness probe: a commit
/// that a probe would not wait for is not one a load balancer should wait for either.
pub const COMMIT_HUNG_AFTER_MS: u64 = 2_000;

/// The starts of the commits in progress, by registration number (the oldest is the
/// earliest start, not the first number: `start_at` may register an earlier start later).
#[derive(Debug, Default)]
pub(crate) struct CommitWatch {
    starts: Mutex<Starts>,
}

#[derive(Debug, Default)]
struct Starts {
    next: u64,
    by_number: BTreeMap<u64, Instant>,
}

/// One commit in progress; dropping it says the commit returned.
#[derive(Debug)]
#[must_use = "the commit counts as in progress only while the guard lives"]
pub struct CommitInProgress<'a> {
    watch: &'a CommitWatch,
    number: u64,
}

impl CommitWatch {
    /// Registers a commit starting now.
    pub(crate) fn start(&self) -> CommitInProgress<'_> {
        self.start_at(Instant::now())
    }

    /// Registers a commit that started at `at` (tests: a commit that has hung for a chosen
    /// time, without waiting that long).
    pub(crate) fn start_at(&self, at: Instant) -> CommitInProgress<'_> {
        let mut starts = lock(&self.starts);
        let number = starts.next;
        starts.next += 1;
        starts.by_number.insert(number, at);
        CommitInProgress {
            watch: self,
            number,
        }
    }

    /// How long the oldest commit in progress has run at `now`; `None` with none in progress.
    pub(crate) fn running_for(&self, now: Instant) -> Option<Duration> {
        let starts = lock(&self.starts);
        starts
            .by_number
            .values()
            .min()
            .map(|started| now.saturating_duration_since(*started))
    }

    /// How long the oldest commit in progress has run at `now`, if that is
    /// [`COMMIT_HUNG_AFTER_MS`] or more.
    pub(crate) fn hung_for(&self, now: Instant) -> Option<Duration> {
        self.running_for(now)
            .filter(|running| *running >= Duration::from_millis(COMMIT_HUNG_AFTER_MS))
    }
}

impl Drop for CommitInProgress<'_> {
    fn drop(&mut self) {
        lock(&self.watch.starts).by_number.remove(&self.number);
    }
}

/// The readiness reason for a commit that has run for `running`.
pub(crate) fn hung_reason(running: Duration) -> String {
    format!(
        "a metadata commit has not finished for {} ms (more than {COMMIT_HUNG_AFTER_MS} ms): \
         the storage under the metadata (its disk, mount or cluster) is not answering, and \
         every FLUSH waits for it",
        running.as_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_millis(COMMIT_HUNG_AFTER_MS);
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_commit_counts_as_hung_from_the_bound_on_and_not_after_it_returned() {
        let watch = CommitWatch::default();
        let t0 = Instant::now();
        assert_eq!(watch.running_for(t0), None);
        let commit = watch.start_at(t0);
        assert_eq!(watch.running_for(t0 + MS), Some(MS));
        assert_eq!(watch.hung_for(t0 + BOUND - MS), None);
        assert_eq!(watch.hung_for(t0 + BOUND), Some(BOUND));
        assert_eq!(watch.hung_for(t0 + BOUND * 3), Some(BOUND * 3));
        drop(commit);
        assert_eq!(watch.running_for(t0 + BOUND * 3), None);
        assert_eq!(watch.hung_for(t0 + BOUND * 3), None);
    }

    #[test]
    fn the_oldest_of_overlapping_commits_is_reported_whichever_returns_first() {
        let watch = CommitWatch::default();
        let t0 = Instant::now();
        let old = watch.start_at(t0);
        let young = watch.start_at(t0 + BOUND);
        // Both in progress: the older one is the one reported.
        assert_eq!(watch.running_for(t0 + BOUND), Some(BOUND));
        // The younger one returning (a save of the QoS state beside a hung FLUSH) does not
        // hide the older one.
        drop(young);
        assert_eq!(watch.hung_for(t0 + BOUND), Some(BOUND));
        let young = watch.start_at(t0 + BOUND);
        // The older one returning leaves the younger one, not yet hung.
        drop(old);
        assert_eq!(watch.running_for(t0 + BOUND + MS), Some(MS));
        assert_eq!(watch.hung_for(t0 + BOUND + MS), None);
        drop(young);
        assert_eq!(watch.running_for(t0 + BOUND * 2), None);
    }

    #[test]
    fn a_commit_that_panics_is_no_longer_in_progress() {
        let watch = CommitWatch::default();
        let t0 = Instant::now();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _commit = watch.start_at(t0);
            panic!("the commit panicked");
        }));
        assert!(unwound.is_err());
        assert_eq!(watch.running_for(t0 + BOUND), None);
    }

    #[test]
    fn the_reason_names_the_time_and_the_bound() {
        let reason = hung_reason(Duration::from_millis(2_345));
        assert!(reason.starts_with("a metadata commit has not finished for 2345 ms"));
        assert!(reason.contains("more than 2000 ms"), "{reason}");
    }
}
