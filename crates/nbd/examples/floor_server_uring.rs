//! floor_server_uring: `floor_server` on io_uring, to measure whether io_uring goes below the
//! floor (docs/results.md, "The floor") — a yardstick, not a product.
//!
//! Why it exists: `floor_server` shows the least CPU per I/O of a server on sockets with
//! blocking `read`/`writev` (one `read` and one `writev` per batch of requests, and a sleep and
//! a wake-up in `read`). An open question is whether io_uring (multishot receive into
//! provided buffers, a batch's send and the next receive in one system call) costs less. This
//! server is the same protocol work as `floor_server` (the handshake and the request parser
//! are shared, in `floor/mod.rs`) with the transmission phase on io_uring, so the two compare.
//!
//! What it does: one blocking thread, one connection at a time; the handshake with blocking std
//! I/O, then one ring per connection. The ring is set up with `IORING_SETUP_SINGLE_ISSUER |
//! IORING_SETUP_DEFER_TASKRUN` (one thread submits everything, and the kernel runs the
//! completions' task work only when that thread asks for completions, instead of interrupting
//! it whenever a socket event lands: the setup io_uring's authors advise for a thread that
//! owns its ring); `--plain-ring`, or a kernel that refuses those flags, gives a ring without
//! them. The ring's own fd is registered (`IORING_REGISTER_RING_FDS`), so each
//! `io_uring_enter` skips looking it up, unless the kernel refuses. Receiving is one of:
//! - multishot (the default when the kernel takes it): one multishot `recv` stays armed on a
//!   ring of provided buffers (`RECV_BUFS` x `RECV_BUF_BYTES`); each completion's bytes are
//!   copied into the input buffer (a copy `floor_server` does not make: the price of buffers
//!   the kernel picks) and the buffer goes back to the ring at once;
//! - single-shot (`--single`, or when multishot is refused): one `recv` into the free end of
//!   the input buffer, posted again after each completion.
//!
//! After input arrives it parses every complete request as `floor_server` does (READ: replied
//! from RAM, copied into a reply buffer first with `--copy`; WRITE: copied into RAM; DISC: the
//! connection ends after the replies), and submits one `sendmsg` (MSG_WAITALL: the kernel
//! finishes a send that fits only in part) with all replies of the batch, with the next
//! `recv` in the same `io_uring_enter` that waits for both (`min_complete` 2: it wakes once,
//! when both are done, not at the first), so a batch costs one system call.
//! The single-shot `recv` is linked after the send (it starts when the send is done; a send
//! that ends short cancels it, so the wait for both always ends). A send that ends short
//! (the kernel ends a MSG_WAITALL send early only on an error or a signal) is resubmitted
//! with the rest. With multishot the wait for both has a 1 s timeout, for the same case.
//! It says on stderr at start which receive runs (a line with `recv: `) and how the ring is
//! set up (lines with `ring: `). Replies are structured unless `--simple` (see `floor/mod.rs`).
//!
//! Usage: `cargo run --release -p headroom-nbd --example floor_server_uring -- 127.0.0.1:PORT
//! SIZE_MIB [--copy] [--single] [--simple] [--plain-ring]`. The export has any name; it lives in RAM, filled with a
//! pseudo-random pattern at start. Trusted clients only: it checks bounds (a bad request ends
//! the connection) and nothing more.

// The kernel reads and writes this program's buffers after the calls that hand them over
// return (io_uring's contract): pushing an entry and the provided-buffer ring are unsafe.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::io::IoSlice;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use io_uring::types::{BufRingEntry, Fd, SubmitArgs, Timespec};
use io_uring::{CompletionQueue, IoUring, SubmissionQueue, Submitter, cqueue, opcode, squeue};

mod floor;

/// Buffers in the provided-buffer ring (a power of two) and the size of each.
const RECV_BUFS: u16 = 64;
const RECV_BUF_BYTES: usize = 64 << 10;
const BUF_GROUP: u16 = 0;
const RECV: u64 = 1;
const SEND: u64 = 2;
const CANCEL: u64 = 3;
/// Submission queue entries of a connection's ring (at most three in flight: recv, send and a
/// cancel).
const RING_ENTRIES: u32 = 8;

/// How the rings are set up (decided once at start, from what the kernel takes).
#[derive(Clone, Copy, Debug)]
struct RingSetup {
    /// `IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN`.
    defer_taskrun: bool,
    /// Register the ring's fd (`IORING_REGISTER_RING_FDS`).
    register_fd: bool,
}

impl RingSetup {
    fn build(self) -> std::io::Result<IoUring> {
        let mut builder = IoUring::builder();
        if self.defer_taskrun {
            builder.setup_single_issuer().setup_defer_taskrun();
        }
        builder.build(RING_ENTRIES)
    }

    /// Tries the flags on a ring of its own and says on stderr what runs.
    fn probe(plain: bool) -> Self {
        let mut setup = RingSetup {
            defer_taskrun: !plain,
            register_fd: true,
        };
        if !plain && let Err(err) = setup.build() {
            eprintln!("floor_server_uring: the kernel refused SINGLE_ISSUER|DEFER_TASKRUN: {err}");
            setup.defer_taskrun = false;
        }
        let registered = setup.build().and_then(|mut ring| {
            let (mut submitter, _, _) = ring.split();
            submitter.register_ring_fd()?;
            submitter.unregister_ring_fd()
        });
        if let Err(err) = registered {
            eprintln!("floor_server_uring: the kernel refused to register the ring's fd: {err}");
            setup.register_fd = false;
        }
        setup
    }

    /// What runs, for the log.
    fn describe(self) -> &'static str {
        match (self.defer_taskrun, self.register_fd) {
            (true, true) => "SINGLE_ISSUER|DEFER_TASKRUN, fd registered",
            (true, false) => "SINGLE_ISSUER|DEFER_TASKRUN",
            (false, true) => "no setup flags, fd registered",
            (false, false) => "no setup flags",
        }
    }
}

fn main() -> std::io::Result<()> {
    let (addr, size_mib, flags) = floor::args(
        "floor_server_uring ADDR SIZE_MIB [--copy] [--single] [--simple] [--plain-ring]",
    )?;
    let copy = flags.iter().any(|a| a == "--copy");
    let allow_structured = floor::structured_allowed(&flags);
    let setup = RingSetup::probe(flags.iter().any(|a| a == "--plain-ring"));
    eprintln!("floor_server_uring: ring: {}", setup.describe());
    let mut multishot = !flags.iter().any(|a| a == "--single");
    if multishot {
        // Try it once: a kernel without provided-buffer rings refuses the registration.
        let probe = setup.build().and_then(|ring| {
            let bufs = BufRing::new(&ring.submitter())?;
            drop(ring); // before the buffers it was given
            drop(bufs);
            Ok(())
        });
        match probe {
            Ok(()) => eprintln!(
                "floor_server_uring: recv: multishot into a provided-buffer ring ({RECV_BUFS} x \
                 {} KiB)",
                RECV_BUF_BYTES >> 10
            ),
            Err(err) => {
                eprintln!("floor_server_uring: recv: single-shot (multishot refused: {err})");
                multishot = false;
            }
        }
    } else {
        eprintln!("floor_server_uring: recv: single-shot (--single)");
    }
    let mut data = floor::export(size_mib);
    let listener = TcpListener::bind(addr)?;
    for stream in listener.incoming() {
        let mut s = stream?;
        let result = floor::handshake(&mut s, data.len() as u64, allow_structured).and_then(|go| {
            let Some(structured) = go else {
                return Ok(());
            };
            let batch = floor::Batch::new(copy, structured);
            let mut ring = setup.build()?;
            match Conn::new(&mut ring, setup, &s, multishot) {
                Ok(mut conn) => return conn.transmit(&mut data, batch),
                Err(err) if multishot => {
                    eprintln!("floor_server_uring: recv: single-shot (multishot failed: {err})");
                    multishot = false;
                }
                Err(err) => return Err(err),
            }
            let mut ring = setup.build()?;
            Conn::new(&mut ring, setup, &s, false)?.transmit(&mut data, batch)
        });
        if let Err(err) = result {
            eprintln!("floor_server_uring: connection ended: {err}");
        }
    }
    Ok(())
}

/// A ring of provided buffers the kernel picks from for the multishot `recv`.
struct BufRing {
    entries: *mut BufRingEntry,
    layout: Layout,
    bufs: Vec<u8>,
    tail: u16,
}

impl BufRing {
    /// Registers the ring with the ring of `submitter` (group `BUF_GROUP`) and provides all
    /// its buffers.
    fn new(submitter: &Submitter<'_>) -> std::io::Result<Self> {
        let layout = Layout::from_size_align(
            usize::from(RECV_BUFS) * std::mem::size_of::<BufRingEntry>(),
            4096,
        )
        .map_err(std::io::Error::other)?;
        // SAFETY: a layout of non-zero size.
        let entries = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<BufRingEntry>();
        if entries.is_null() {
            return Err(std::io::ErrorKind::OutOfMemory.into());
        }
        let mut this = BufRing {
            entries,
            layout,
            bufs: vec![0u8; usize::from(RECV_BUFS) * RECV_BUF_BYTES],
            tail: 0,
        };
        // SAFETY: `entries` is page aligned, holds RECV_BUFS entries and lives until it is
        // unregistered (`Conn`'s drop) or the ring is gone; a failed registration keeps nothing.
        unsafe { submitter.register_buf_ring_with_flags(entries as u64, RECV_BUFS, BUF_GROUP, 0)? };
        for bid in 0..RECV_BUFS {
            this.provide(bid);
        }
        Ok(this)
    }

    /// Hands buffer `bid` (back) to the kernel.
    fn provide(&mut self, bid: u16) {
        let at = usize::from(self.tail & (RECV_BUFS - 1));
        // SAFETY: `at` < RECV_BUFS; the kernel reads entries only up to the published tail,
        // and this one is past it until the store below.
        let entry = unsafe { &mut *self.entries.add(at) };
        let offset = usize::from(bid) * RECV_BUF_BYTES;
        entry.set_addr(self.bufs[offset..].as_mut_ptr() as u64);
        entry.set_len(RECV_BUF_BYTES as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the tail is a u16 in the ring's first entry, which the kernel reads; the
        // release store publishes the entry written above.
        unsafe {
            AtomicU16::from_ptr(BufRingEntry::tail(self.entries).cast_mut())
                .store(self.tail, Ordering::Release);
        }
    }

    fn buf(&self, bid: u16, len: usize) -> std::io::Result<&[u8]> {
        let offset = usize::from(bid) * RECV_BUF_BYTES;
        if bid >= RECV_BUFS || len > RECV_BUF_BYTES {
            return Err(floor::bad("provided buffer out of range"));
        }
        Ok(&self.bufs[offset..offset + len])
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the ring that used it is gone or no
        // longer knows it (unregistered).
        unsafe { std::alloc::dealloc(self.entries.cast(), self.layout) };
    }
}

/// One connection's transmission phase, on a ring it borrows (the caller's, made for it). Its
/// drop ends everything in flight and unregisters what it registered, before the ring goes.
struct Conn<'r> {
    submitter: Submitter<'r>,
    sq: SubmissionQueue<'r>,
    cq: CompletionQueue<'r>,
    /// Some: multishot receive from this ring of buffers (registered with the ring).
    bufs: Option<BufRing>,
    fd: Fd,
    inbuf: Vec<u8>,
    /// The batch being sent: its slices (raw, borrowed from the batch and the export, which
    /// stay untouched until the send completes) and the message that points at them.
    iov: Vec<libc::iovec>,
    msg: Box<libc::msghdr>,
    /// Whether a recv (armed multishot or posted single-shot) / a send is in flight.
    recv_busy: bool,
    send_busy: bool,
    /// Bytes of the batch not sent yet, and the first slice they start in.
    send_left: usize,
    send_at: usize,
}

impl<'r> Conn<'r> {
    fn new(
        ring: &'r mut IoUring,
        setup: RingSetup,
        s: &TcpStream,
        multishot: bool,
    ) -> std::io::Result<Self> {
        let (mut submitter, sq, cq) = ring.split();
        if setup.register_fd {
            // Refused only if the thread's table of registered rings is full; run without.
            let _ = submitter.register_ring_fd();
        }
        let bufs = if multishot {
            match BufRing::new(&submitter) {
                Ok(bufs) => Some(bufs),
                Err(err) => {
                    let _ = submitter.unregister_ring_fd();
                    return Err(err);
                }
            }
        } else {
            None
        };
        Ok(Conn {
            submitter,
            sq,
            cq,
            bufs,
            fd: Fd(s.as_raw_fd()),
            inbuf: vec![0u8; floor::INBUF_BYTES],
            iov: Vec::with_capacity(2 * floor::MAX_BATCH),
            // SAFETY: msghdr is plain data; all zeros is an empty message.
            msg: Box::new(unsafe { std::mem::zeroed() }),
            recv_busy: false,
            send_busy: false,
            send_left: 0,
            send_at: 0,
        })
    }

    fn push(&mut self, entry: &squeue::Entry) -> std::io::Result<()> {
        // SAFETY: every entry points at buffers of `self` (or the export and the batch) that
        // stay in place and untouched until its completion (see `transmit`).
        unsafe {
            if self.sq.push(entry).is_err() {
                self.sq.sync();
                self.submitter.submit()?;
                self.sq.sync();
                self.sq
                    .push(entry)
                    .map_err(|_| std::io::Error::other("submission queue full"))?;
            }
        }
        Ok(())
    }

    /// Submits what is queued and waits for `want` completions (for at most `timeout`, if
    /// given), then takes every completion there is into `cqes`.
    fn wait(
        &mut self,
        want: usize,
        timeout: Option<Duration>,
        cqes: &mut Vec<(u64, i32, u32)>,
    ) -> std::io::Result<()> {
        self.sq.sync();
        let waited = match timeout {
            Some(timeout) => {
                let ts = Timespec::from(timeout);
                self.submitter
                    .submit_with_args(want, &SubmitArgs::new().timespec(&ts))
            }
            None => self.submitter.submit_and_wait(want),
        };
        match waited {
            Ok(_) => {}
            Err(err) if matches!(err.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
            Err(err) => return Err(err),
        }
        self.cq.sync();
        cqes.extend((&mut self.cq).map(|c| (c.user_data(), c.result(), c.flags())));
        self.cq.sync();
        Ok(())
    }

    /// Sends what is left of the batch in `iov` from `send_at` on; `link`: the next entry (the
    /// single-shot recv) starts only after it.
    fn push_send(&mut self, link: bool) -> std::io::Result<()> {
        let rest = &self.iov[self.send_at..];
        self.msg.msg_iov = rest.as_ptr().cast_mut();
        self.msg.msg_iovlen = rest.len() as _;
        let mut entry = opcode::SendMsg::new(self.fd, &raw const *self.msg)
            .flags((libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32)
            .build()
            .user_data(SEND);
        if link {
            entry = entry.flags(squeue::Flags::IO_LINK);
        }
        self.send_busy = true;
        self.push(&entry)
    }

    /// Posts the single-shot recv into the free end of the input buffer, or arms the multishot.
    fn push_recv(&mut self, start: &mut usize, end: &mut usize) -> std::io::Result<()> {
        let entry = if self.bufs.is_some() {
            opcode::RecvMulti::new(self.fd, BUF_GROUP).build()
        } else {
            floor::compact(&mut self.inbuf, start, end);
            let free = &mut self.inbuf[*end..];
            opcode::Recv::new(self.fd, free.as_mut_ptr(), free.len() as u32).build()
        };
        self.recv_busy = true;
        self.push(&entry.user_data(RECV))
    }

    /// The transmission phase; whatever ends it, nothing is in flight when it returns (the
    /// send in flight reads the batch and the export).
    fn transmit(&mut self, data: &mut [u8], mut batch: floor::Batch) -> std::io::Result<()> {
        let result = self.run(data, &mut batch);
        if !self.drain() {
            std::mem::forget(batch); // a send may still read it
        }
        result
    }

    fn run(&mut self, data: &mut [u8], batch: &mut floor::Batch) -> std::io::Result<()> {
        let multishot = self.bufs.is_some();
        let (mut start, mut end) = (0usize, 0usize);
        // Whether the input holds no complete request (false: the last batch was full).
        let mut need_more = true;
        // Input arrived since the last parse; the client closed its side.
        let (mut fresh, mut eof) = (false, false);
        let mut cqes: Vec<(u64, i32, u32)> = Vec::with_capacity(64);
        loop {
            if !self.send_busy {
                if batch.disconnect {
                    return Ok(());
                }
                if (fresh || !need_more) && (multishot || !self.recv_busy) && self.send_left == 0 {
                    // No send in flight or left to resend, and (single-shot) no recv either:
                    // the batch, the export and the input buffer are this thread's again.
                    need_more = batch.parse(&mut self.inbuf, &mut start, end, data)?;
                    fresh = false;
                    if start == end {
                        start = 0;
                        end = 0;
                    }
                    if !batch.is_empty() {
                        let slices: Vec<IoSlice<'_>> = batch.slices(data);
                        self.iov.clear();
                        // IoSlice is ABI compatible with iovec.
                        self.iov.extend(slices.iter().map(|s| libc::iovec {
                            iov_base: s.as_ptr().cast_mut().cast(),
                            iov_len: s.len(),
                        }));
                        self.send_left = slices.iter().map(|s| s.len()).sum();
                        self.send_at = 0;
                    } else if batch.disconnect {
                        return Ok(());
                    }
                }
                if eof && need_more && !fresh && self.send_left == 0 {
                    return Ok(());
                }
            }
            let want_input = need_more && !batch.disconnect && !eof;
            if self.send_left > 0 && !self.send_busy {
                // A new batch, or the rest of one that went out short.
                self.push_send(!multishot && want_input && !self.recv_busy)?;
            }
            if want_input && !self.recv_busy {
                self.push_recv(&mut start, &mut end)?;
            }
            // Wait for the send and, unless some arrived already, for input: with both in
            // flight it wakes once, when both are done (or, multishot, after two completions
            // of any kind: two receives mean input to parse once the send is done).
            let want =
                usize::from(self.send_busy) + usize::from(want_input && self.recv_busy && !fresh);
            let timeout = (multishot && want == 2).then_some(Duration::from_secs(1));
            cqes.clear();
            self.wait(want.max(1), timeout, &mut cqes)?;
            for &(user_data, res, flags) in &cqes {
                match user_data {
                    SEND => {
                        self.send_busy = false;
                        if res < 0 {
                            return Err(std::io::Error::from_raw_os_error(-res));
                        }
                        let n = res as usize;
                        if n == 0 || n > self.send_left {
                            return Err(std::io::ErrorKind::WriteZero.into());
                        }
                        self.send_left -= n;
                        if self.send_left == 0 {
                            batch.clear();
                        } else {
                            advance(&mut self.iov, &mut self.send_at, n); // sent again above
                        }
                    }
                    RECV => {
                        if !multishot || !cqueue::more(flags) {
                            self.recv_busy = false;
                        }
                        if res == -libc::ECANCELED || (multishot && res == -libc::ENOBUFS) {
                            continue; // cancelled by a short send, or out of buffers: posted again
                        }
                        if res < 0 {
                            return Err(std::io::Error::from_raw_os_error(-res));
                        }
                        if res == 0 {
                            eof = true;
                            continue;
                        }
                        let n = res as usize;
                        if let Some(bufs) = &mut self.bufs {
                            let bid = cqueue::buffer_select(flags)
                                .ok_or_else(|| floor::bad("recv completion without a buffer"))?;
                            let got = bufs.buf(bid, n)?;
                            if self.inbuf.len() - end < n {
                                self.inbuf.copy_within(start..end, 0);
                                end -= start;
                                start = 0;
                                if self.inbuf.len() - end < n {
                                    self.inbuf.resize(end + n, 0);
                                }
                            }
                            self.inbuf[end..end + n].copy_from_slice(got);
                            bufs.provide(bid);
                        } else if n > self.inbuf.len() - end {
                            return Err(floor::bad("recv overran its buffer"));
                        }
                        end += n;
                        fresh = true;
                    }
                    _ => {}
                }
            }
        }
    }
}

impl Drop for Conn<'_> {
    /// Cancels what is still in flight and waits for its end, so the kernel writes into no
    /// buffer of this connection once it is gone; then unregisters the provided buffers and
    /// the ring's fd (a registered fd would keep the ring alive until the thread exits).
    fn drop(&mut self) {
        if !self.drain() {
            // Something may still be in flight: the buffers it may write into stay, for as
            // long as the process runs.
            std::mem::forget(self.bufs.take());
            std::mem::forget(std::mem::take(&mut self.inbuf));
        } else if self.bufs.is_some() && self.submitter.unregister_buf_ring(BUF_GROUP).is_err() {
            // The kernel still knows the buffers: keep them for as long as the process runs.
            std::mem::forget(self.bufs.take());
        }
        let _ = self.submitter.unregister_ring_fd();
    }
}

impl Conn<'_> {
    /// Cancels what is in flight and waits for its end; false if it could not.
    fn drain(&mut self) -> bool {
        for (busy, user_data) in [(self.recv_busy, RECV), (self.send_busy, SEND)] {
            if busy {
                let cancel = opcode::AsyncCancel::new(user_data)
                    .build()
                    .user_data(CANCEL);
                if self.push(&cancel).is_err() {
                    return false;
                }
            }
        }
        let mut cqes = Vec::new();
        while self.recv_busy || self.send_busy {
            cqes.clear();
            if self.wait(1, None, &mut cqes).is_err() {
                return false;
            }
            for &(user_data, _, flags) in &cqes {
                match user_data {
                    RECV if !cqueue::more(flags) => self.recv_busy = false,
                    SEND => self.send_busy = false,
                    _ => {}
                }
            }
        }
        true
    }
}

/// Moves past `n` sent bytes of `iov`, from slice `*at` on.
fn advance(iov: &mut [libc::iovec], at: &mut usize, mut n: usize) {
    while n > 0 && *at < iov.len() {
        let first = &mut iov[*at];
        if n < first.iov_len {
            // SAFETY: n < iov_len: still inside the slice.
            first.iov_base = unsafe { first.iov_base.cast::<u8>().add(n) }.cast();
            first.iov_len -= n;
            return;
        }
        n -= first.iov_len;
        *at += 1;
    }
}
