//! Credit balances across restarts: every volume is registered with the scheduler at
//! start with its saved balance, and balances are saved while the node runs (with a margin,
//! so that a crash never restores more credit than was spent) and exactly at shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use headroom_store::Store;

use super::NodeError;
use crate::pipeline::IoJob;
use crate::scheduler::Scheduler;
use crate::sync::lock;
use crate::volume_qos::{CreditRecord, SAVE_MARGIN_PERIODS};

/// Registers every stored volume with the scheduler and restores its saved credit balance.
pub(super) fn register_volumes(
    store: &Store,
    scheduler: &Scheduler<IoJob>,
) -> Result<(), NodeError> {
    let saved: std::collections::HashMap<u64, CreditRecord> = store
        .volume_states()?
        .into_iter()
        .filter_map(|(id, bytes)| CreditRecord::from_bytes(&bytes).map(|r| (id, r)))
        .collect();
    for info in store.list_volumes() {
        let qos = crate::volume_qos::effective_qos(info.qos.as_deref(), info.size_bytes);
        let handle = scheduler.add_volume(info.id, &qos);
        if let Some(record) = saved.get(&info.id) {
            scheduler.restore_credits(&handle, record.iops_credits, record.bytes_credits);
        }
    }
    Ok(())
}

/// Saves the credit balance of every volume that has credit buckets: exact when `clean`,
/// otherwise less what it could spend in `SAVE_MARGIN_PERIODS × period_ms`.
pub(super) fn save_credits(
    store: &Store,
    scheduler: &Scheduler<IoJob>,
    clean: bool,
    period_ms: u64,
) -> Result<(), NodeError> {
    let margin_ms = period_ms.saturating_mul(SAVE_MARGIN_PERIODS);
    let mut rows = Vec::new();
    for info in store.list_volumes() {
        let Some(handle) = scheduler.handle(info.id) else {
            continue;
        };
        let qos = handle.qos();
        if !matches!(qos.burst, headroom_qos::BurstMode::Credits(_)) {
            continue;
        }
        let balances = scheduler.credits(&handle);
        let record = CreditRecord::for_save(&qos, balances, clean, margin_ms);
        rows.push((info.id, record.to_bytes()));
    }
    if rows.is_empty() {
        return Ok(());
    }
    store.save_volume_states(&rows).map_err(NodeError::Credits)
}

/// The thread that saves credit balances while the node runs.
#[derive(Debug)]
pub(super) struct CreditSaver {
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CreditSaver {
    /// Saves running balances now (replacing the exact ones of a clean shutdown), then starts
    /// saving them every `period_ms` (at least 1).
    pub(super) fn begin(
        store: &Arc<Store>,
        scheduler: &Arc<Scheduler<IoJob>>,
        period_ms: u64,
    ) -> Result<CreditSaver, NodeError> {
        let period_ms = period_ms.max(1);
        save_credits(store, scheduler, false, period_ms)?;
        CreditSaver::start(Arc::clone(store), Arc::clone(scheduler), period_ms)
    }

    fn start(
        store: Arc<Store>,
        scheduler: Arc<Scheduler<IoJob>>,
        period_ms: u64,
    ) -> Result<CreditSaver, NodeError> {
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let flag = Arc::clone(&stop);
        let late_warned = AtomicBool::new(false);
        let thread = std::thread::Builder::new()
            .name("headroom-credits".into())
            .spawn(move || {
                let period = Duration::from_millis(period_ms);
                let clock = scheduler.clock();
                let mut next_ns = clock.now_ns() + period_ms * 1_000_000;
                loop {
                    let (stop, changed) = &*flag;
                    let mut stopped = lock(stop);
                    while !*stopped && clock.now_ns() < next_ns {
                        let wait = clock.until(next_ns).min(period);
                        stopped = changed
                            .wait_timeout(stopped, wait)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                    if *stopped {
                        return;
                    }
                    drop(stopped);
                    let late_ns = clock.now_ns().saturating_sub(next_ns);
                    if late_ns > period_ms * 1_000_000 && !late_warned.swap(true, Ordering::Relaxed)
                    {
                        tracing::warn!(
                            "credit balances saved {} ms late: a crash now could restore more credit than was spent",
                            late_ns / 1_000_000
                        );
                    }
                    if let Err(err) = save_credits(&store, &scheduler, false, period_ms) {
                        tracing::error!("{err}");
                    }
                    next_ns = clock.now_ns() + period_ms * 1_000_000;
                }
            })
            .map_err(NodeError::Workers)?;
        Ok(CreditSaver {
            stop,
            thread: Some(thread),
        })
    }

    pub(super) fn stop(mut self) {
        let (flag, changed) = &*self.stop;
        *lock(flag) = true;
        changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
