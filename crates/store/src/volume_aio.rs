//! Asynchronous reads and writes for volumes on RADOS (docs/ARCHITECTURE.md, decision 25).
//!
//! Why: through the synchronous API (`Volume::read_at` / `write_at`) every request in flight
//! at the cluster holds an I/O thread blocked in librados, and on a small machine the thread
//! switches per request (session → worker → librados → worker) cost more CPU than the
//! request itself. Here the calling thread resolves the request under the volume's read lock,
//! hands it to librados (`rados_aio_read` / `rados_aio_write`) and returns; `done` runs on a
//! librados thread when the cluster answers. The store stays free of any async runtime:
//! completion is a plain closure.
//!
//! Which requests: a read or write inside one extent of a RADOS device (every 4 KiB request,
//! most larger ones), an allocated extent for a read (a hole is answered without I/O by the
//! synchronous path). Everything else (two extents, a hole, a full pool that needs a commit
//! to reclaim space, another backend) is handed back, and the caller uses the synchronous
//! path. FUA is the caller's business (it follows a write with `flush`-like durability
//! through the synchronous API).
//!
//! The read lock a synchronous request holds during its I/O keeps the extent from being
//! released (and reused by another volume) under it. An asynchronous request cannot hold a
//! lock guard across threads, so it holds an `InFlightGuard` instead: taken under the read
//! lock, dropped when the cluster has answered; whoever takes the write lock (TRIM,
//! resize, delete) then waits until none is left (`Volume::write_state`). No new one can
//! start meanwhile, since starting needs the read lock.

use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLockWriteGuard};

use super::{Volume, VolumeState};
use crate::error::StoreError;
use crate::sync::write;

/// What an asynchronous request's caller gets when it completes: its buffer back (a read's
/// data in it) and the outcome.
pub type AioDone<B> = Box<dyn FnOnce(B, Result<(), StoreError>) + Send + 'static>;

/// The asynchronous requests of one volume in flight.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    count: Mutex<usize>,
    idle: Condvar,
}

/// One asynchronous request in flight; dropping it ends it.
pub(crate) struct InFlightGuard(Arc<InFlight>);

impl InFlight {
    #[cfg_attr(not(feature = "rados"), allow(dead_code))]
    pub(crate) fn enter(self: &Arc<Self>) -> InFlightGuard {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        InFlightGuard(Arc::clone(self))
    }

    fn wait_idle(&self) {
        let mut count = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        while *count > 0 {
            count = self
                .idle
                .wait(count)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let mut count = self.0.count.lock().unwrap_or_else(PoisonError::into_inner);
        *count -= 1;
        if *count == 0 {
            self.0.idle.notify_all();
        }
    }
}

impl Volume {
    /// The state's write lock, once no asynchronous request is in flight either.
    pub(super) fn write_state(&self) -> RwLockWriteGuard<'_, VolumeState> {
        let st = write(&self.state);
        self.in_flight.wait_idle();
        st
    }

    /// Prepares an asynchronous read (`write == false`) or write of `len` bytes at `offset`:
    /// checks it and resolves (for a write: allocates) its extent under the read lock, and
    /// counts it in flight. `Ok(None)`: it cannot go this way (see the module comment), use
    /// `read_at` / `write_at`. An error is the request's outcome (already logged, as
    /// `read_at` would). A write that succeeds is durable (an acknowledged RADOS write
    /// is); the allocation of a new extent becomes durable with the next commit (FLUSH), as
    /// for `write_at` without FUA.
    #[cfg(not(feature = "rados"))]
    pub fn start_async(
        &self,
        _offset: u64,
        _len: u64,
        _write: bool,
    ) -> Result<Option<AioRequest>, StoreError> {
        Ok(None)
    }

    /// Prepares an asynchronous read (`write == false`) or write of `len` bytes at `offset`:
    /// checks it and resolves (for a write: allocates) its extent under the read lock, and
    /// counts it in flight. `Ok(None)`: it cannot go this way (see the module comment), use
    /// `read_at` / `write_at`. An error is the request's outcome (already logged, as
    /// `read_at` would). A write that succeeds is durable (an acknowledged RADOS write
    /// is); the allocation of a new extent becomes durable with the next commit (FLUSH), as
    /// for `write_at` without FUA.
    #[cfg(feature = "rados")]
    pub fn start_async(
        &self,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<Option<AioRequest>, StoreError> {
        use super::{check_range, read};
        use crate::layout::{PhysExtent, pieces};

        let op = if write { "write" } else { "read" };
        // Stores on files or RAM (a RADOS store has one device, a RADOS one) give up here,
        // before any lock. Injected faults may sleep (latency spikes): they stay on the
        // synchronous path, which runs on I/O threads.
        if !self.shared.devices.get(0).is_some_and(|d| d.is_rados())
            || self.shared.volume_faults.get().is_some()
        {
            return Ok(None);
        }
        let Some(me) = self.me.upgrade() else {
            return Ok(None);
        };
        let st = read(&self.state);
        self.check_live()
            .and_then(|()| check_range(st.size_bytes, offset, len))
            .map_err(|e| self.failed(op, offset, len, e))?;
        let mut ps = pieces(offset, len);
        let (Some(p), None) = (ps.next(), ps.next()) else {
            return Ok(None);
        };
        let mut entry = st.map.get(p.extent);
        if entry == 0 {
            if !write {
                return Ok(None);
            }
            match self.allocate(&st, p.extent) {
                Ok(Some(e)) => entry = e,
                // A full pool whose quarantined extents a commit would free: write_at does that.
                Ok(None) => return Ok(None),
                Err(e) => return Err(self.failed(op, offset, len, e)),
            }
        }
        let Some(phys) = PhysExtent::from_entry(entry) else {
            return Ok(None);
        };
        let device = self
            .shared
            .device(phys)
            .map_err(|e| self.failed(op, offset, len, e))?;
        let Some((pool, pos)) = device
            .aio_prepare(phys.index, p.offset_in_extent, len)
            .map_err(|e| self.failed(op, offset, len, StoreError::Io(e)))?
        else {
            return Ok(None);
        };
        Ok(Some(AioRequest {
            guard: self.in_flight.enter(),
            me,
            pool,
            device_id: device.id,
            phys,
            pos,
            offset_in_extent: p.offset_in_extent,
            offset,
            len,
            write,
        }))
    }
}

/// A read or write `Volume::start_async` prepared; `submit` sends it.
#[cfg(not(feature = "rados"))]
#[derive(Debug)]
pub enum AioRequest {}

#[cfg(not(feature = "rados"))]
impl AioRequest {
    /// Sends it (see the `rados` build).
    pub fn submit<B: AsMut<[u8]> + Send + 'static>(self, _buf: B, _done: AioDone<B>) {
        match self {}
    }
}

/// A read or write `Volume::start_async` prepared; `submit` sends it. Dropped unsent, it
/// just ends (nothing reached the cluster; a write's new extent stays allocated, as after
/// a failed `write_at`).
#[cfg(feature = "rados")]
pub struct AioRequest {
    guard: InFlightGuard,
    me: Arc<Volume>,
    pool: Arc<crate::rados::Pool>,
    device_id: u32,
    phys: crate::layout::PhysExtent,
    /// Byte position on the device (for error messages).
    pos: u64,
    offset_in_extent: u64,
    /// The volume range.
    offset: u64,
    len: u64,
    write: bool,
}

#[cfg(feature = "rados")]
impl std::fmt::Debug for AioRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AioRequest")
            .field("volume", &self.me.name)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "rados")]
impl AioRequest {
    /// Sends it with `buf` (`len` bytes: the data to write, or where to read into) and
    /// returns at once; `done` gets `buf` back with the outcome, on a librados thread (or on
    /// this one, before this returns, if it could not be sent). `done` must not block:
    /// other completions wait behind it.
    pub fn submit<B: AsMut<[u8]> + Send + 'static>(self, buf: B, done: AioDone<B>) {
        let AioRequest {
            guard,
            me,
            pool,
            device_id,
            phys,
            pos,
            offset_in_extent,
            offset,
            len,
            write,
        } = self;
        let oid = crate::rados::ObjectName::new(device_id, phys.index);
        let started = std::time::Instant::now();
        let op = if write { "write" } else { "read" };
        let finish = Box::new(move |buf: B, result: std::io::Result<()>| {
            drop(guard);
            let result = me
                .shared
                .device(phys)
                .and_then(|d| Ok(d.aio_finish(write, len, pos, started, result)?))
                .map_err(|e| me.failed(op, offset, len, e));
            done(buf, result);
        });
        let range = 0..usize::try_from(len).unwrap_or(usize::MAX);
        if write {
            pool.aio_write(oid.as_c_str(), offset_in_extent, buf, range, finish);
        } else {
            pool.aio_read(oid.as_c_str(), offset_in_extent, buf, range, finish);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn waiting_for_idle_ends_when_the_last_request_does() {
        let in_flight = Arc::new(InFlight::default());
        in_flight.wait_idle(); // none in flight: returns at once
        let (a, b) = (in_flight.enter(), in_flight.enter());
        let (tx, rx) = mpsc::channel();
        let waiter = {
            let in_flight = Arc::clone(&in_flight);
            std::thread::spawn(move || {
                in_flight.wait_idle();
                tx.send(()).unwrap();
            })
        };
        drop(a);
        // One is still in flight: the waiter must not be done.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        drop(b);
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        waiter.join().unwrap();
    }
}
