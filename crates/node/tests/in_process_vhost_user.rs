//! The node's vhost-user-blk door driven by a real frontend: the lab's client
//! (`headroom_lab::vhost_user`) speaks the vhost-user protocol over the attachment's socket
//! (rust-vmm's frontend), shares a memfd with the node as guest memory and drives the
//! virtqueues as a virtio-blk driver does, in this test's own process.
//!
//! Why: the backend's claims are about the protocol and guest memory (features, the config
//! space, memory tables, split rings, EVENT_IDX, descriptors a guest got wrong) and about the
//! pipeline (every request through the same QoS as NBD's), and only a frontend that really
//! negotiates and really puts chains in shared memory can check both. The client is blocking,
//! so each test drives it on a blocking thread; the QoS test runs the node on a manual clock,
//! so what the ceiling holds back is counted, not timed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

use headroom_lab::vhost_user::{
    BlkCompletion, BlkOp, Buffer, ClientOptions, S_IOERR, S_OK, S_UNSUPP, VhostUserBlkClient,
};
use headroom_node::clock::Clock;
use headroom_node::metrics::VolumeOp;
use headroom_node::server::{Node, RunningNode};
use headroom_node::vhost_user::{AttachmentError, AttachmentSpec};
use headroom_qos::QosSpec;

const MIB: u64 = 1 << 20;
const MS: u64 = 1_000_000;

fn spec(path: &Path, num_queues: u16) -> AttachmentSpec {
    AttachmentSpec {
        vhost_user: path.to_path_buf(),
        num_queues,
        mode: Some(0o600),
        uid: None,
        gid: None,
        poll_us: None,
    }
}

async fn attached(
    name: &str,
    size_bytes: u64,
    num_queues: u16,
) -> (RunningNode, tempfile::TempDir, PathBuf) {
    let node = common::start_with_volume(name, size_bytes).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vhost.sock");
    node.attach_vhost_user(name, spec(&path, num_queues))
        .await
        .expect("the volume attaches");
    (node, dir, path)
}

/// Runs `drive` with a client connected to `path` on a blocking thread.
async fn with_client<T: Send + 'static>(
    path: &Path,
    options: ClientOptions,
    drive: impl FnOnce(&mut VhostUserBlkClient) -> T + Send + 'static,
) -> T {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut client =
            VhostUserBlkClient::connect(&path, options).expect("the frontend connects");
        let out = drive(&mut client);
        client.disconnect().expect("the queues stop");
        out
    })
    .await
    .unwrap()
}

fn ok(done: BlkCompletion) -> Vec<u8> {
    assert_eq!(done.status, S_OK, "status of {done:?}");
    done.data
}

/// Requests of `op` the volume's statistics counted.
fn count(stats: &[headroom_node::metrics::OpStats], op: VolumeOp) -> u64 {
    let at = VolumeOp::ALL.iter().position(|o| *o == op).unwrap();
    stats[at].ops
}

/// Queue 0 of `volume`'s one attachment, as the node shows it.
fn queue_state(node: &RunningNode, volume: &str) -> headroom_node::vhost_user::QueueState {
    let attachments = node.vhost_user_attachments(volume);
    let [(_, state)] = attachments.as_slice() else {
        panic!("one attachment: {attachments:?}");
    };
    assert!(state.connected, "{state:?}");
    assert_eq!(state.connections_total, 1, "{state:?}");
    state.queues[0].clone()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_read_back_and_flush_discard_write_zeroes_and_get_id_answer() {
    let (node, _dir, path) = attached("disk", 64 * MIB, 2).await;
    let options = ClientOptions {
        num_queues: 2,
        ..ClientOptions::default()
    };
    let written = pattern(16 * 1024, 7);
    let expected = written.clone();
    with_client(&path, options, move |client| {
        assert!(client.event_idx(), "EVENT_IDX is negotiated");
        assert_eq!(client.capacity_bytes(), 64 * MIB);
        assert_eq!(client.config_num_queues(), 2);
        // Written on one queue, read back on the other: one volume behind both.
        ok(client
            .call(
                0,
                &BlkOp::Write {
                    offset: 8192,
                    data: written,
                },
            )
            .unwrap());
        let back = ok(client
            .call(
                1,
                &BlkOp::Read {
                    offset: 8192,
                    len: 16 * 1024,
                },
            )
            .unwrap());
        assert_eq!(back, expected);
        ok(client.call(0, &BlkOp::Flush).unwrap());
        // DISCARD and WRITE_ZEROES (kept allocated, then unmapped) read back as zeros; what
        // they did not name is untouched.
        ok(client
            .call(
                0,
                &BlkOp::Discard {
                    offset: 8192,
                    len: 4096,
                },
            )
            .unwrap());
        ok(client
            .call(
                1,
                &BlkOp::WriteZeroes {
                    offset: 12288,
                    len: 4096,
                    unmap: false,
                },
            )
            .unwrap());
        ok(client
            .call(
                1,
                &BlkOp::WriteZeroes {
                    offset: 16384,
                    len: 4096,
                    unmap: true,
                },
            )
            .unwrap());
        let back = ok(client
            .call(
                0,
                &BlkOp::Read {
                    offset: 8192,
                    len: 16 * 1024,
                },
            )
            .unwrap());
        assert_eq!(&back[..12288], &vec![0u8; 12288][..]);
        assert_eq!(&back[12288..], &expected[12288..]);
        let id = ok(client.call(1, &BlkOp::GetId).unwrap());
        let mut want = b"disk".to_vec();
        want.resize(20, 0);
        assert_eq!(id, want);
    })
    .await;
    // Counted as the volume's requests, as NBD's are.
    let volume = node.store().open_volume("disk").unwrap();
    let stats = node.api_state().metrics.get(volume.id()).unwrap().ops();
    let writes = count(&stats, VolumeOp::Write);
    let reads = count(&stats, VolumeOp::Read);
    assert_eq!((writes, reads), (1, 2), "{stats:?}");
    node.shutdown().await.unwrap();
}

/// The largest request the device allows (its config's `seg_max` data segments, with a
/// header and a status) fits in the 128-entry ring QEMU's `vhost-user-blk-pci` sets up by
/// default, and is answered. A device offering more segments than the ring can hold lets a
/// Linux guest build a request its driver can never queue: `virtqueue_add` refuses it with
/// the ring empty and the guest's disk hangs (decision 71). At `seg_max` 128 the push below
/// fails for want of descriptors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_request_the_device_allows_fits_a_ring_of_128() {
    largest_request_round_trip("segments", 128, false).await;
}

/// With indirect descriptors (`VIRTIO_RING_F_INDIRECT_DESC`, as Linux sends them when the
/// device offers it) the largest request takes one entry of the ring, so it fits a ring of
/// 16 as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_request_goes_through_an_indirect_table_in_a_ring_of_16() {
    largest_request_round_trip("indirect", 16, true).await;
}

/// Writes `seg_max` × 512 bytes in one request and reads them back in one request of the
/// config's `seg_max` segments, on a queue of `queue_size` entries, through an indirect
/// table when `indirect`.
async fn largest_request_round_trip(name: &str, queue_size: u16, indirect: bool) {
    let (node, _dir, path) = attached(name, 64 * MIB, 1).await;
    let options = ClientOptions {
        queue_size,
        indirect,
        ..ClientOptions::default()
    };
    with_client(&path, options, move |client| {
        const F_INDIRECT_DESC: u64 = 1 << 28;
        assert_eq!(
            client.acked_features() & F_INDIRECT_DESC != 0,
            indirect,
            "indirect descriptors negotiated as asked"
        );
        let config = client.config();
        let seg_max = u32::from_le_bytes(config[12..16].try_into().unwrap());
        assert!(seg_max >= 1, "seg_max {seg_max}");
        // One 512-byte piece per segment: written in one request, read back in seg_max.
        let data = pattern(seg_max as usize * 512, 9);
        ok(client
            .call(
                0,
                &BlkOp::Write {
                    offset: 0,
                    data: data.clone(),
                },
            )
            .unwrap());
        let header = client.header(0, 0, 0).unwrap(); // VIRTIO_BLK_T_IN at sector 0
        let mut buffers = vec![header];
        let mut pieces = Vec::new();
        for _ in 0..seg_max {
            let addr = client.alloc(0, 512).unwrap();
            pieces.push(addr);
            buffers.push(Buffer {
                addr,
                len: 512,
                device_writes: true,
            });
        }
        let status = client.status_buffer(0).unwrap();
        buffers.push(status);
        client
            .submit_chain(0, &buffers, status.addr, None)
            .unwrap_or_else(|err| {
                panic!(
                    "a request of seg_max {seg_max} segments ({} descriptors) in a ring of {queue_size}: {err}",
                    buffers.len()
                )
            });
        let done = client.wait(0).unwrap();
        assert_eq!(done.status, S_OK, "{done:?}");
        let mut back = Vec::new();
        for addr in pieces {
            back.extend(client.read_mem(addr, 512).unwrap());
        }
        assert_eq!(back, data);
    })
    .await;
    node.shutdown().await.unwrap();
}

/// A chain made available without a kick (a kick lost on its way, or the framework's worker
/// thread gone) is popped by the connection's watchdog within a couple of its periods, and
/// used chains the driver was never told of are signalled again: the queue moves on, and
/// the attachment counts both (`vhost_user::watchdog`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_moves_a_queue_on_past_a_lost_kick_and_a_lost_interrupt() {
    let (node, _dir, path) = attached("watched", 64 * MIB, 1).await;
    /// Long beside the watchdog's two 100 ms looks; only a broken watchdog waits it out.
    const LIMIT_MS: i32 = 10_000;
    let read = BlkOp::Read {
        offset: 0,
        len: 4096,
    };
    let data = pattern(4096, 3);
    let expected = data.clone();
    let blocking = |step: Box<dyn FnOnce(&mut VhostUserBlkClient) + Send>,
                    mut client: VhostUserBlkClient| {
        tokio::task::spawn_blocking(move || {
            step(&mut client);
            client
        })
    };
    let client = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || {
            VhostUserBlkClient::connect(&path, ClientOptions::default()).unwrap()
        })
        .await
        .unwrap()
    };
    // A kick lost: nothing but the watchdog finds the chain.
    let (kick_read, kick_expected) = (read.clone(), expected.clone());
    let lost_kick = Box::new(move |client: &mut VhostUserBlkClient| {
        ok(client.call(0, &BlkOp::Write { offset: 0, data }).unwrap());
        client.arm_signal(0).unwrap();
        client.submit_unkicked(0, &kick_read).unwrap();
        assert!(
            client.wait_signal(0, LIMIT_MS).unwrap(),
            "a chain nobody kicked for was answered"
        );
        assert_eq!(ok(client.wait(0).unwrap()), kick_expected);
    });
    let client = blocking(lost_kick, client).await.unwrap();
    let after_kick = queue_state(&node, "watched");
    assert!(after_kick.watchdog_pops_total >= 1, "{after_kick:?}");
    assert_eq!(after_kick.in_flight, 0, "{after_kick:?}");
    // An interrupt lost: the driver asks for it and takes the signal but not the chain, as
    // if the signal had gone nowhere; the watchdog signals again.
    let lost_interrupt = Box::new(move |client: &mut VhostUserBlkClient| {
        client.arm_signal(0).unwrap();
        client.submit(0, &read).unwrap();
        assert!(
            client.wait_signal(0, LIMIT_MS).unwrap(),
            "the read is signalled"
        );
        assert!(
            client.wait_signal(0, LIMIT_MS).unwrap(),
            "the used chain the driver did not take is signalled again"
        );
        assert_eq!(ok(client.wait(0).unwrap()), expected);
    });
    let client = blocking(lost_interrupt, client).await.unwrap();
    let after_signal = queue_state(&node, "watched");
    assert!(after_signal.watchdog_signals_total >= 1, "{after_signal:?}");
    // Both were answered by the usual path's signal first: nothing else was lost.
    assert!(after_signal.signals_total >= 3, "{after_signal:?}");
    tokio::task::spawn_blocking(move || client.disconnect().unwrap())
        .await
        .unwrap();
    // The attachment keeps the totals once the connection is gone (the server sees the
    // socket close a moment after the client stopped its queues).
    let gone = || !node.vhost_user_attachments("watched")[0].1.connected;
    assert!(common::eventually(gone).await, "the frontend left");
    let attachments = node.vhost_user_attachments("watched");
    let state = &attachments[0].1;
    assert!(state.queues.is_empty(), "{state:?}");
    assert!(
        state.watchdog_pops_total >= 1 && state.watchdog_signals_total >= 1,
        "{state:?}"
    );
    node.shutdown().await.unwrap();
}

/// A device that polls its rings (`poll_us`) answers as one that waits for kicks: every
/// write reads back, over two queues, and the statistics count each request once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_device_answers_every_request_as_an_event_driven_one() {
    let node = common::start_with_volume("polled", 64 * MIB).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vhost.sock");
    let polling = AttachmentSpec {
        poll_us: Some(200),
        ..spec(&path, 2)
    };
    node.attach_vhost_user("polled", polling).await.unwrap();
    let options = ClientOptions {
        num_queues: 2,
        ..ClientOptions::default()
    };
    const BLOCKS: u64 = 64;
    with_client(&path, options, move |client| {
        for i in 0..BLOCKS {
            let q = (i % 2) as usize;
            let data = pattern(4096, i as u8);
            ok(client
                .call(
                    q,
                    &BlkOp::Write {
                        offset: i * 4096,
                        data,
                    },
                )
                .unwrap());
        }
        for i in 0..BLOCKS {
            let q = ((i + 1) % 2) as usize;
            let read = BlkOp::Read {
                offset: i * 4096,
                len: 4096,
            };
            assert_eq!(ok(client.call(q, &read).unwrap()), pattern(4096, i as u8));
        }
    })
    .await;
    let id = node.store().open_volume("polled").unwrap().id();
    let stats = node.api_state().metrics.get(id).unwrap().ops();
    assert_eq!(count(&stats, VolumeOp::Write), BLOCKS);
    assert_eq!(count(&stats, VolumeOp::Read), BLOCKS);
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_descriptors_are_answered_with_ioerr_or_unsupp_and_the_queue_goes_on() {
    let (node, _dir, path) = attached("disk", 4 * MIB, 1).await;
    with_client(&path, ClientOptions::default(), |client| {
        let q = 0;
        let run = |client: &mut VhostUserBlkClient, buffers: Vec<Buffer>| {
            let status = *buffers.last().unwrap();
            client.submit_chain(q, &buffers, status.addr, None).unwrap();
            client.wait(q).unwrap().status
        };
        // A READ whose data the device could not write (device-readable).
        let header = client.header(q, 0, 0).unwrap();
        let data = Buffer {
            addr: client.alloc(q, 4096).unwrap(),
            len: 4096,
            device_writes: false,
        };
        let status = client.status_buffer(q).unwrap();
        assert_eq!(run(client, vec![header, data, status]), S_IOERR);
        // Data outside the shared memory.
        let header = client.header(q, 1, 0).unwrap();
        let data = Buffer {
            addr: 1 << 40,
            len: 4096,
            device_writes: false,
        };
        let status = client.status_buffer(q).unwrap();
        assert_eq!(run(client, vec![header, data, status]), S_IOERR);
        // A header shorter than 16 bytes.
        let mut header = client.header(q, 0, 0).unwrap();
        header.len = 8;
        let status = client.status_buffer(q).unwrap();
        assert_eq!(run(client, vec![header, status]), S_IOERR);
        // A type virtio-blk has but this device does not offer (SCSI_CMD).
        let header = client.header(q, 2, 0).unwrap();
        let status = client.status_buffer(q).unwrap();
        assert_eq!(run(client, vec![header, status]), S_UNSUPP);
        // A READ past the volume's end, and one larger than the largest request.
        let past = client
            .call(
                q,
                &BlkOp::Read {
                    offset: 4 * MIB,
                    len: 4096,
                },
            )
            .unwrap();
        assert_eq!(past.status, S_IOERR);
        let header = client.header(q, 0, 0).unwrap();
        let huge = Buffer {
            addr: client.alloc(q, 512).unwrap(),
            len: 64 << 20,
            device_writes: true,
        };
        let status = client.status_buffer(q).unwrap();
        assert_eq!(run(client, vec![header, huge, status]), S_IOERR);
        // And the queue still serves a good request after all of them.
        let back = ok(client
            .call(
                q,
                &BlkOp::Read {
                    offset: 0,
                    len: 4096,
                },
            )
            .unwrap());
        assert_eq!(back, vec![0u8; 4096]);
    })
    .await;
    node.shutdown().await.unwrap();
}

/// A node on a manual clock with volume `name` of `size_bytes` capped at 100 IOPS (one
/// request per 10 ms of the node's time), attached over vhost-user-blk with one queue.
struct Capped {
    node: RunningNode,
    time: &'static headroom_node::clock::ManualTime,
    scheduler: std::sync::Arc<headroom_node::scheduler::Scheduler<headroom_node::pipeline::IoJob>>,
    handle: std::sync::Arc<headroom_node::scheduler::VolumeHandle>,
    id: u64,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

async fn capped(name: &str, size_bytes: u64) -> Capped {
    let (clock, time) = Clock::manual(1_000 * MS);
    let node = Node::start_with_clock(common::config(), clock)
        .await
        .unwrap();
    let qos = QosSpec {
        baseline_iops: Some(100),
        ceiling_iops: Some(100),
        ..QosSpec::default()
    };
    node.create_volume(name, size_bytes, Some(qos)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vhost.sock");
    node.attach_vhost_user(name, spec(&path, 1)).await.unwrap();
    let scheduler = node.scheduler().unwrap().clone();
    let id = node.store().open_volume(name).unwrap().id();
    let handle = scheduler.handle(id).unwrap();
    Capped {
        node,
        time,
        scheduler,
        handle,
        id,
        path,
        _dir: dir,
    }
}

impl Capped {
    /// Reads answered so far (counted when the reply is handed back; errors included).
    fn reads_answered(&self) -> u64 {
        self.node
            .api_state()
            .metrics
            .get(self.id)
            .map_or(0, |stats| count(&stats.ops(), VolumeOp::Read))
    }

    /// Moves the node's time 10 ms at a time while the ceiling holds requests, until `want`
    /// reads are answered; the ticks it took. A read still on its way to the scheduler when
    /// the others drained would be held by the frozen clock, so an empty scheduler waits for
    /// the reads in flight to be answered or held rather than ending the loop.
    async fn tick_until_answered(&self, want: u64) -> u64 {
        let mut ticks = 0u64;
        while self.reads_answered() < want {
            if self.scheduler.queued_requests(&self.handle) == 0 {
                let moved = common::eventually(|| {
                    self.reads_answered() == want
                        || self.scheduler.queued_requests(&self.handle) > 0
                })
                .await;
                assert!(
                    moved,
                    "{} of {want} reads answered, none held",
                    self.reads_answered()
                );
                continue;
            }
            self.time.advance(10 * MS);
            self.scheduler.wake_due();
            ticks += 1;
            assert!(ticks <= 1_000, "the ceiling never let the rest through");
        }
        ticks
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ceiling_holds_vhost_user_requests_back_until_the_nodes_time_moves() {
    let capped = capped("capped", 64 * MIB).await;
    let Capped {
        scheduler,
        handle,
        path,
        ..
    } = &capped;
    const SENT: usize = 32;
    let client_path = path.clone();
    let mut client = tokio::task::spawn_blocking(move || {
        let mut client =
            VhostUserBlkClient::connect(&client_path, ClientOptions::default()).unwrap();
        for i in 0..SENT as u64 {
            client
                .submit(
                    0,
                    &BlkOp::Read {
                        offset: i * 4096,
                        len: 4096,
                    },
                )
                .unwrap();
        }
        client
    })
    .await
    .unwrap();
    // Time does not move: the scheduler holds nearly all of them, and keeps holding them.
    assert!(
        common::eventually(|| scheduler.queued_requests(handle) >= SENT - 4).await,
        "the ceiling holds the requests back ({} held)",
        scheduler.queued_requests(handle)
    );
    let held = scheduler.queued_requests(handle);
    let ticks = capped.tick_until_answered(SENT as u64).await;
    assert!(
        ticks >= held as u64 - 2,
        "the held requests needed the node's time: {ticks} ticks for {held}"
    );
    let statuses = tokio::task::spawn_blocking(move || {
        let statuses: Vec<u8> = (0..SENT).map(|_| client.wait(0).unwrap().status).collect();
        client.disconnect().unwrap();
        statuses
    })
    .await
    .unwrap();
    assert_eq!(statuses, vec![S_OK; SENT]);
    assert_eq!(capped.reads_answered(), SENT as u64);
    scheduler.check_invariants().unwrap();
    capped.node.shutdown().await.unwrap();
}

/// A chain the node answers at once (a read past the end, refused by the checker) is not
/// returned used before the reads popped ahead of it that the ceiling still holds: the used
/// ring follows the pop order, which is what lets a guest's frontend resubmit exactly the
/// unanswered chains after the node restarts (`vhost_user::used_order`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chains_come_back_used_in_the_order_they_were_popped_even_when_answered_out_of_order() {
    const SIZE_BYTES: u64 = 64 * MIB;
    let capped = capped("ordered", SIZE_BYTES).await;
    let Capped {
        scheduler,
        handle,
        path,
        id,
        ..
    } = &capped;
    const HELD: usize = 16;
    let client_path = path.clone();
    let (mut client, mut heads) = tokio::task::spawn_blocking(move || {
        let mut client =
            VhostUserBlkClient::connect(&client_path, ClientOptions::default()).unwrap();
        let heads: Vec<u16> = (0..HELD as u64)
            .map(|i| {
                let read = BlkOp::Read {
                    offset: i * 4096,
                    len: 4096,
                };
                client.submit(0, &read).unwrap()
            })
            .collect();
        (client, heads)
    })
    .await
    .unwrap();
    assert!(
        common::eventually(|| scheduler.queued_requests(handle) >= HELD - 4).await,
        "the ceiling holds the reads back ({} held)",
        scheduler.queued_requests(handle)
    );
    // Popped last, answered first: the pipeline refuses it as soon as it arrives.
    let refused = {
        let (head, returned) = tokio::task::spawn_blocking(move || {
            let past_end = BlkOp::Read {
                offset: SIZE_BYTES,
                len: 4096,
            };
            let head = client.submit(0, &past_end).unwrap();
            (head, client)
        })
        .await
        .unwrap();
        client = returned;
        head
    };
    heads.push(refused);
    let metrics = capped.node.api_state().metrics.get(*id).unwrap();
    let read_at = VolumeOp::ALL
        .iter()
        .position(|o| *o == VolumeOp::Read)
        .unwrap();
    assert!(
        common::eventually(|| metrics.ops()[read_at].errors == 1).await,
        "the read past the end is answered (refused) while the others are held"
    );
    // The attachment shows it: every chain popped, the used index at what was returned,
    // and in flight at least the reads the ceiling holds and the refused one behind them.
    let popped = HELD as u64 + 1;
    let queued = scheduler.queued_requests(handle) as u64;
    let held = queue_state(&capped.node, "ordered");
    assert_eq!(
        (held.popped_total, held.driver_avail_idx, held.next_avail),
        (popped, Some(popped as u16), Some(popped as u16)),
        "{held:?}"
    );
    let returned = Some(held.returned_total as u16);
    assert_eq!(
        (held.used_idx, held.next_used),
        (returned, returned),
        "{held:?}"
    );
    assert_eq!(held.in_flight, popped - held.returned_total, "{held:?}");
    assert!(
        held.in_flight > queued,
        "{queued} held, the refused one too: {held:?}"
    );
    assert!(
        held.serving && held.ready && held.enabled && held.has_call_fd,
        "{held:?}"
    );
    // Until every read is answered (the refused one counted as an error).
    capped.tick_until_answered(HELD as u64 + 1).await;
    let used = tokio::task::spawn_blocking(move || {
        let used: Vec<BlkCompletion> = (0..=HELD).map(|_| client.wait(0).unwrap()).collect();
        (used, client)
    })
    .await
    .unwrap();
    let (used, client) = used;
    let answered = queue_state(&capped.node, "ordered");
    assert_eq!(
        (
            answered.returned_total,
            answered.in_flight,
            answered.used_idx
        ),
        (popped, 0, Some(popped as u16)),
        "{answered:?}"
    );
    // The signal follows the return (the driver may see the used chains before it).
    assert!(
        common::eventually(|| queue_state(&capped.node, "ordered").signals_total >= 1).await,
        "{:?}",
        queue_state(&capped.node, "ordered")
    );
    assert_eq!(answered.signals_without_call_total, 0, "{answered:?}");
    tokio::task::spawn_blocking(move || client.disconnect().unwrap())
        .await
        .unwrap();
    let used_heads: Vec<u16> = used.iter().map(|done| done.head).collect();
    assert_eq!(used_heads, heads, "used in the order submitted");
    let statuses: Vec<u8> = used.iter().map(|done| done.status).collect();
    let mut expected = vec![S_OK; HELD];
    expected.push(S_IOERR);
    assert_eq!(statuses, expected);
    scheduler.check_invariants().unwrap();
    capped.node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_replaces_a_stale_socket_refuses_a_file_is_stored_and_detach_removes_it() {
    let node = common::start_with_volume("disk", 4 * MIB).await;
    let dir = tempfile::tempdir().unwrap();
    // A regular file at the path: refused, and still there.
    let file = dir.path().join("image.raw");
    std::fs::write(&file, b"keep me").unwrap();
    let err = node
        .attach_vhost_user("disk", spec(&file, 1))
        .await
        .unwrap_err();
    assert!(matches!(err, AttachmentError::Socket(_)), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    // Checked before anything is touched: an unknown volume, a queue count out of range.
    let path = dir.path().join("vhost.sock");
    let err = node
        .attach_vhost_user("nope", spec(&path, 1))
        .await
        .unwrap_err();
    assert!(matches!(err, AttachmentError::UnknownVolume(_)), "{err}");
    let err = node
        .attach_vhost_user("disk", spec(&path, 0))
        .await
        .unwrap_err();
    assert!(matches!(err, AttachmentError::NumQueues(0)), "{err}");
    let too_long_a_poll = AttachmentSpec {
        poll_us: Some(headroom_node::vhost_user::MAX_POLL_US + 1),
        ..spec(&path, 1)
    };
    let err = node
        .attach_vhost_user("disk", too_long_a_poll)
        .await
        .unwrap_err();
    assert!(matches!(err, AttachmentError::PollUs(1001)), "{err}");
    let err = node
        .attach_vhost_user("disk", spec(Path::new("relative.sock"), 1))
        .await
        .unwrap_err();
    assert!(matches!(err, AttachmentError::RelativePath(_)), "{err}");
    assert!(!Path::new("relative.sock").exists());
    assert!(!path.exists());
    // A socket nobody listens on (what a killed server leaves): replaced.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    node.attach_vhost_user("disk", spec(&path, 1))
        .await
        .unwrap();
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let meta = std::fs::metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // Listening when attach returned, and stored with the volume.
    let stored = node
        .store()
        .open_volume("disk")
        .unwrap()
        .attachments()
        .unwrap();
    assert!(stored.contains("vhost.sock"), "{stored}");
    // A second attachment at the same path is refused.
    let err = node
        .attach_vhost_user("disk", spec(&path, 1))
        .await
        .unwrap_err();
    assert!(matches!(err, AttachmentError::Taken(..)), "{err}");
    with_client(&path, ClientOptions::default(), |client| {
        ok(client.call(0, &BlkOp::Flush).unwrap());
    })
    .await;
    node.detach_vhost_user("disk", &path).await.unwrap();
    assert!(!path.exists(), "the socket goes with the attachment");
    assert_eq!(
        node.store().open_volume("disk").unwrap().attachments(),
        None
    );
    let err = node.detach_vhost_user("disk", &path).await.unwrap_err();
    assert!(matches!(err, AttachmentError::NotAttached(..)), "{err}");
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_attachment_is_served_again_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = common::config();
    config.backend = headroom_node::config::StoreBackend::Files {
        data_dir: dir.path().join("data"),
        device_count: 1,
        device_capacity_bytes: 64 * MIB,
        device_paths: Vec::new(),
    };
    let path = dir.path().join("vhost.sock");
    let node = common::start(config.clone()).await;
    node.create_volume("disk", 4 * MIB, None).unwrap();
    node.attach_vhost_user("disk", spec(&path, 1))
        .await
        .unwrap();
    with_client(&path, ClientOptions::default(), |client| {
        ok(client
            .call(
                0,
                &BlkOp::Write {
                    offset: 0,
                    data: pattern(4096, 3),
                },
            )
            .unwrap());
        ok(client.call(0, &BlkOp::Flush).unwrap());
    })
    .await;
    node.shutdown().await.unwrap();
    assert!(!path.exists(), "a clean stop removes the socket");
    let node = common::start(config).await;
    assert!(path.exists(), "restored at start");
    let back = with_client(&path, ClientOptions::default(), |client| {
        ok(client
            .call(
                0,
                &BlkOp::Read {
                    offset: 0,
                    len: 4096,
                },
            )
            .unwrap())
    })
    .await;
    assert_eq!(back, pattern(4096, 3));
    node.shutdown().await.unwrap();
}

/// Each queue of an attachment runs on one of the node's connection threads, as an NBD
/// connection does (its submitter and completer together, so a reply is not a wake-up
/// across threads), and the queues spread over the threads by count. Fails when the queues
/// are put on the node's shared runtime instead (the counts stay at zero).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queues_run_on_the_connection_threads_spread_by_count() {
    let (node, _dir, path) = attached("spread", 16 * MIB, 2).await;
    let threads = node.api_state().connection_threads.clone();
    let options = ClientOptions {
        num_queues: 2,
        ..ClientOptions::default()
    };
    let (open, answered) = with_client(&path, options, move |client| {
        // Both queues answer, so both queues' tasks are running.
        let first_block = BlkOp::Read {
            offset: 0,
            len: 4096,
        };
        let answered: Vec<Vec<u8>> = (0..2)
            .map(|q| ok(client.call(q, &first_block).unwrap()))
            .collect();
        (threads.per_thread(), answered)
    })
    .await;
    assert!(answered.iter().all(|data| data == &vec![0u8; 4096]));
    assert!(!open.is_empty(), "the node has connection threads");
    assert_eq!(
        open.iter().sum::<usize>(),
        2,
        "no NBD connection is open, so the two queues are all the threads hold: {open:?}"
    );
    let (least, most) = (open.iter().min().unwrap(), open.iter().max().unwrap());
    assert!(most - least <= 1, "spread by count: {open:?}");
    node.shutdown().await.unwrap();
}
