//! A connection's own counted slots: its request slots and its in-flight bytes, taken by the
//! connection's reader and given back wherever the reply is delivered.
//!
//! Why not `tokio::sync::Semaphore`: its release takes the semaphore's waiter mutex every time
//! (`add_permits_locked`), and a request released two of them, about 200 instructions of a
//! 4 KiB request (docs/results.md, "The pipeline in process"). Here a take is a
//! compare-and-swap and a give-back is an add and a load; the waiter's `Notify` is touched only
//! when a taker is actually waiting, which on a connection that is not at its limits is never.
//!
//! No lost wake-up: a taker counts itself in `waiters`, enables its `Notified`, and then
//! checks again; a giver adds to `available` and then reads `waiters` (both sequentially
//! consistent). Either the giver sees the taker and notifies it (the `Notify`'s lock orders
//! that after the taker enabled, or the enabled future sees it), or the taker's second check
//! comes after the add and finds the slots. There is no order among several takers (a
//! connection has one reader), so a large take may wait while small ones pass it; the
//! connection's reader takes one at a time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Counted slots: at most `capacity` taken at once.
#[derive(Debug)]
pub struct Slots {
    capacity: usize,
    available: AtomicUsize,
    /// Takers between counting themselves in and leaving.
    waiters: AtomicUsize,
    freed: Notify,
}

/// Taken slots, given back when dropped.
#[derive(Debug)]
pub struct SlotsTaken {
    slots: Arc<Slots>,
    count: usize,
}

impl Slots {
    pub fn new(capacity: usize) -> Arc<Slots> {
        Arc::new(Slots {
            capacity,
            available: AtomicUsize::new(capacity),
            waiters: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// Slots not taken now.
    pub fn available(&self) -> usize {
        self.available.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Takes `count` slots, waiting until they are free. `None`: more than the capacity, which
    /// would never be granted.
    pub async fn take(self: &Arc<Slots>, count: usize) -> Option<SlotsTaken> {
        if count > self.capacity {
            return None;
        }
        if self.try_take(count) {
            return Some(self.taken(count));
        }
        loop {
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            let got = self.try_take(count);
            if !got {
                freed.await;
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            if got || self.try_take(count) {
                return Some(self.taken(count));
            }
        }
    }

    /// Takes `count` slots if they are free now.
    pub fn take_now(self: &Arc<Slots>, count: usize) -> Option<SlotsTaken> {
        self.try_take(count).then(|| self.taken(count))
    }

    fn try_take(&self, count: usize) -> bool {
        self.available
            .fetch_update(Ordering::SeqCst, Ordering::Relaxed, |free| {
                free.checked_sub(count)
            })
            .is_ok()
    }

    fn taken(self: &Arc<Slots>, count: usize) -> SlotsTaken {
        SlotsTaken {
            slots: Arc::clone(self),
            count,
        }
    }

    fn give_back(&self, count: usize) {
        let before = self.available.fetch_add(count, Ordering::SeqCst);
        debug_assert!(
            before + count <= self.capacity,
            "{count} slots given back, more than taken"
        );
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.freed.notify_waiters();
        }
    }
}

impl SlotsTaken {
    pub fn count(&self) -> usize {
        self.count
    }
}

impl Drop for SlotsTaken {
    fn drop(&mut self) {
        self.slots.give_back(self.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn takes_what_is_free_at_once_and_gives_it_back_on_drop() {
        runtime().block_on(async {
            let slots = Slots::new(10);
            let a = slots.take(4).await.expect("fits");
            let b = slots.take(6).await.expect("fits");
            assert_eq!((a.count(), b.count(), slots.available()), (4, 6, 0));
            drop(a);
            assert_eq!(slots.available(), 4);
            drop(b);
            assert_eq!(slots.available(), 10);
            assert!(slots.take(11).await.is_none(), "more than the capacity");
        });
    }

    #[test]
    fn a_taker_waits_until_another_thread_gives_enough_back() {
        runtime().block_on(async {
            let slots = Slots::new(8);
            let held = slots.take(8).await.expect("fits");
            // Each release happens on another thread once the taker is waiting (it counted
            // itself in): the wake-up must cross threads and must not be lost.
            let (tx, rx) = std::sync::mpsc::channel::<SlotsTaken>();
            let releaser = std::thread::spawn(move || {
                while let Ok(taken) = rx.recv() {
                    drop(taken);
                }
            });
            let mut parts = Vec::new();
            drop(held);
            for _ in 0..8 {
                parts.push(slots.take(1).await.expect("fits"));
            }
            for round in 0..200 {
                let want = 1 + round % 8;
                let waiting = {
                    let slots = Arc::clone(&slots);
                    async move { slots.take(want).await }
                };
                let mut waiting = std::pin::pin!(waiting);
                // Not yet: nothing is free.
                assert!(
                    futures_poll_once(waiting.as_mut()).await.is_none(),
                    "round {round}: took {want} with none free"
                );
                for part in parts.drain(..want) {
                    tx.send(part).expect("the releaser runs");
                }
                let got = tokio::time::timeout(Duration::from_secs(10), waiting)
                    .await
                    .unwrap_or_else(|_| panic!("round {round}: the wake-up was lost"))
                    .expect("fits");
                assert_eq!(got.count(), want);
                tx.send(got).expect("the releaser runs");
                // Take back what was given back, for the next round.
                for _ in 0..want {
                    parts.push(
                        tokio::time::timeout(Duration::from_secs(10), slots.take(1))
                            .await
                            .expect("released")
                            .expect("fits"),
                    );
                }
            }
            drop(parts);
            drop(tx);
            releaser.join().expect("the releaser ends");
            assert_eq!(slots.available(), 8);
        });
    }

    /// Polls `future` once: its output if it was ready.
    async fn futures_poll_once<F: std::future::Future>(
        future: std::pin::Pin<&mut F>,
    ) -> Option<F::Output> {
        let mut future = future;
        std::future::poll_fn(|cx| match future.as_mut().poll(cx) {
            std::task::Poll::Ready(out) => std::task::Poll::Ready(Some(out)),
            std::task::Poll::Pending => std::task::Poll::Ready(None),
        })
        .await
    }
}
