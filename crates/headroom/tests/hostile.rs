//! Hostile clients: connection floods, slow and stalled handshakes, clients
//! that never read their replies, thousands of requests in flight, and `accept` failures. Each
//! test drives the real server with raw sockets (the bytes no polite client sends) and checks
//! that other clients are still served, with real clients (nbdinfo, nbdcopy, fio) where one
//! fits, and that what the server holds stays within its limits: its own accounting
//! (`GET /v1/connections`) and, independently, its peak resident memory (`VmHWM`).
//!
//! The numbers each test measures are printed (`cargo test -- --nocapture` shows them);
//! docs/reliability.md ("Item 7") records them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::raw::*;
use common::{Server, have_tool, text};
use headroom_nbd::consts::*;
use headroom_nbd::encode_option_header;
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// A memory server whose `[limits]` table is `limits` (TOML lines), with `extra` flags.
fn server_with_limits(dir: &Path, limits: &str, extra: &[&str]) -> Server {
    let config = write_config(dir, limits);
    let mut args = vec!["--memory", "2GiB", "--config", config.to_str().unwrap()];
    args.extend_from_slice(extra);
    Server::start_with(&dir.join("mem"), &args)
}

fn write_config(dir: &Path, limits: &str) -> PathBuf {
    let path = dir.join("node.toml");
    std::fs::write(&path, format!("[limits]\n{limits}\n")).unwrap();
    path
}

/// `GET /v1/connections`.
fn connections(server: &Server) -> Value {
    let mut response = ureq::get(format!("{}/v1/connections", server.api))
        .header("authorization", common::bearer())
        .call()
        .unwrap_or_else(|err| panic!("GET /v1/connections: {err}"));
    response.body_mut().read_json().expect("JSON answer")
}

fn u64_at(value: &Value, pointer: &str) -> u64 {
    value
        .pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no number at {pointer} in {value}"))
}

/// The bytes tenant `tenant` (`None`: no tenant) holds, 0 when it holds nothing.
fn tenant_bytes(report: &Value, tenant: Option<&str>) -> u64 {
    report["memory"]["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"].as_str() == tenant)
        .map_or(0, |t| t["inflight_bytes"].as_u64().unwrap())
}

/// Polls `probe` every 20 ms until it returns `Some`, or fails the test after `limit`.
fn wait_for<T>(limit: Duration, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A field of /proc/PID/status in bytes (`VmRSS`, `VmHWM`).
fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// utime + stime of a process, in clock ticks (1/100 s on Linux).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start at field 3.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// `nbdinfo URI` under `timeout`; (status success, seconds, output).
fn nbdinfo(uri: &str, limit_s: u32) -> (bool, f64, String) {
    let started = Instant::now();
    let out = Command::new("timeout")
        .args([&limit_s.to_string(), "nbdinfo", uri])
        .output()
        .unwrap();
    (
        out.status.success(),
        started.elapsed().as_secs_f64(),
        text(&out),
    )
}

/// A connection in transmission that sends `reads` READs of `len` bytes and never reads a
/// reply. The requests go out from a thread (the server stops reading once its budgets are
/// full, so the write blocks); the socket stays open until the returned stream is dropped.
fn hog(addr: SocketAddr, export: &str, reads: u64, len: u32) -> TcpStream {
    let client = Client::open(addr, export);
    let mut requests = Vec::with_capacity(usize::try_from(reads).unwrap() * 28);
    for cookie in 0..reads {
        let offset = (cookie % 2) * u64::from(len);
        push_request(&mut requests, 0, NBD_CMD_READ, cookie, offset, len);
    }
    let mut writer = client.stream.try_clone().unwrap();
    std::thread::spawn(move || {
        // Ends with an error when the server or the test closes the socket.
        let _ = writer.write_all(&requests);
    });
    client.stream
}

/// A well-behaved client can still connect, write, read back and flush.
fn still_serves(server: &Server, export: &str) {
    let mut client = Client::open(server.nbd, export);
    let data = vec![0x5au8; 4096];
    assert_eq!(client.write(1, 4096, &data, 0), 0);
    assert_eq!(client.read(2, 4096, 4096).unwrap(), data);
    assert_eq!(client.flush(3), 0);
    client.disconnect();
}

/// True when the server closed the connection (EOF or reset) within `limit`.
fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            // The greeting or other bytes the server sent before closing.
            Ok(_) => continue,
            Err(err) => {
                return matches!(
                    err.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                );
            }
        }
    }
}

/// Connects from a given loopback address (127.0.0.0/8 is all loopback on Linux).
fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((source, 0))).unwrap();
        socket.connect(addr).await.unwrap()
    });
    let stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream
}

/// GO on a connected stream, as `Client::open` does.
fn open_on(mut stream: TcpStream, export: &str) -> Client {
    greet(&mut stream);
    let (size_bytes, transmission_flags) = go(&mut stream, export).expect("GO succeeds");
    Client {
        stream,
        size_bytes,
        transmission_flags,
    }
}

#[test]
fn idle_and_half_negotiated_sockets_do_not_lock_out_new_clients() {
    if !have_tool("nbdinfo") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The default limits: 256 connections, no cap per address, 30 s to negotiate.
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    server.create_volume("vol", "16MiB");
    let mut established: Vec<Client> = (0..4).map(|_| Client::open(server.nbd, "vol")).collect();

    // 300 sockets from this address, as in the issue, in three states: silent; client flags
    // sent and nothing more; half an option header. 252 slots are free, so the last 48 (and
    // nbdinfo's) each evict a negotiating one.
    let started = Instant::now();
    let mut flood = Vec::with_capacity(300);
    for i in 0..300u32 {
        let mut stream = TcpStream::connect(server.nbd).unwrap();
        // Writes to a socket already evicted may fail: that is the point.
        match i % 3 {
            0 => {}
            1 => {
                let _ = stream
                    .write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes());
            }
            _ => {
                let _ = stream
                    .write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes());
                let _ = stream.write_all(&IHAVEOPT.to_be_bytes());
            }
        }
        flood.push(stream);
    }
    let flood_s = started.elapsed().as_secs_f64();
    let (ok, seconds, output) = nbdinfo(&server.uri("vol"), 30);
    assert!(ok, "nbdinfo locked out by 300 idle sockets: {output}");
    // Connections in transmission are never evicted.
    for (i, client) in established.iter_mut().enumerate() {
        let cookie = u64::try_from(i).unwrap();
        assert_eq!(client.read(cookie, 0, 4096).unwrap(), vec![0u8; 4096]);
    }
    let report = connections(&server);
    let evicted = u64_at(&report, "/evicted_total");
    assert!(evicted >= 300 + 1 - 252, "evicted only {evicted}: {report}");
    assert_eq!(u64_at(&report, "/refused_total"), 0, "{report}");
    assert!(u64_at(&report, "/open") <= 256, "{report}");
    assert!(u64_at(&report, "/transmitting") >= 4, "{report}");
    println!(
        "flood of 300 sockets opened in {flood_s:.2} s; nbdinfo then took {seconds:.2} s; \
         {evicted} negotiating connections evicted, 0 refused, {} open",
        u64_at(&report, "/open")
    );
    for client in established {
        client.disconnect();
    }
    drop(flood);
    still_serves(&server, "vol");
    server.stop();
}

#[test]
fn the_per_address_cap_refuses_one_address_and_spares_the_others() {
    if !have_tool("nbdinfo") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = server_with_limits(
        dir.path(),
        "max_connections = 32\nmax_connections_per_ip = 4",
        &[],
    );
    server.create_volume("vol", "16MiB");
    // 127.0.0.2 fills its four places with transmitting connections: a fifth is refused.
    let mut busy: Vec<Client> = (0..4)
        .map(|_| open_on(connect_from([127, 0, 0, 2], server.nbd), "vol"))
        .collect();
    let mut fifth = connect_from([127, 0, 0, 2], server.nbd);
    let mut greeting = [0u8; 18];
    assert!(
        fifth.read_exact(&mut greeting).is_err(),
        "a fifth connection from 127.0.0.2 was served"
    );
    // 127.0.0.3 holds four negotiating sockets: a fifth evicts the oldest of them.
    let mut idle: Vec<TcpStream> = (0..4)
        .map(|_| connect_from([127, 0, 0, 3], server.nbd))
        .collect();
    let mut newest = connect_from([127, 0, 0, 3], server.nbd);
    assert!(
        closed_within(&mut idle[0], Duration::from_secs(10)),
        "the oldest idle socket of 127.0.0.3 was not evicted"
    );
    newest.read_exact(&mut greeting).unwrap();
    // Other addresses are served.
    let (ok, seconds, output) = nbdinfo(&server.uri("vol"), 30);
    assert!(ok, "{output}");
    for (i, client) in busy.iter_mut().enumerate() {
        let cookie = u64::try_from(i).unwrap();
        assert_eq!(client.read(cookie, 0, 512).unwrap(), vec![0u8; 512]);
    }
    let report = connections(&server);
    assert_eq!(u64_at(&report, "/refused_total"), 1, "{report}");
    assert_eq!(u64_at(&report, "/evicted_total"), 1, "{report}");
    println!(
        "per-address cap 4: fifth of 127.0.0.2 refused, nbdinfo from 127.0.0.1 in {seconds:.2} s"
    );
    drop((idle, newest, busy));
    server.stop();
}

#[test]
fn stalled_negotiations_end_at_the_handshake_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with_limits(dir.path(), "handshake_timeout_ms = 500", &[]);
    server.create_volume("vol", "16MiB");
    let started = Instant::now();
    // Silent; greeted but no client flags; options begun (GO header, half its data).
    let silent = TcpStream::connect(server.nbd).unwrap();
    let mut greeted = connect(server.nbd);
    let mut greeting = [0u8; 18];
    greeted.read_exact(&mut greeting).unwrap();
    let mut haggling = connect(server.nbd);
    greet(&mut haggling);
    let data = go_payload("vol");
    let mut header = Vec::new();
    encode_option_header(&mut header, NBD_OPT_GO, u32::try_from(data.len()).unwrap());
    header.extend_from_slice(&data[..data.len() / 2]);
    haggling.write_all(&header).unwrap();
    for (name, mut stream) in [
        ("silent", silent),
        ("greeted", greeted),
        ("half an option", haggling),
    ] {
        assert!(
            closed_within(&mut stream, Duration::from_secs(10)),
            "{name}: still open"
        );
        let seconds = started.elapsed().as_secs_f64();
        assert!(
            seconds >= 0.45,
            "{name}: closed after {seconds:.3} s, before the deadline"
        );
    }
    let report = wait_for(Duration::from_secs(10), "no connection left", || {
        let report = connections(&server);
        (u64_at(&report, "/open") == 0).then_some(report)
    });
    println!(
        "three stalled negotiations closed {:.2} s after they began (deadline 0.5 s)",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(u64_at(&report, "/evicted_total"), 0);
    still_serves(&server, "vol");
    server.stop();
}

#[test]
fn thousands_of_requests_in_flight_stop_at_the_request_cap_and_all_get_answers() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with_limits(dir.path(), "max_inflight_requests = 64", &[]);
    server.create_volume("vol", "16MiB");
    const REQUESTS: u64 = 20_000;
    let mut client = Client::open(server.nbd, "vol");
    let writer = {
        let mut stream = client.stream.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut requests = Vec::with_capacity(28 * 20_000);
            for cookie in 0..REQUESTS {
                push_request(
                    &mut requests,
                    0,
                    NBD_CMD_READ,
                    cookie,
                    (cookie % 4096) * 4096,
                    4096,
                );
            }
            stream.write_all(&requests).unwrap();
        })
    };
    // 20,000 x 4 KiB replies are more than the sockets buffer: the server fills its 64 slots
    // and stops reading.
    // The peak is recorded just after the in-flight count moves: wait for the peak itself,
    // then check that it is the cap and not more.
    let report = wait_for(
        Duration::from_secs(20),
        "the session to hold its 64 requests",
        || {
            let report = connections(&server);
            let held = report["connections"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["peak_inflight_requests"].as_u64() >= Some(64));
            held.then_some(report)
        },
    );
    let peak = report["connections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["peak_inflight_requests"].as_u64().unwrap())
        .max()
        .unwrap();
    assert_eq!(peak, 64, "{report}");
    still_serves(&server, "vol");
    // Nothing was dropped: every request gets its answer once the client reads.
    let mut seen = vec![false; 20_000];
    let mut payload = vec![0u8; 4096];
    for _ in 0..REQUESTS {
        let reply = client.read_simple_reply();
        assert_eq!(reply.error, 0);
        client.stream.read_exact(&mut payload).unwrap();
        let slot = &mut seen[usize::try_from(reply.cookie).unwrap()];
        assert!(!*slot, "cookie {} answered twice", reply.cookie);
        *slot = true;
    }
    writer.join().unwrap();
    assert!(seen.iter().all(|&s| s));
    let report = connections(&server);
    let peak = report["connections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["peak_inflight_requests"].as_u64().unwrap())
        .max()
        .unwrap();
    assert_eq!(peak, 64, "{report}");
    println!("20,000 pipelined 4 KiB READs: at most {peak} in flight, all 20,000 answered");
    client.disconnect();
    server.stop();
}

/// Resident memory of `pid` once it stops growing (no new peak for 300 ms), within `limit`.
fn settled_rss(pid: u32, limit: Duration) -> u64 {
    let mut last = proc_status_bytes(pid, "VmHWM");
    let mut since = Instant::now();
    wait_for(limit, "resident memory to settle", || {
        let now = proc_status_bytes(pid, "VmHWM");
        if now > last {
            last = now;
            since = Instant::now();
        }
        (since.elapsed() >= Duration::from_millis(300)).then_some(now)
    })
}

#[test]
fn memory_stays_within_the_node_budget_when_clients_never_read() {
    let dir = tempfile::tempdir().unwrap();
    // The node budget binds here (one tenant may use all of its shared pool); the case of 20
    // clients pipelining 32 MiB reads, which held 2.5 GiB before there was a node-wide budget.
    let node_budget = 512 * MIB;
    let server = server_with_limits(
        dir.path(),
        "max_inflight_bytes_per_node = \"512MiB\"\nmax_inflight_bytes_per_tenant = \"512MiB\"",
        &[],
    );
    server.create_volume("vol", "64MiB");
    // What 32 MiB charges can take: the node budget less every connection's reserve (a
    // quarter of it: 256 connections x 512 KiB), which is kept for connections that hold
    // little (a_fresh_connection_is_served_next_to_forty_of_its_tenant_that_never_read).
    let budget = u64_at(&connections(&server), "/memory/shared_inflight_bytes");
    assert_eq!(budget, node_budget - 128 * MIB);
    let pid = server.pid();
    let before = proc_status_bytes(pid, "VmRSS");
    let hogs: Vec<TcpStream> = (0..20)
        .map(|_| hog(server.nbd, "vol", 32, 32 << 20))
        .collect();
    let report = wait_for(Duration::from_secs(20), "the budget to fill", || {
        let report = connections(&server);
        (u64_at(&report, "/memory/inflight_bytes") == budget).then_some(report)
    });
    let hwm = settled_rss(pid, Duration::from_secs(30));
    let grown = hwm.saturating_sub(before);
    // Beyond the budget: idle pooled buffers (at most 64 MiB) and the sessions' own buffers.
    let allowance = 64 * MIB + 64 * MIB;
    println!(
        "20 clients x 32 pipelined 32 MiB READs, never read: peak RSS {} MiB (grew {} MiB from \
         {} MiB) against a shared pool of {} MiB (node budget {} MiB); {} charges waited",
        hwm / MIB,
        grown / MIB,
        before / MIB,
        budget / MIB,
        node_budget / MIB,
        u64_at(&report, "/memory/waited_charges_total")
    );
    assert!(
        grown <= budget + allowance,
        "grew {grown} bytes for a budget of {budget}"
    );
    let report = connections(&server);
    assert_eq!(u64_at(&report, "/memory/peak_inflight_bytes"), budget);
    // They stall; they do not fail: all 20 are still transmitting.
    assert_eq!(u64_at(&report, "/transmitting"), 20, "{report}");
    drop(hogs);
    wait_for(Duration::from_secs(20), "the budget to come back", || {
        let report = connections(&server);
        (u64_at(&report, "/memory/inflight_bytes") == 0 && u64_at(&report, "/open") == 0)
            .then_some(())
    });
    still_serves(&server, "vol");
    server.stop();
}

/// A 4 KiB READ on `client` answered within `limit`: its latency, or the error (a timeout
/// when the server does not answer in time).
fn timed_read(client: &mut Client, cookie: u64, limit: Duration) -> std::io::Result<Duration> {
    client.stream.set_read_timeout(Some(limit))?;
    let asked = Instant::now();
    client.send_request(0, NBD_CMD_READ, cookie, 0, 4096);
    let mut header = [0u8; 16];
    client.stream.read_exact(&mut header)?;
    let mut payload = vec![0u8; 4096];
    client.stream.read_exact(&mut payload)?;
    let waited = asked.elapsed();
    assert_eq!(
        u32::from_be_bytes(header[4..8].try_into().unwrap()),
        0,
        "READ failed"
    );
    assert_eq!(
        u64::from_be_bytes(header[8..16].try_into().unwrap()),
        cookie
    );
    Ok(waited)
}

#[test]
fn a_fresh_connection_is_served_next_to_forty_of_its_tenant_that_never_read() {
    let dir = tempfile::tempdir().unwrap();
    // The default limits: every plaintext client is the anonymous tenant, whose 256 MiB two
    // of these clients fill on their own.
    let server = server_with_limits(dir.path(), "", &[]);
    server.create_volume("vol", "64MiB");
    let pid = server.pid();
    let before = proc_status_bytes(pid, "VmRSS");
    let hogs: Vec<TcpStream> = (0..40)
        .map(|_| hog(server.nbd, "vol", 32, 32 << 20))
        .collect();
    let report = wait_for(
        Duration::from_secs(30),
        "40 hogs transmitting with their tenant's budget full",
        || {
            let report = connections(&server);
            (u64_at(&report, "/transmitting") == 40
                && tenant_bytes(&report, None) >= 256 * MIB
                && u64_at(&report, "/memory/tenants/0/waiting_charges") > 0)
                .then_some(report)
        },
    );
    let held_by_hogs = tenant_bytes(&report, None);
    // Same tenant, same address: only fairness between connections can serve it.
    let connected = Instant::now();
    let mut fresh = Client::open(server.nbd, "vol");
    let negotiated = connected.elapsed();
    let mut latencies = Vec::new();
    for cookie in 0..100 {
        match timed_read(&mut fresh, cookie, Duration::from_secs(10)) {
            Ok(waited) => latencies.push(waited),
            Err(err) => panic!(
                "4 KiB READ {cookie} of a fresh connection not answered within 10 s next to 40 \
                 reader-less connections holding {} MiB: {err}",
                held_by_hogs / MIB
            ),
        }
    }
    let first = latencies[0];
    let worst = latencies.iter().max().copied().unwrap();
    let hwm = settled_rss(pid, Duration::from_secs(30));
    let report = connections(&server);
    let node_budget = u64_at(&report, "/memory/max_inflight_bytes_per_node");
    println!(
        "40 reader-less connections of one tenant holding {} MiB: a fresh connection negotiated \
         in {:.1} ms, its first 4 KiB READ took {:.2} ms, the worst of 100 {:.2} ms; peak RSS {} \
         MiB (from {} MiB) against a node budget of {} MiB",
        held_by_hogs / MIB,
        negotiated.as_secs_f64() * 1e3,
        first.as_secs_f64() * 1e3,
        worst.as_secs_f64() * 1e3,
        hwm / MIB,
        before / MIB,
        node_budget / MIB,
    );
    // The ceiling is loose for a loaded 2-core machine; without fairness it is the 60 s stall
    // timeout.
    assert!(worst < Duration::from_secs(1), "worst READ took {worst:?}");
    // Beyond the budget: idle pooled buffers (at most 64 MiB) and the sessions' own buffers.
    assert!(
        hwm <= before + node_budget + 128 * MIB,
        "peak RSS {hwm} bytes for a node budget of {node_budget}"
    );
    assert!(u64_at(&report, "/memory/peak_inflight_bytes") <= node_budget);
    // The hogs hold their budgets all along: they stall, they are not cut off.
    assert_eq!(u64_at(&report, "/transmitting"), 41, "{report}");
    assert!(tenant_bytes(&report, None) >= held_by_hogs, "{report}");
    fresh.disconnect();
    drop(hogs);
    wait_for(Duration::from_secs(20), "the budget to come back", || {
        let report = connections(&server);
        (u64_at(&report, "/memory/inflight_bytes") == 0 && u64_at(&report, "/open") == 0)
            .then_some(())
    });
    server.stop();
}

#[test]
fn block_status_requests_in_flight_hold_their_replies_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let server = server_with_limits(dir.path(), "", &[]);
    server.create_volume("vol", "64MiB");
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    send_option(&mut stream, NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);
    send_option(
        &mut stream,
        NBD_OPT_SET_META_CONTEXT,
        &meta_payload("vol", &["base:allocation"]),
    );
    assert_eq!(
        read_option_reply(&mut stream).reply_type,
        NBD_REP_META_CONTEXT
    );
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);
    go(&mut stream, "vol").unwrap();
    // 8 READs of 4 MiB fill the socket buffers (their replies are never read), so the 100
    // BLOCK_STATUS replies behind them wait in the server with their charges. The READs go
    // first, and the BLOCK_STATUS requests once the first reply has begun to arrive: the
    // writer is then stuck in it (4 MiB do not fit in the socket buffers), and every later
    // reply waits behind it. (Sent together, a BLOCK_STATUS on the bulk lane may be answered
    // before the READs on the data lane, and pass them.)
    const READS: u64 = 8;
    const STATUSES: u64 = 100;
    let mut requests = Vec::new();
    let mut statuses_at = 0;
    for cookie in 0..READS + STATUSES {
        if cookie == READS {
            statuses_at = requests.len();
        }
        // DF: the READs of never-written data are answered with their zeros, not a hole.
        let (flags, command, length) = if cookie < READS {
            (NBD_CMD_FLAG_DF, NBD_CMD_READ, 4u32 << 20)
        } else {
            (0, NBD_CMD_BLOCK_STATUS, 64 << 20)
        };
        push_request(&mut requests, flags, command, cookie, 0, length);
    }
    stream.write_all(&requests[..statuses_at]).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut first = [0u8; 1];
    assert_eq!(
        stream.peek(&mut first).unwrap(),
        1,
        "the first READ's reply never began"
    );
    stream.write_all(&requests[statuses_at..]).unwrap();
    // Each BLOCK_STATUS holds its largest answer (2,048 descriptors of 8 bytes). The first
    // READ's reply may leave the server whole (the kernel's socket buffers can grow to hold
    // 4 MiB); the others, and every BLOCK_STATUS behind them, cannot. So the connection holds
    // `reads` READs (1 to 8) and the statuses; its requests and bytes say how many of each:
    // with `n` requests and `b` bytes, `statuses = (n * 4 MiB - b) / (4 MiB - 16 KiB)`.
    const READ_BYTES: u64 = 4 * MIB;
    const STATUS_BYTES: u64 = 16 << 10;
    let split = |report: &Value| {
        let requests = u64_at(report, "/connections/0/inflight_requests");
        let bytes = u64_at(report, "/connections/0/inflight_bytes");
        let unexplained = (requests * READ_BYTES).checked_sub(bytes)?;
        let statuses = unexplained / (READ_BYTES - STATUS_BYTES);
        (unexplained % (READ_BYTES - STATUS_BYTES) == 0 && statuses <= requests).then_some((
            requests - statuses,
            statuses,
            bytes,
        ))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let (report, reads, conn_bytes) = loop {
        let report = connections(&server);
        if let Some((reads, statuses, bytes)) = split(&report)
            && statuses == STATUSES
            && (1..=READS).contains(&reads)
            && u64_at(&report, "/memory/inflight_bytes") == bytes
        {
            break (report, reads, bytes);
        }
        assert!(
            Instant::now() < deadline,
            "the {STATUSES} BLOCK_STATUS requests never all held {STATUS_BYTES} bytes each \
             behind an unread READ: {report}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    println!(
        "{reads} unread 4 MiB READs and {STATUSES} BLOCK_STATUS behind them: the connection \
         holds {conn_bytes} bytes, {} of them of its reserve",
        u64_at(&report, "/memory/reserved_inflight_bytes")
    );
    assert_eq!(conn_bytes, reads * READ_BYTES + STATUSES * STATUS_BYTES);
    drop(stream);
    wait_for(Duration::from_secs(20), "the budget to come back", || {
        let report = connections(&server);
        (u64_at(&report, "/memory/inflight_bytes") == 0).then_some(())
    });
    server.stop();
}

#[test]
fn a_client_that_stops_reading_or_sending_is_cut_off_after_the_stall_timeout() {
    let dir = tempfile::tempdir().unwrap();
    // One client can fill its tenant's shared budget; its neighbour on the same tenant is served
    // from its own reserve meanwhile, and the stall timeout ends the hog.
    let server = server_with_limits(
        dir.path(),
        "client_stall_timeout_ms = 1000\nmax_inflight_bytes = \"64MiB\"\n\
         max_inflight_bytes_per_tenant = \"64MiB\"",
        &[],
    );
    server.create_volume("vol", "64MiB");
    let started = Instant::now();
    let hog = hog(server.nbd, "vol", 8, 32 << 20);
    wait_for(
        Duration::from_secs(20),
        "the hog to fill its tenant",
        || {
            let report = connections(&server);
            (tenant_bytes(&report, None) == 64 * MIB).then_some(())
        },
    );
    let mut neighbour = Client::open(server.nbd, "vol");
    let asked = Instant::now();
    assert_eq!(neighbour.read(1, 0, 4096).unwrap(), vec![0u8; 4096]);
    let waited = asked.elapsed().as_secs_f64();
    wait_for(Duration::from_secs(10), "the hog's end in the log", || {
        server
            .log()
            .contains("client stopped reading replies: it took no byte for 1000 ms")
            .then_some(())
    });
    let cut_off = started.elapsed().as_secs_f64();
    println!(
        "stall timeout 1 s: the reader-less hog was cut off {cut_off:.2} s after it began; its \
         neighbour's 4 KiB READ waited {waited:.2} s"
    );
    assert!(waited < 10.0, "the neighbour waited {waited:.2} s");

    // A WRITE whose payload stops coming: the session ends, and its 1 MiB comes back.
    let mut writer = Client::open(server.nbd, "vol");
    writer.send_request(0, NBD_CMD_WRITE, 9, 0, 1 << 20);
    writer.stream.write_all(&[0xabu8; 1000]).unwrap();
    assert!(closed_within(&mut writer.stream, Duration::from_secs(10)));
    wait_for(
        Duration::from_secs(10),
        "the writer's end in the log",
        || {
            server
                .log()
                .contains("client stopped sending a WRITE payload: no byte came for 1000 ms")
                .then_some(())
        },
    );
    neighbour.disconnect();
    drop(hog);
    wait_for(Duration::from_secs(10), "everything to come back", || {
        let report = connections(&server);
        (u64_at(&report, "/memory/inflight_bytes") == 0).then_some(())
    });
    // Nothing of the cut-off write was applied.
    let mut reader = Client::open(server.nbd, "vol");
    assert_eq!(reader.read(2, 0, 4096).unwrap(), vec![0u8; 4096]);
    reader.disconnect();
    server.stop();
}

#[test]
fn accept_failures_back_off_instead_of_spinning_and_service_resumes() {
    if !have_tool("prlimit") || !have_tool("nbdinfo") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 64 descriptors: a dozen for the server itself, then accept fails with EMFILE.
    let server = Server::start_wrapped(
        &dir.path().join("mem"),
        &["prlimit", "--nofile=64:64", "--"],
        &["--memory", "1GiB"],
    );
    server.create_volume("vol", "16MiB");
    let pid = server.pid();
    assert!(
        server.log().contains("RLIMIT_NOFILE allows 64 open files"),
        "no warning about the descriptor limit: {}",
        server.log()
    );
    let flood: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(server.nbd).unwrap())
        .collect();
    wait_for(Duration::from_secs(10), "accept to fail", || {
        server.log().contains("Too many open files").then_some(())
    });
    let ticks_before = cpu_ticks(pid);
    let measured = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let ticks = cpu_ticks(pid) - ticks_before;
    let seconds = measured.elapsed().as_secs_f64();
    println!("EMFILE: the server used {ticks} CPU ticks (1/100 s) in {seconds:.2} s");
    // A loop retrying accept at once burns a whole core: ~100 ticks per second.
    assert!(
        ticks <= 10,
        "{ticks} ticks in {seconds:.2} s while accept fails"
    );
    drop(flood);
    let (ok, nbdinfo_s, output) = nbdinfo(&server.uri("vol"), 30);
    assert!(ok, "nbdinfo after the flood: {output}");
    // nbdinfo got in, so the last run of failures has ended and been logged.
    let failures = server
        .log()
        .lines()
        .rev()
        .find_map(|l| l.split("accept works again after ").nth(1))
        .map(str::to_owned)
        .expect("the recovery logged");
    println!(
        "after the sockets closed nbdinfo took {nbdinfo_s:.2} s; accept works again after {failures}"
    );
    assert!(u64_at(&connections(&server), "/accept_errors_total") > 0);
    server.stop();
}

#[cfg(feature = "tls")]
mod with_tls {
    use super::*;

    /// fio's 4 KiB random reads at queue depth 1 for `seconds` on `uri`: (IOPS, mean, p99 in µs).
    fn fio_latency(uri: &str, seconds: u32) -> (f64, f64, f64) {
        let out = Command::new("timeout")
            .arg("60")
            .args([
                "fio",
                "--name=victim",
                "--ioengine=nbd",
                "--rw=randread",
                "--bs=4k",
            ])
            .args(["--iodepth=1", "--time_based", "--output-format=json"])
            .arg(format!("--runtime={seconds}"))
            .arg(format!("--uri={uri}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "fio: {}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        // fio prints "fio: connected ..." lines before the JSON.
        let json: Value = serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
        let read = &json["jobs"][0]["read"];
        let p99_ns = read["clat_ns"]["percentile"]["99.000000"].as_f64().unwrap();
        (
            read["iops"].as_f64().unwrap(),
            read["clat_ns"]["mean"].as_f64().unwrap() / 1000.0,
            p99_ns / 1000.0,
        )
    }

    const KEY_BOB: &str = "3b9e0d7c5a1f8e2d4c6b0a9f7e5d3c1b2a4f6e8d0c9b7a5f3e1d2c4b6a8f0e9d";

    /// A client process, killed (SIGKILL, by PID) when dropped.
    struct Frozen(std::process::Child);

    impl Frozen {
        fn signal(&self, name: &str) {
            let status = Command::new("kill")
                .arg(format!("-{name}"))
                .arg(self.0.id().to_string())
                .status()
                .unwrap();
            assert!(status.success(), "kill -{name}");
        }
    }

    impl Drop for Frozen {
        fn drop(&mut self) {
            self.signal("KILL");
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_tenant_whose_clients_never_read_does_not_starve_another() {
        if !have_tool("fio") || !have_tool("nbdcopy") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys.psk");
        std::fs::write(&keys, format!("bob:{KEY_BOB}\n")).unwrap();
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        // The default limits (128 MiB per connection, 256 MiB per tenant, 1 GiB per node).
        let config = write_config(dir.path(), "");
        // Files, not RAM: bob's 16 GiB volume below holds data in every extent, mostly sparse
        // file ranges, which cost no memory.
        let server = Server::start_with(
            &dir.path().join("data"),
            &[
                "--config",
                config.to_str().unwrap(),
                "--tls-psk-file",
                keys.to_str().unwrap(),
            ],
        );
        server.create_volume("victim", "64MiB");
        // 16 GiB, so the copy cannot end first.
        server.create_tenant("bob");
        server.create_volume_with("b1", "16GiB", &["--tenant", "bob"]);
        let bob = format!(
            "nbds://bob@{}/b1?tls-psk-file={}",
            server.nbd,
            keys.display()
        );
        // One byte in every 2 MiB extent, so every read carries a payload: a read of a hole is
        // answered with a 12-byte hole chunk and would hold no buffer.
        let pattern = dir.path().join("pattern.raw");
        {
            use std::os::unix::fs::FileExt;
            let file = std::fs::File::create(&pattern).unwrap();
            file.set_len(16 << 30).unwrap();
            for extent in 0..(16u64 << 30) / (2 << 20) {
                file.write_all_at(&[1], extent * (2 << 20)).unwrap();
            }
        }
        let out = Command::new("nbdcopy")
            .arg("--destination-is-zero")
            .arg(&pattern)
            .arg(&bob)
            .output()
            .unwrap();
        assert!(out.status.success(), "nbdcopy: {}", text(&out));
        std::fs::remove_file(&pattern).unwrap();
        let pid = server.pid();
        let before = proc_status_bytes(pid, "VmRSS");
        let victim = server.uri("victim");
        let alone = fio_latency(&victim, 2);

        // Tenant bob: nbdcopy over TLS, 4 connections with 8 x 32 MiB reads in flight each,
        // stopped with SIGSTOP once it transmits: a frozen client that reads no reply.
        let hog = Frozen(
            Command::new("nbdcopy")
                .args([
                    "--no-extents",
                    "--threads=4",
                    "--connections=4",
                    "--requests=8",
                ])
                .args(["--request-size=33554432", "--queue-size=1073741824"])
                .arg(&bob)
                .arg("null:")
                .spawn()
                .unwrap(),
        );
        // Stopped once it has its tenant's whole budget in flight (and more requests queued).
        wait_for(
            Duration::from_secs(20),
            "bob's 4 connections at his budget",
            || {
                let report = connections(&server);
                (u64_at(&report, "/transmitting") >= 4
                    && tenant_bytes(&report, Some("bob")) == 256 * MIB)
                    .then_some(())
            },
        );
        hog.signal("STOP");
        let report = wait_for(Duration::from_secs(20), "bob to fill his budget", || {
            let report = connections(&server);
            (tenant_bytes(&report, Some("bob")) == 256 * MIB).then_some(report)
        });
        assert!(
            u64_at(&report, "/transmitting") >= 4,
            "nbdcopy finished too early: {report}"
        );
        // Up to three windows of 2 s, the bound applying to the best: starvation by the frozen
        // tenant lasts as long as it is frozen, so it fails all three, while one stall of the
        // shared machine (a CI run once saw a single read take 2.6 s, and the next nbdcopy of
        // the victim run at its usual speed) fails one. Every window is printed.
        let bound_us = (alone.1 * 10.0).max(2_000.0);
        let mut windows = Vec::new();
        while windows.len() < 3 {
            let window = fio_latency(&victim, 2);
            windows.push(window);
            if window.1 < bound_us {
                break;
            }
        }
        let crowded = windows
            .iter()
            .copied()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap();
        let copy = dir.path().join("victim.raw");
        let copy_started = Instant::now();
        let out = Command::new("timeout")
            .args(["60", "nbdcopy", "--no-extents", &victim])
            .arg(&copy)
            .output()
            .unwrap();
        assert!(out.status.success(), "nbdcopy: {}", text(&out));
        let copy_s = copy_started.elapsed().as_secs_f64();
        assert_eq!(std::fs::metadata(&copy).unwrap().len(), 64 * MIB);

        let report = connections(&server);
        // Bob held his tenant's whole budget all along, and never more.
        assert_eq!(tenant_bytes(&report, Some("bob")), 256 * MIB, "{report}");
        let bob_peak = report["memory"]["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tenant"] == "bob")
            .map(|t| t["peak_inflight_bytes"].as_u64().unwrap())
            .unwrap();
        assert_eq!(bob_peak, 256 * MIB, "{report}");
        let hwm = settled_rss(pid, Duration::from_secs(30));
        let windows_text = windows
            .iter()
            .map(|w| format!("{:.0} IOPS, mean {:.0} us, p99 {:.0} us", w.0, w.1, w.2))
            .collect::<Vec<_>>()
            .join("; ");
        println!(
            "victim alone: {:.0} IOPS, mean {:.0} us, p99 {:.0} us; next to a frozen tenant \
             holding its 256 MiB ({} window(s) of 2 s): {windows_text}; nbdcopy of 64 MiB \
             {copy_s:.2} s; peak RSS {} MiB (from {} MiB)",
            alone.0,
            alone.1,
            alone.2,
            windows.len(),
            hwm / MIB,
            before / MIB,
        );
        // Served, at a latency of the same order. A starved victim would not finish at all;
        // the bound is loose because the 2 cores are shared (runs alone vary 2x).
        assert!(
            crowded.1 < bound_us,
            "mean latency {:.0} us next to the frozen tenant in its best of {} windows \
             ({windows_text}), {:.0} us alone",
            crowded.1,
            windows.len(),
            alone.1
        );
        drop(hog);
        wait_for(Duration::from_secs(20), "bob's bytes to come back", || {
            let report = connections(&server);
            (u64_at(&report, "/memory/inflight_bytes") == 0).then_some(())
        });
        server.stop();
    }
}
