//! A pool device whose extents are RADOS objects (cargo feature `rados`), through a small FFI
//! of our own over librados' C API (`librados.so.2`, package `librados-dev` to link).
//!
//! Why RADOS: a Ceph cluster keeps the data replicated on many machines, so a volume no
//! longer dies with one node's disks. Why our own FFI: we need a dozen calls of a
//! C ABI that has been stable for a decade; the Rust bindings on crates.io are thin, lightly
//! kept, and some panic in `Drop`. Declaring the calls ourselves costs no dependency and
//! keeps every `unsafe` block in this one file.
//!
//! Besides the extent objects, the namespace holds `meta` (the store's metadata as omap
//! key/values, rados_meta.rs) and `lease` (the node's exclusive lock, lease.rs).
//!
//! **Object naming and size.** The store's RADOS device is device 0 of the pool, like a
//! device file; its capacity (`device_capacity_bytes`, `--device-size`) is the address space
//! extents are allocated from. Physical extent `N` of device `D` is the object
//! `ext.<D>.<N as 8 lowercase hex digits>` (e.g. `ext.0.0000002a`) in the RADOS namespace
//! `headroom-<16 hex digits>`, a random name chosen when the store is created, kept in its
//! device record (`rados:<pool>/<namespace>`) and, as local state, in `DATA_DIR/rados-namespace`. The namespace keeps two stores
//! sharing a pool apart and lets the startup punch list only this store's objects. An object
//! holds at most one extent (2 MiB, `EXTENT_SIZE_BYTES`) and is sparse: it exists once some
//! byte of its extent was written and is as long as the highest byte written; missing
//! objects and bytes past an object's end read as zeros. Releasing a whole extent removes
//! its object; punching or zeroing part of one is a RADOS `zero` operation.
//!
//! **I/O.** Reads and writes inside one extent (every 4 KiB request, most larger ones) go
//! out asynchronously: `rados_aio_read` / `rados_aio_write` with a completion callback
//! (`rados_aio_create_completion2`) that hands the buffer and the result to a closure on a
//! librados thread (`Pool::aio_read` / `aio_write`, used by volume_aio.rs). So many requests
//! are in flight at the cluster without a thread each, and no I/O thread sits in a blocking
//! call (docs/ARCHITECTURE.md, decision 25). The rest is synchronous
//! `rados_read` / `rados_write` / `rados_remove` / write-op `zero` on the node's I/O worker
//! threads (the device is not memory resident, so no such call runs on a network thread):
//! requests that span two extents, FUA writes, zeroing and punching, and reads and writes
//! while faults are injected. Releases of many extents at once, and the startup punch,
//! remove their objects with `rados_aio_remove`, 64 in flight. No call waits for ever: an
//! OSD operation that gets no answer within `rados_osd_op_timeout` fails with `ETIMEDOUT`
//! (`DEFAULT_TIMEOUTS`).
//!
//! **Durability.** librados acknowledges a write once every replica of the object's
//! placement group has it on stable storage. So a device sync has nothing to do: FLUSH and
//! FUA still commit the extent maps (the omap of the object `meta`, rados_meta.rs) after the writes they
//! cover have been acknowledged, which is the ordering the store's commit protocol needs.
//!
//! **Thread safety.** librados documents its cluster and I/O-context handles as safe to
//! use from many threads at once (every call takes its own locks); the handles here are
//! created once and destroyed only in `Drop`, when no other reference is left.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int};
use std::io;
use std::io::Write as _;
use std::path::Path;
use std::ptr;
use std::sync::Arc;

use crate::lease_clock::LeaseExpiry;
use crate::rados_inflight::{InFlight, OpGuard};

/// The librados C calls we use (declarations from `rados/librados.h`, Ceph 16).
mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    pub type RadosT = *mut c_void;
    pub type IoctxT = *mut c_void;
    pub type ListCtxT = *mut c_void;
    pub type WriteOpT = *mut c_void;
    pub type CompletionT = *mut c_void;
    pub type CallbackT = Option<unsafe extern "C" fn(CompletionT, *mut c_void)>;

    #[link(name = "rados")]
    unsafe extern "C" {
        pub fn rados_create(cluster: *mut RadosT, id: *const c_char) -> c_int;
        pub fn rados_conf_set(
            cluster: RadosT,
            option: *const c_char,
            value: *const c_char,
        ) -> c_int;
        pub fn rados_conf_read_file(cluster: RadosT, path: *const c_char) -> c_int;
        pub fn rados_conf_get(
            cluster: RadosT,
            option: *const c_char,
            buf: *mut c_char,
            len: usize,
        ) -> c_int;
        pub fn rados_connect(cluster: RadosT) -> c_int;
        pub fn rados_shutdown(cluster: RadosT);
        pub fn rados_ioctx_create(
            cluster: RadosT,
            pool_name: *const c_char,
            ioctx: *mut IoctxT,
        ) -> c_int;
        pub fn rados_ioctx_destroy(io: IoctxT);
        pub fn rados_ioctx_set_namespace(io: IoctxT, nspace: *const c_char);
        pub fn rados_read(
            io: IoctxT,
            oid: *const c_char,
            buf: *mut c_char,
            len: usize,
            off: u64,
        ) -> c_int;
        pub fn rados_write(
            io: IoctxT,
            oid: *const c_char,
            buf: *const c_char,
            len: usize,
            off: u64,
        ) -> c_int;
        pub fn rados_remove(io: IoctxT, oid: *const c_char) -> c_int;
        pub fn rados_stat(
            io: IoctxT,
            oid: *const c_char,
            psize: *mut u64,
            pmtime: *mut libc_time_t,
        ) -> c_int;
        pub fn rados_create_write_op() -> WriteOpT;
        pub fn rados_write_op_zero(op: WriteOpT, offset: u64, len: u64);
        pub fn rados_write_op_operate(
            op: WriteOpT,
            io: IoctxT,
            oid: *const c_char,
            mtime: *mut libc_time_t,
            flags: c_int,
        ) -> c_int;
        pub fn rados_release_write_op(op: WriteOpT);
        pub fn rados_nobjects_list_open(io: IoctxT, ctx: *mut ListCtxT) -> c_int;
        pub fn rados_nobjects_list_next(
            ctx: ListCtxT,
            entry: *mut *const c_char,
            key: *mut *const c_char,
            nspace: *mut *const c_char,
        ) -> c_int;
        pub fn rados_nobjects_list_close(ctx: ListCtxT);
        pub fn rados_aio_create_completion2(
            cb_arg: *mut c_void,
            cb_complete: CallbackT,
            pc: *mut CompletionT,
        ) -> c_int;
        pub fn rados_aio_remove(io: IoctxT, oid: *const c_char, completion: CompletionT) -> c_int;
        pub fn rados_aio_read(
            io: IoctxT,
            oid: *const c_char,
            completion: CompletionT,
            buf: *mut c_char,
            len: usize,
            off: u64,
        ) -> c_int;
        pub fn rados_aio_write(
            io: IoctxT,
            oid: *const c_char,
            completion: CompletionT,
            buf: *const c_char,
            len: usize,
            off: u64,
        ) -> c_int;
        pub fn rados_aio_flush(io: IoctxT) -> c_int;
        pub fn rados_aio_wait_for_complete(c: CompletionT) -> c_int;
        pub fn rados_aio_get_return_value(c: CompletionT) -> c_int;
        pub fn rados_aio_release(c: CompletionT);
        pub fn rados_write_op_create(op: WriteOpT, exclusive: c_int, category: *const c_char);
        pub fn rados_write_op_omap_set2(
            op: WriteOpT,
            keys: *const *const c_char,
            vals: *const *const c_char,
            key_lens: *const usize,
            val_lens: *const usize,
            num: usize,
        );
        pub fn rados_write_op_omap_rm_keys2(
            op: WriteOpT,
            keys: *const *const c_char,
            key_lens: *const usize,
            num: usize,
        );
        pub fn rados_write_op_omap_rm_range2(
            op: WriteOpT,
            key_begin: *const c_char,
            key_begin_len: usize,
            key_end: *const c_char,
            key_end_len: usize,
        );
        pub fn rados_create_read_op() -> ReadOpT;
        pub fn rados_release_read_op(op: ReadOpT);
        pub fn rados_read_op_omap_get_vals2(
            op: ReadOpT,
            start_after: *const c_char,
            filter_prefix: *const c_char,
            max_return: u64,
            iter: *mut OmapIterT,
            pmore: *mut u8,
            prval: *mut c_int,
        );
        pub fn rados_read_op_operate(
            op: ReadOpT,
            io: IoctxT,
            oid: *const c_char,
            flags: c_int,
        ) -> c_int;
        pub fn rados_omap_get_next2(
            iter: OmapIterT,
            key: *mut *mut c_char,
            val: *mut *mut c_char,
            key_len: *mut usize,
            val_len: *mut usize,
        ) -> c_int;
        pub fn rados_omap_get_end(iter: OmapIterT);
        pub fn rados_lock_exclusive(
            io: IoctxT,
            oid: *const c_char,
            name: *const c_char,
            cookie: *const c_char,
            desc: *const c_char,
            duration: *mut Timeval,
            flags: u8,
        ) -> c_int;
        pub fn rados_unlock(
            io: IoctxT,
            oid: *const c_char,
            name: *const c_char,
            cookie: *const c_char,
        ) -> c_int;
        pub fn rados_break_lock(
            io: IoctxT,
            oid: *const c_char,
            name: *const c_char,
            client: *const c_char,
            cookie: *const c_char,
        ) -> c_int;
        pub fn rados_write_op_exec(
            op: WriteOpT,
            cls: *const c_char,
            method: *const c_char,
            in_buf: *const c_char,
            in_len: usize,
            prval: *mut c_int,
        );
        pub fn rados_blocklist_add(
            cluster: RadosT,
            addr: *mut c_char,
            expire_seconds: u32,
        ) -> c_int;
        pub fn rados_getaddrs(cluster: RadosT, addrs: *mut *mut c_char) -> c_int;
        pub fn rados_list_lockers(
            io: IoctxT,
            o: *const c_char,
            name: *const c_char,
            exclusive: *mut c_int,
            tag: *mut c_char,
            tag_len: *mut usize,
            clients: *mut c_char,
            clients_len: *mut usize,
            cookies: *mut c_char,
            cookies_len: *mut usize,
            addrs: *mut c_char,
            addrs_len: *mut usize,
        ) -> isize;
        pub fn rados_getxattr(
            io: IoctxT,
            o: *const c_char,
            name: *const c_char,
            buf: *mut c_char,
            len: usize,
        ) -> c_int;
        pub fn rados_buffer_free(buf: *mut c_char);
        pub fn rados_wait_for_latest_osdmap(cluster: RadosT) -> c_int;
    }

    pub type ReadOpT = *mut c_void;
    pub type OmapIterT = *mut c_void;

    /// `struct timeval` on 64-bit Linux.
    #[repr(C)]
    pub struct Timeval {
        pub tv_sec: i64,
        pub tv_usec: i64,
    }

    /// `time_t` on the 64-bit Linux targets we build for.
    #[allow(non_camel_case_types)]
    pub type libc_time_t = i64;
}

/// ENOENT as librados returns it (negated errno).
const ENOENT: c_int = 2;
/// EBUSY as librados returns it (negated errno): a lock held by another client.
const EBUSY: c_int = 16;
/// ERANGE as librados returns it (negated errno): the buffer given is too small.
const ERANGE: c_int = 34;
/// ENODATA as librados returns it (negated errno): no such xattr.
const ENODATA: c_int = 61;
/// Most bytes `Pool::xattr` reads (a lock's state is about 130 bytes per holder).
const MAX_XATTR_BYTES: usize = 1 << 20;

/// librados settings we default differently: (name, librados' default, ours), seconds. Ours
/// applies where the `ceph.conf` leaves librados' default; a setting in the file (`[client]`
/// section, e.g. `rados osd op timeout = 10`) wins, unless it sets librados' default.
///
/// * `client_mount_timeout` 30 (librados: 300): give up on an unreachable cluster at start.
/// * `rados_osd_op_timeout` 30 (librados: 0, wait for ever): an OSD operation that gets no
///   answer fails with `ETIMEDOUT`, so a hung OSD or placement group turns into an I/O
///   error for the client (EIO) instead of a request that never ends, holding its
///   client's queue slot and its permits. A timed-out write's outcome is unknown (it may
///   still be applied), exactly as for a disk that returned an error: the range's content
///   is undefined until rewritten, and nothing was acknowledged.
/// * `rados_mon_op_timeout` 30 (librados: 0): the same for monitor commands (the
///   blocklisting at takeover, waiting for the newest OSD map).
///
/// 30 s is the Linux NBD client's default request timeout too, and the default lease
/// (`--rados-lease-ms`): a cluster that answers nothing at all for that long costs the node its
/// lease anyway (lease.rs).
const DEFAULT_TIMEOUTS: [(&CStr, &CStr, &CStr); 3] = [
    (c"client_mount_timeout", c"300", c"30"),
    (c"rados_osd_op_timeout", c"0", c"30"),
    (c"rados_mon_op_timeout", c"0", c"30"),
];

/// Most removals `Pool::remove_many` keeps in flight.
const REMOVE_WINDOW: usize = 64;

/// `Ok(n)` for a non-negative librados result, the errno otherwise.
fn check(ret: c_int, what: &str) -> io::Result<c_int> {
    if ret >= 0 {
        Ok(ret)
    } else {
        let e = io::Error::from_raw_os_error(-ret);
        Err(io::Error::new(e.kind(), format!("RADOS {what}: {e}")))
    }
}

fn c_string(s: &str, what: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    })
}

/// The name of the object holding physical extent `index` of device `device`, NUL-terminated
/// in a stack buffer (no allocation on the data path): `ext.<device>.<index as 8 hex>`.
pub(crate) struct ObjectName {
    buf: [u8; 24],
}

impl ObjectName {
    pub(crate) fn new(device: u32, index: u32) -> ObjectName {
        let mut buf = [0u8; 24];
        let mut cursor = &mut buf[..23];
        // At most "ext." + 10 digits + "." + 8 digits = 23 bytes, so this cannot fail; the
        // last byte stays NUL.
        let _ = write!(cursor, "ext.{device}.{index:08x}");
        ObjectName { buf }
    }

    pub(crate) fn as_c_str(&self) -> &CStr {
        // The buffer's last byte is always NUL.
        CStr::from_bytes_until_nul(&self.buf).unwrap_or(c"")
    }

    /// The device and extent an object name stands for, if it is one of ours.
    pub(crate) fn parse(name: &str) -> Option<(u32, u32)> {
        let rest = name.strip_prefix("ext.")?;
        let (device, index) = rest.split_once('.')?;
        if index.len() != 8 {
            return None;
        }
        Some((device.parse().ok()?, u32::from_str_radix(index, 16).ok()?))
    }
}

/// A connection to a Ceph cluster (`rados_t`).
struct Cluster(ffi::RadosT);

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.0.is_null() {
            return; // handed over (`Pool::drop`)
        }
        // SAFETY: the handle came from `rados_create`; every I/O context made from it was
        // destroyed first (`Pool` drops its context before its `Cluster`).
        unsafe { ffi::rados_shutdown(self.0) }
    }
}

// SAFETY: librados' handles may be used from any thread (see `Pool`); `Cluster` only moves
// to another thread to be shut down there (`Pool::drop`).
unsafe impl Send for Cluster {}

std::thread_local! {
    /// Set while this thread, one of librados', runs a completion's closure.
    static IN_COMPLETION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// How long a fenced node stays blocklisted, seconds: 30 days, not librados' default hour.
/// The blocklist is what keeps a fenced node's operations out once it runs again, those its
/// librados had sent before a pause and resends after it included (the node's own checks
/// stop only operations it has not sent yet: lease_clock.rs). So it has to outlast any pause
/// a fenced node may wake up from: a stopped process or a suspended VM can sleep through an
/// hour. An entry costs the OSD map a few dozen bytes, one per takeover of a node that did
/// not release its lease, and names one client instance (address and nonce), so it never
/// keeps out a restarted node. `ceph osd blocklist rm ADDR` ends one early once the fenced
/// process is known to be gone (docs/operations.md, "Fencing").
pub(crate) const FENCE_EXPIRY_S: u32 = 30 * 24 * 3600;

/// One pool and namespace of a cluster: where one store's extent objects live.
pub(crate) struct Pool {
    io: ffi::IoctxT,
    /// Declared after `io`: the context is destroyed before the connection shuts down.
    cluster: Cluster,
    pub(crate) label: String,
    /// Set once the store's lease is lost or released (`stop_io`): from then on every
    /// operation fails here, before it reaches the cluster.
    stopped: std::sync::OnceLock<String>,
    /// The data and metadata operations under way (rados_inflight.rs): a release waits for
    /// them to end before it unlocks.
    inflight: Arc<InFlight>,
    /// When the store's lease runs out (lease_clock.rs), once held: no operation is sent
    /// after that, even before the watchdog notices.
    lease_expiry: std::sync::OnceLock<LeaseExpiry>,
    /// The object whose commits carry a `cls_lock` assertion, and its input
    /// (cls_lock_assert.rs), once the node holds the object's lock.
    commit_guard: std::sync::OnceLock<(CString, Vec<u8>)>,
}

// SAFETY: librados' cluster and I/O-context handles may be used from any thread and from
// several threads at once (librados serialises internally); we never hand out the raw
// pointers, and destroy them only in `Drop`.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("label", &self.label).finish()
    }
}

impl Pool {
    /// Connects as the cephx user `client.<id>` (`RadosTarget::id`) with the settings of
    /// `conf` (which names its keyring) and opens `pool`, namespace `namespace`. Fails (after
    /// at most `client_mount_timeout`, 30 s unless `conf` says otherwise) when the cluster
    /// cannot be reached, the user's key is missing or wrong, and when the pool does not
    /// exist.
    pub(crate) fn connect(conf: &Path, id: &str, pool: &str, namespace: &str) -> io::Result<Pool> {
        crate::config::validate_rados_id(id).map_err(|why| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("RADOS user id {id:?} {why}"),
            )
        })?;
        let id_c = c_string(id, "RADOS user id")?;
        let conf_c = c_string(
            conf.to_str().ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "RADOS conf path is not UTF-8")
            })?,
            "RADOS conf path",
        )?;
        let pool_c = c_string(pool, "RADOS pool name")?;
        let ns_c = c_string(namespace, "RADOS namespace")?;
        let mut handle: ffi::RadosT = ptr::null_mut();
        // SAFETY: out-pointer to a local; a NUL-terminated id (librados prepends `client.`).
        check(
            unsafe { ffi::rados_create(&mut handle, id_c.as_ptr()) },
            "create",
        )?;
        let cluster = Cluster(handle);
        // SAFETY: valid handle, NUL-terminated path.
        check(
            unsafe { ffi::rados_conf_read_file(cluster.0, conf_c.as_ptr()) },
            &format!("reading {}", conf.display()),
        )?;
        // Our defaults (`DEFAULT_TIMEOUTS`) where the file left librados' own. (A value set
        // with `rados_conf_set` outranks the file's, so they cannot simply be set first.)
        for (option, librados_default, ours) in DEFAULT_TIMEOUTS {
            let mut buf = [0u8; 64];
            // SAFETY: valid handle, NUL-terminated name; librados writes at most `buf.len()`
            // bytes, NUL-terminated.
            let got = unsafe {
                ffi::rados_conf_get(
                    cluster.0,
                    option.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            let current = CStr::from_bytes_until_nul(&buf).unwrap_or(c"");
            if got == 0 && current != librados_default {
                continue;
            }
            // SAFETY: valid handle, NUL-terminated strings.
            check(
                unsafe { ffi::rados_conf_set(cluster.0, option.as_ptr(), ours.as_ptr()) },
                &format!("conf_set {}", option.to_string_lossy()),
            )?;
        }
        // SAFETY: valid, configured, not yet connected handle.
        check(
            unsafe { ffi::rados_connect(cluster.0) },
            &format!("connect as client.{id}"),
        )?;
        let mut io: ffi::IoctxT = ptr::null_mut();
        // SAFETY: connected handle, NUL-terminated pool name, out-pointer to a local.
        let ret = unsafe { ffi::rados_ioctx_create(cluster.0, pool_c.as_ptr(), &mut io) };
        if ret == -ENOENT {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("RADOS pool {pool} does not exist (ceph osd pool create {pool})"),
            ));
        }
        check(ret, &format!("opening pool {pool}"))?;
        // SAFETY: valid context; librados copies the namespace.
        unsafe { ffi::rados_ioctx_set_namespace(io, ns_c.as_ptr()) };
        Ok(Pool {
            io,
            cluster,
            label: format!("rados:{pool}/{namespace}"),
            stopped: std::sync::OnceLock::new(),
            inflight: Arc::default(),
            lease_expiry: std::sync::OnceLock::new(),
            commit_guard: std::sync::OnceLock::new(),
        })
    }

    /// Refuses every later data and metadata operation of this pool handle, before it
    /// reaches the cluster (the store's lease is lost, lease.rs: another node may be serving
    /// the store now; or released). Operations already sent are not recalled: see
    /// [`Pool::wait_drained`].
    pub(crate) fn stop_io(&self, why: &str) {
        let _ = self.stopped.set(why.to_owned());
    }

    /// Waits, at most `timeout`, until no operation admitted before `stop_io` is under way
    /// (asynchronous ones until their completion has run); whether none is.
    pub(crate) fn wait_drained(&self, timeout: std::time::Duration) -> bool {
        self.inflight.wait_drained(timeout)
    }

    /// Data and metadata operations under way now.
    pub(crate) fn ops_in_flight(&self) -> usize {
        self.inflight.count()
    }

    /// Starts one operation: counted as under way until the guard drops, or `Err` once
    /// `stop_io` was called (counted first, then checked: rados_inflight.rs).
    pub(crate) fn begin_op(&self) -> io::Result<OpGuard> {
        let guard = self.inflight.begin();
        if let Some(why) = self.stopped.get() {
            return Err(io::Error::other(format!(
                "RADOS store {}: this node stopped serving it: {why}",
                self.label
            )));
        }
        if self.lease_expiry.get().is_some_and(LeaseExpiry::expired) {
            tracing::warn!(
                store = self.label.as_str(),
                "refusing an operation: no renewal of the store's lease for a whole lease \
                 duration (the renewer is late, or the machine was suspended)"
            );
            return Err(io::Error::other(format!(
                "RADOS store {}: this node's lease may have run out (no renewal for a whole \
                 lease duration): not sending the operation",
                self.label
            )));
        }
        Ok(guard)
    }

    /// From now on, refuses every operation once the lease `expiry` describes may have run
    /// out (lease_clock.rs). Once: the lease is taken once per pool handle.
    pub(crate) fn watch_lease_expiry(&self, expiry: LeaseExpiry) {
        let _ = self.lease_expiry.set(expiry);
    }

    /// From now on, every omap commit to `oid` carries `lock.assert_locked` with
    /// `assert_op` (cls_lock_assert.rs) in the same operation: the OSD applies it only while
    /// the lock it names is current. Once per pool handle.
    pub(crate) fn guard_commits(&self, oid: &CStr, assert_op: Vec<u8>) {
        let _ = self.commit_guard.set((oid.to_owned(), assert_op));
    }

    /// A renewal sent at `sent` (on the lease's clock) succeeded.
    pub(crate) fn lease_renewed(&self, sent: std::time::Duration, duration: std::time::Duration) {
        if let Some(expiry) = self.lease_expiry.get() {
            expiry.renewed(sent, duration);
        }
    }

    /// Reads `buf.len()` bytes at `off` of object `oid`; a missing object, or bytes past its
    /// end, read as zeros.
    pub(crate) fn read(&self, oid: &CStr, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let _op = self.begin_op()?;
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: valid context and NUL-terminated name; `rest` is writable for its length.
            let ret = unsafe {
                ffi::rados_read(
                    self.io,
                    oid.as_ptr(),
                    rest.as_mut_ptr().cast::<c_char>(),
                    rest.len(),
                    off + done as u64,
                )
            };
            if ret == -ENOENT {
                break;
            }
            let n = check(ret, "read")? as usize;
            if n == 0 {
                break;
            }
            done += n.min(rest.len());
        }
        buf[done..].fill(0);
        Ok(())
    }

    /// Writes `data` at `off` of object `oid` (creating it), durably once this returns.
    pub(crate) fn write(&self, oid: &CStr, off: u64, data: &[u8]) -> io::Result<()> {
        let _op = self.begin_op()?;
        // SAFETY: valid context and NUL-terminated name; `data` is readable for its length.
        let ret = unsafe {
            ffi::rados_write(
                self.io,
                oid.as_ptr(),
                data.as_ptr().cast::<c_char>(),
                data.len(),
                off,
            )
        };
        check(ret, "write").map(|_| ())
    }

    /// Zeroes `[off, off + len)` of object `oid` (nothing to do where it does not exist).
    pub(crate) fn zero(&self, oid: &CStr, off: u64, len: u64) -> io::Result<()> {
        let _op = self.begin_op()?;
        // SAFETY: creates a fresh operation, released below on every path.
        let op = unsafe { ffi::rados_create_write_op() };
        if op.is_null() {
            return Err(io::Error::other(
                "RADOS: could not create a write operation",
            ));
        }
        // SAFETY: `op` is a live operation; valid context and name; null mtime = now.
        let ret = unsafe {
            ffi::rados_write_op_zero(op, off, len);
            let ret = ffi::rados_write_op_operate(op, self.io, oid.as_ptr(), ptr::null_mut(), 0);
            ffi::rados_release_write_op(op);
            ret
        };
        if ret == -ENOENT {
            return Ok(());
        }
        check(ret, "zero").map(|_| ())
    }

    /// Removes object `oid`; a missing object is already removed.
    pub(crate) fn remove(&self, oid: &CStr) -> io::Result<()> {
        let _op = self.begin_op()?;
        // SAFETY: valid context and NUL-terminated name.
        let ret = unsafe { ffi::rados_remove(self.io, oid.as_ptr()) };
        if ret == -ENOENT {
            return Ok(());
        }
        check(ret, "remove").map(|_| ())
    }

    /// Removes every object of `oids` (missing ones are already removed), with up to
    /// `REMOVE_WINDOW` asynchronous removals (`rados_aio_remove`) in flight: releasing a large
    /// volume, or the startup punch, would otherwise wait one round trip per object. No
    /// callback and no buffer is involved: each completion is waited for, in order, before it
    /// is released, also after an error; then the first error is returned.
    pub(crate) fn remove_many(&self, oids: impl IntoIterator<Item = ObjectName>) -> io::Result<()> {
        let _op = self.begin_op()?;
        let mut in_flight: std::collections::VecDeque<ffi::CompletionT> =
            std::collections::VecDeque::with_capacity(REMOVE_WINDOW);
        let mut first_error: Option<io::Error> = None;
        let finish = |c: ffi::CompletionT, first_error: &mut Option<io::Error>| {
            // SAFETY: `c` is a completion of a removal started below and not yet released;
            // it is released exactly once, after the removal completed.
            let ret = unsafe {
                ffi::rados_aio_wait_for_complete(c);
                let ret = ffi::rados_aio_get_return_value(c);
                ffi::rados_aio_release(c);
                ret
            };
            if ret != -ENOENT
                && let Err(e) = check(ret, "remove")
            {
                first_error.get_or_insert(e);
            }
        };
        for oid in oids {
            if first_error.is_some() {
                break;
            }
            if in_flight.len() == REMOVE_WINDOW
                && let Some(c) = in_flight.pop_front()
            {
                finish(c, &mut first_error);
            }
            let mut c: ffi::CompletionT = ptr::null_mut();
            // SAFETY: out-pointer to a local; no callback, so no argument.
            let ret = unsafe { ffi::rados_aio_create_completion2(ptr::null_mut(), None, &mut c) };
            if let Err(e) = check(ret, "aio completion") {
                first_error.get_or_insert(e);
                break;
            }
            // SAFETY: valid context, NUL-terminated name (librados copies it into the
            // operation before returning), fresh completion.
            let ret = unsafe { ffi::rados_aio_remove(self.io, oid.as_c_str().as_ptr(), c) };
            if let Err(e) = check(ret, "remove") {
                // SAFETY: the operation was not started; the completion is released once.
                unsafe { ffi::rados_aio_release(c) };
                first_error.get_or_insert(e);
                break;
            }
            in_flight.push_back(c);
        }
        while let Some(c) = in_flight.pop_front() {
            finish(c, &mut first_error);
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Whether object `oid` exists.
    pub(crate) fn exists(&self, oid: &CStr) -> io::Result<bool> {
        let _op = self.begin_op()?;
        let mut size = 0u64;
        let mut mtime: ffi::libc_time_t = 0;
        // SAFETY: valid context and name; out-pointers to locals.
        let ret = unsafe { ffi::rados_stat(self.io, oid.as_ptr(), &mut size, &mut mtime) };
        if ret == -ENOENT {
            return Ok(false);
        }
        check(ret, "stat").map(|_| true)
    }

    /// The names of every object in this pool's namespace.
    pub(crate) fn list(&self) -> io::Result<Vec<String>> {
        let _op = self.begin_op()?;
        let mut ctx: ffi::ListCtxT = ptr::null_mut();
        // SAFETY: valid context; out-pointer to a local.
        check(
            unsafe { ffi::rados_nobjects_list_open(self.io, &mut ctx) },
            "list",
        )?;
        let mut names = Vec::new();
        let result = loop {
            let mut entry: *const c_char = ptr::null();
            // SAFETY: live list context; key and namespace not wanted (null).
            let ret = unsafe {
                ffi::rados_nobjects_list_next(ctx, &mut entry, ptr::null_mut(), ptr::null_mut())
            };
            if ret == -ENOENT {
                break Ok(());
            }
            if let Err(e) = check(ret, "list") {
                break Err(e);
            }
            if !entry.is_null() {
                // SAFETY: librados returns a NUL-terminated name valid until the next call.
                let name = unsafe { CStr::from_ptr(entry) };
                names.push(name.to_string_lossy().into_owned());
            }
        };
        // SAFETY: the context opened above, closed once.
        unsafe { ffi::rados_nobjects_list_close(ctx) };
        result.map(|()| names)
    }
}

/// An omap change of one object, applied by `Pool::omap_commit` in one write operation.
#[derive(Debug, Default)]
pub(crate) struct OmapBatch {
    /// Key ranges `[begin, end)` removed first.
    pub rm_ranges: Vec<(Vec<u8>, Vec<u8>)>,
    /// Keys removed next.
    pub rm: Vec<Vec<u8>>,
    /// Keys set last.
    pub set: Vec<(Vec<u8>, Vec<u8>)>,
}

/// An object's omap entries, (key, value), sorted by key.
pub(crate) type OmapEntries = Vec<(Vec<u8>, Vec<u8>)>;

/// Most omap entries one read returns (the OSD's default cap is far above).
const OMAP_PAGE: u64 = 4096;

impl Pool {
    /// Applies `batch` to the omap of object `oid` (created if missing) in **one** write
    /// operation: RADOS applies all of it or none of it.
    pub(crate) fn omap_commit(&self, oid: &CStr, batch: &OmapBatch) -> io::Result<()> {
        let _op = self.begin_op()?;
        // SAFETY: creates a fresh operation, released below on every path.
        let op = unsafe { ffi::rados_create_write_op() };
        if op.is_null() {
            return Err(io::Error::other(
                "RADOS: could not create a write operation",
            ));
        }
        let rm_ptrs: Vec<*const c_char> = batch.rm.iter().map(|k| k.as_ptr().cast()).collect();
        let rm_lens: Vec<usize> = batch.rm.iter().map(Vec::len).collect();
        let key_ptrs: Vec<*const c_char> =
            batch.set.iter().map(|(k, _)| k.as_ptr().cast()).collect();
        let key_lens: Vec<usize> = batch.set.iter().map(|(k, _)| k.len()).collect();
        let val_ptrs: Vec<*const c_char> =
            batch.set.iter().map(|(_, v)| v.as_ptr().cast()).collect();
        let val_lens: Vec<usize> = batch.set.iter().map(|(_, v)| v.len()).collect();
        let guard = self
            .commit_guard
            .get()
            .filter(|(guarded, _)| guarded.as_c_str() == oid);
        let mut assert_ret: c_int = 0;
        // SAFETY: `op` is live until released at the end; librados copies keys and values
        // into the operation when each action is added; every array has the length passed;
        // the assertion's input and `assert_ret` outlive the operate call.
        let ret = unsafe {
            if let Some((_, input)) = guard {
                ffi::rados_write_op_exec(
                    op,
                    c"lock".as_ptr(),
                    c"assert_locked".as_ptr(),
                    input.as_ptr().cast(),
                    input.len(),
                    &mut assert_ret,
                );
            }
            ffi::rados_write_op_create(op, 0, ptr::null());
            for (b, e) in &batch.rm_ranges {
                ffi::rados_write_op_omap_rm_range2(
                    op,
                    b.as_ptr().cast(),
                    b.len(),
                    e.as_ptr().cast(),
                    e.len(),
                );
            }
            if !rm_ptrs.is_empty() {
                ffi::rados_write_op_omap_rm_keys2(
                    op,
                    rm_ptrs.as_ptr(),
                    rm_lens.as_ptr(),
                    rm_ptrs.len(),
                );
            }
            if !key_ptrs.is_empty() {
                ffi::rados_write_op_omap_set2(
                    op,
                    key_ptrs.as_ptr(),
                    val_ptrs.as_ptr(),
                    key_lens.as_ptr(),
                    val_lens.as_ptr(),
                    key_ptrs.len(),
                );
            }
            let ret = ffi::rados_write_op_operate(op, self.io, oid.as_ptr(), ptr::null_mut(), 0);
            ffi::rados_release_write_op(op);
            ret
        };
        if guard.is_some() && ret < 0 && assert_ret < 0 {
            tracing::error!(
                store = self.label.as_str(),
                errno = -assert_ret,
                "a metadata commit was refused by the OSD: this node's lock on the metadata \
                 object is no longer current"
            );
            return Err(io::Error::other(format!(
                "RADOS store {}: commit refused by the OSD: this node's lock on the metadata \
                 object is no longer current (expired or taken over; errno {})",
                self.label, -assert_ret
            )));
        }
        check(ret, "omap write").map(|_| ())
    }

    /// Every omap entry of object `oid` whose key starts with `prefix` (`c""`: all), sorted
    /// by key; `None` when the object does not exist. Read in pages of `OMAP_PAGE` entries.
    pub(crate) fn omap_load(&self, oid: &CStr, prefix: &CStr) -> io::Result<Option<OmapEntries>> {
        let _op = self.begin_op()?;
        let mut out: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        loop {
            let after = match out.last() {
                Some((k, _)) => c_string(
                    std::str::from_utf8(k).map_err(|_| {
                        io::Error::new(io::ErrorKind::InvalidData, "omap key is not UTF-8")
                    })?,
                    "omap key",
                )?,
                None => CString::default(),
            };
            // SAFETY: creates a fresh operation, released below on every path.
            let op = unsafe { ffi::rados_create_read_op() };
            if op.is_null() {
                return Err(io::Error::other("RADOS: could not create a read operation"));
            }
            let mut iter: ffi::OmapIterT = ptr::null_mut();
            let mut more: u8 = 0;
            let mut rval: c_int = 0;
            // SAFETY: live operation; out-pointers to locals that outlive `operate`;
            // NUL-terminated strings.
            let ret = unsafe {
                ffi::rados_read_op_omap_get_vals2(
                    op,
                    after.as_ptr(),
                    prefix.as_ptr(),
                    OMAP_PAGE,
                    &mut iter,
                    &mut more,
                    &mut rval,
                );
                ffi::rados_read_op_operate(op, self.io, oid.as_ptr(), 0)
            };
            let result = if ret == -ENOENT {
                Ok(false)
            } else {
                check(ret, "omap read")
                    .and_then(|_| check(rval, "omap read"))
                    .map(|_| true)
            };
            let mut got = 0u64;
            if matches!(result, Ok(true)) && !iter.is_null() {
                loop {
                    let mut k: *mut c_char = ptr::null_mut();
                    let mut v: *mut c_char = ptr::null_mut();
                    let (mut kl, mut vl) = (0usize, 0usize);
                    // SAFETY: live iterator; out-pointers to locals.
                    let r = unsafe {
                        ffi::rados_omap_get_next2(iter, &mut k, &mut v, &mut kl, &mut vl)
                    };
                    if r < 0 || k.is_null() {
                        break;
                    }
                    // SAFETY: librados returns buffers of the given lengths, valid until
                    // the iterator ends.
                    let (key, val) = unsafe {
                        (
                            std::slice::from_raw_parts(k.cast::<u8>(), kl).to_vec(),
                            if v.is_null() {
                                Vec::new()
                            } else {
                                std::slice::from_raw_parts(v.cast::<u8>(), vl).to_vec()
                            },
                        )
                    };
                    out.push((key, val));
                    got += 1;
                }
            }
            // SAFETY: the iterator (if any) and the operation are released once each.
            unsafe {
                if !iter.is_null() {
                    ffi::rados_omap_get_end(iter);
                }
                ffi::rados_release_read_op(op);
            }
            match result {
                Ok(false) => return Ok(None),
                Err(e) => return Err(e),
                Ok(true) => {}
            }
            if more == 0 || got == 0 {
                return Ok(Some(out));
            }
        }
    }

    /// This client's address as the monitors know it (what `blocklist` takes).
    pub(crate) fn client_addr(&self) -> io::Result<String> {
        let mut out: *mut c_char = ptr::null_mut();
        // SAFETY: connected handle; out-pointer to a local.
        check(
            unsafe { ffi::rados_getaddrs(self.cluster.0, &mut out) },
            "getaddrs",
        )?;
        if out.is_null() {
            return Err(io::Error::other("RADOS getaddrs returned nothing"));
        }
        // SAFETY: a NUL-terminated string librados allocated; freed once, after copying.
        let s = unsafe {
            let s = CStr::from_ptr(out).to_string_lossy().into_owned();
            ffi::rados_buffer_free(out);
            s
        };
        Ok(s)
    }

    /// Blocklists client address `addr` on every OSD (librados' default expiry, one hour),
    /// then waits for the newest OSD map, so ops this client sends from now on carry an
    /// epoch in which `addr` is blocklisted.
    pub(crate) fn blocklist(&self, addr: &str) -> io::Result<()> {
        let c = c_string(addr, "client address")?;
        let mut bytes = c.into_bytes_with_nul();
        // SAFETY: connected handle; a NUL-terminated buffer librados only reads.
        check(
            unsafe {
                ffi::rados_blocklist_add(self.cluster.0, bytes.as_mut_ptr().cast(), FENCE_EXPIRY_S)
            },
            &format!("blocklist add {addr}"),
        )?;
        // SAFETY: connected handle.
        check(
            unsafe { ffi::rados_wait_for_latest_osdmap(self.cluster.0) },
            "wait for the OSD map",
        )
        .map(|_| ())
    }

    /// Takes (`renew == false`) or renews (`renew == true`: only while still held) the
    /// exclusive lock `name` on object `oid` with `cookie` for `duration`. `Ok(false)` when
    /// another client holds it (or, renewing, when it is no longer ours).
    pub(crate) fn lock_exclusive(
        &self,
        oid: &CStr,
        name: &CStr,
        cookie: &CStr,
        duration: std::time::Duration,
        renew: bool,
    ) -> io::Result<bool> {
        let mut tv = ffi::Timeval {
            tv_sec: duration.as_secs() as i64,
            tv_usec: i64::from(duration.subsec_micros()),
        };
        // LIBRADOS_LOCK_FLAG_MUST_RENEW: renew only a lock this (client, cookie) holds.
        let flags = if renew { 2 } else { 0 };
        // SAFETY: valid context; NUL-terminated strings; `tv` outlives the call.
        let ret = unsafe {
            ffi::rados_lock_exclusive(
                self.io,
                oid.as_ptr(),
                name.as_ptr(),
                cookie.as_ptr(),
                c"headroom lease".as_ptr(),
                &mut tv,
                flags,
            )
        };
        if ret == -EBUSY || (renew && ret == -ENOENT) {
            return Ok(false);
        }
        check(ret, "lock").map(|_| true)
    }

    /// Who holds lock `name` on `oid` now, as the OSD recorded each holder from its
    /// connection (client, cookie, address; expired holders are not listed): empty when
    /// nobody does, or the object does not exist.
    pub(crate) fn lockers(
        &self,
        oid: &CStr,
        name: &CStr,
    ) -> io::Result<Vec<crate::cls_lock_info::LockHolder>> {
        let mut cap = 512usize;
        loop {
            let mut exclusive: c_int = 0;
            let (mut tag, mut clients, mut cookies, mut addrs) = (
                vec![0u8; cap],
                vec![0u8; cap],
                vec![0u8; cap],
                vec![0u8; cap],
            );
            let (mut tag_len, mut clients_len, mut cookies_len, mut addrs_len) =
                (cap, cap, cap, cap);
            // SAFETY: valid context; NUL-terminated names; four buffers of the lengths given,
            // which librados fills with NUL-separated strings (or raises on ERANGE).
            let ret = unsafe {
                ffi::rados_list_lockers(
                    self.io,
                    oid.as_ptr(),
                    name.as_ptr(),
                    &mut exclusive,
                    tag.as_mut_ptr().cast(),
                    &mut tag_len,
                    clients.as_mut_ptr().cast(),
                    &mut clients_len,
                    cookies.as_mut_ptr().cast(),
                    &mut cookies_len,
                    addrs.as_mut_ptr().cast(),
                    &mut addrs_len,
                )
            };
            if ret == -(ENOENT as isize) {
                return Ok(Vec::new());
            }
            if ret == -(ERANGE as isize) {
                let need = tag_len.max(clients_len).max(cookies_len).max(addrs_len);
                if need <= cap || need > MAX_XATTR_BYTES {
                    return Err(io::Error::other(format!(
                        "RADOS list lockers: asks for {need} bytes of buffer"
                    )));
                }
                cap = need;
                continue;
            }
            let count = check(c_int::try_from(ret).unwrap_or(-ERANGE), "list lockers")? as usize;
            let split = |buf: &[u8], len: usize| -> Vec<String> {
                buf[..len.min(buf.len())]
                    .split(|&b| b == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect()
            };
            let (clients, cookies, addrs) = (
                split(&clients, clients_len),
                split(&cookies, cookies_len),
                split(&addrs, addrs_len),
            );
            if clients.len() != count || cookies.len() != count || addrs.len() != count {
                return Err(io::Error::other(format!(
                    "RADOS list lockers: {count} lockers but {} clients, {} cookies, {} addresses",
                    clients.len(),
                    cookies.len(),
                    addrs.len()
                )));
            }
            return Ok(clients
                .into_iter()
                .zip(cookies)
                .zip(addrs)
                .map(
                    |((client, cookie), addr)| crate::cls_lock_info::LockHolder {
                        client,
                        cookie,
                        // `v1:IP:PORT/NONCE` here, `IP:PORT/NONCE` in the lock's raw state and in
                        // `ceph osd blocklist ls` (the monitors drop the type): one form.
                        addr: ["v1:", "v2:", "any:"]
                            .iter()
                            .find_map(|p| addr.strip_prefix(p))
                            .unwrap_or(&addr)
                            .to_owned(),
                        expires_unix_s: None,
                    },
                )
                .collect());
        }
    }

    /// The xattr `name` of object `oid`; `None` when the object or the xattr does not exist.
    pub(crate) fn xattr(&self, oid: &CStr, name: &CStr) -> io::Result<Option<Vec<u8>>> {
        let mut cap = 4096usize;
        loop {
            let mut buf = vec![0u8; cap];
            // SAFETY: valid context; NUL-terminated names; a buffer of `cap` bytes.
            let ret = unsafe {
                ffi::rados_getxattr(
                    self.io,
                    oid.as_ptr(),
                    name.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    cap,
                )
            };
            if ret == -ENOENT || ret == -ENODATA {
                return Ok(None);
            }
            if ret == -ERANGE && cap < MAX_XATTR_BYTES {
                cap *= 16;
                continue;
            }
            let len = check(ret, "getxattr")? as usize;
            buf.truncate(len);
            return Ok(Some(buf));
        }
    }

    /// Releases lock `name` on `oid` held with `cookie` (nothing if it is not held).
    /// Removes `client`'s (`client.<num>`) lock `name` with `cookie` from `oid`: a holder
    /// that can no longer write (fenced) but whose lock has not expired yet.
    pub(crate) fn break_lock(
        &self,
        oid: &CStr,
        name: &CStr,
        client: &str,
        cookie: &str,
    ) -> io::Result<()> {
        let client = c_string(client, "lock holder")?;
        let cookie = c_string(cookie, "lock cookie")?;
        // SAFETY: valid context; NUL-terminated strings.
        let ret = unsafe {
            ffi::rados_break_lock(
                self.io,
                oid.as_ptr(),
                name.as_ptr(),
                client.as_ptr(),
                cookie.as_ptr(),
            )
        };
        if ret == -ENOENT {
            return Ok(());
        }
        check(ret, "break lock").map(|_| ())
    }

    pub(crate) fn unlock(&self, oid: &CStr, name: &CStr, cookie: &CStr) -> io::Result<()> {
        // SAFETY: valid context; NUL-terminated strings.
        let ret =
            unsafe { ffi::rados_unlock(self.io, oid.as_ptr(), name.as_ptr(), cookie.as_ptr()) };
        if ret == -ENOENT {
            return Ok(());
        }
        check(ret, "unlock").map(|_| ())
    }
}

/// What an asynchronous read or write does with its buffer and result when it completes.
pub(crate) type AioCallback<B> = Box<dyn FnOnce(B, io::Result<()>) + Send + 'static>;

/// What an asynchronous read or write owns while librados works on it: the buffer (librados
/// reads from or writes into it) and what to do with the result. Boxed, so the buffer's
/// address does not change between submission and completion.
struct AioOp<B> {
    buf: B,
    /// Counts the operation as under way until the completion has run (dropped with the op).
    _op: Option<OpGuard>,
    /// The bytes of `buf` the operation covers.
    range: std::ops::Range<usize>,
    done: Option<AioCallback<B>>,
    read: bool,
}

/// The completion callback of `Pool::aio_read` / `aio_write`, on a librados thread: takes the
/// operation back, finishes a read (zeros past the object's end), runs `done` once.
unsafe extern "C" fn aio_complete<B: AsMut<[u8]> + Send + 'static>(
    c: ffi::CompletionT,
    arg: *mut std::ffi::c_void,
) {
    // SAFETY: `arg` is the `Box<AioOp<B>>` leaked by `aio_submit` for this completion, whose
    // callback librados runs exactly once; `c` stays valid during the callback and is
    // released here once (librados frees it when its last reference is gone).
    let (mut op, ret) = unsafe {
        let op = Box::from_raw(arg.cast::<AioOp<B>>());
        let ret = ffi::rados_aio_get_return_value(c);
        ffi::rados_aio_release(c);
        (op, ret)
    };
    let result = if op.read {
        let range = op.range.clone();
        let dst = &mut op.buf.as_mut()[range];
        match ret {
            r if r == -ENOENT => {
                dst.fill(0);
                Ok(())
            }
            r => check(r, "read").map(|n| {
                let n = (n as usize).min(dst.len());
                dst[n..].fill(0);
            }),
        }
    } else {
        check(ret, "write").map(|_| ())
    };
    if let Some(done) = op.done.take() {
        let buf = op.buf;
        // Never unwind into librados.
        IN_COMPLETION.set(true);
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || done(buf, result)))
            .is_err()
        {
            tracing::error!("a RADOS completion panicked");
        }
        IN_COMPLETION.set(false);
    }
}

impl Pool {
    /// Starts reading `buf[range]` from offset `off` of object `oid` and returns at once;
    /// `done` gets the buffer back with the result on a librados thread (or, if the read
    /// could not be started, on this one before this returns). A missing object, and bytes
    /// past its end, read as zeros. `done` must not block for long: it holds up the
    /// completions behind it.
    pub(crate) fn aio_read<B: AsMut<[u8]> + Send + 'static>(
        &self,
        oid: &CStr,
        off: u64,
        buf: B,
        range: std::ops::Range<usize>,
        done: AioCallback<B>,
    ) {
        self.aio_submit(oid, off, buf, range, done, true);
    }

    /// Starts writing `buf[range]` at offset `off` of object `oid` (creating it) and returns
    /// at once; `done` as for `aio_read`. A write `done` sees succeed is durable (rados.rs,
    /// "Durability").
    pub(crate) fn aio_write<B: AsMut<[u8]> + Send + 'static>(
        &self,
        oid: &CStr,
        off: u64,
        buf: B,
        range: std::ops::Range<usize>,
        done: AioCallback<B>,
    ) {
        self.aio_submit(oid, off, buf, range, done, false);
    }

    fn aio_submit<B: AsMut<[u8]> + Send + 'static>(
        &self,
        oid: &CStr,
        off: u64,
        buf: B,
        range: std::ops::Range<usize>,
        done: AioCallback<B>,
        read: bool,
    ) {
        let mut op = Box::new(AioOp {
            buf,
            _op: None,
            range,
            done: Some(done),
            read,
        });
        let fail = |mut op: Box<AioOp<B>>, e: io::Error| {
            if let Some(done) = op.done.take() {
                done(op.buf, Err(e));
            }
        };
        match self.begin_op() {
            Ok(guard) => op._op = Some(guard),
            Err(e) => return fail(op, e),
        }
        let Some(slice) = op.buf.as_mut().get_mut(op.range.clone()) else {
            return fail(
                op,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "RADOS I/O range outside its buffer",
                ),
            );
        };
        let (ptr, len) = (slice.as_mut_ptr(), slice.len());
        let mut c: ffi::CompletionT = ptr::null_mut();
        let arg = Box::into_raw(op);
        // SAFETY: out-pointer to a local; the callback is `aio_complete::<B>`, whose argument
        // `arg` is the leaked box, reclaimed either by the callback or below.
        let ret = unsafe {
            ffi::rados_aio_create_completion2(arg.cast(), Some(aio_complete::<B>), &mut c)
        };
        if let Err(e) = check(ret, "aio completion") {
            // SAFETY: no operation was started: the box is still ours, reclaimed once.
            return fail(unsafe { Box::from_raw(arg) }, e);
        }
        // SAFETY: valid context and NUL-terminated name (librados copies it before
        // returning); `ptr`/`len` point into the boxed buffer, which stays where it is and is
        // not touched by us until the callback hands it back; fresh completion.
        let ret = unsafe {
            if read {
                ffi::rados_aio_read(self.io, oid.as_ptr(), c, ptr.cast(), len, off)
            } else {
                ffi::rados_aio_write(self.io, oid.as_ptr(), c, ptr.cast::<c_char>(), len, off)
            }
        };
        if let Err(e) = check(ret, if read { "read" } else { "write" }) {
            // SAFETY: the operation was not started, so the callback will not run: the
            // completion is released once and the box reclaimed once.
            let op = unsafe {
                ffi::rados_aio_release(c);
                Box::from_raw(arg)
            };
            fail(op, e);
        }
    }
}

/// An I/O context on its way to being destroyed on another thread.
struct IoctxToClose(ffi::IoctxT);

// SAFETY: as for `Pool`; it is used by one thread only, the one that destroys it.
unsafe impl Send for IoctxToClose {}

impl Drop for Pool {
    /// Waits for the asynchronous operations still in flight (their closures have run),
    /// then destroys the context and shuts the connection down. When the last reference
    /// goes away inside a completion's closure, that is one of librados' own threads, which
    /// cannot wait for librados (nor shut it down): a thread of ours does it then.
    fn drop(&mut self) {
        let io = IoctxToClose(self.io);
        let cluster = std::mem::replace(&mut self.cluster, Cluster(ptr::null_mut()));
        let close = move || {
            let io = io;
            // SAFETY: the context came from `rados_ioctx_create` and is destroyed once,
            // before the cluster handle, after every asynchronous operation on it completed.
            unsafe {
                ffi::rados_aio_flush(io.0);
                ffi::rados_ioctx_destroy(io.0);
            }
            drop(cluster);
        };
        if !IN_COMPLETION.get() {
            return close();
        }
        if let Err(e) = std::thread::Builder::new()
            .name("headroom-rados-close".into())
            .spawn(close)
        {
            // Leaked (the closure went with the failed spawn): better than a deadlock.
            tracing::warn!("could not close the RADOS connection: {e}");
        }
    }
}

/// A fresh namespace name for a new store: `headroom-` and 16 random hex digits.
pub(crate) fn new_namespace() -> io::Result<String> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))?;
    Ok(format!("headroom-{:016x}", u64::from_le_bytes(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names_round_trip() {
        for (d, i) in [(0, 0), (0, 42), (63, u32::MAX)] {
            let name = ObjectName::new(d, i);
            let s = name.as_c_str().to_str().unwrap();
            assert_eq!(ObjectName::parse(s), Some((d, i)));
        }
        assert_eq!(ObjectName::new(0, 42).as_c_str(), c"ext.0.0000002a");
        assert_eq!(ObjectName::parse("ext.0.2a"), None);
        assert_eq!(ObjectName::parse("rbd_data.1"), None);
    }
}
