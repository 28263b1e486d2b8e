//! The management API under a flood of half-sent requests, against the real server process:
//! 25,000 connections that each sent half a request head and stopped, with the server held
//! to 4,096 open files (`prlimit`). The API's connection cap (1,024 by default) evicts the
//! oldest unfinished connections instead of refusing new ones, and keeps its descriptors
//! well under the limit, so while the flood is held open:
//!
//! * a new NBD client is served (nbdinfo, and the in-test client writes a block);
//! * `/healthz` answers 200 within 5 s;
//! * SIGTERM flushes and exits within 15 s (graceful shutdown does not wait for half-sent
//!   requests), and the block written is there after a restart.
//!
//! Before (axum::serve, no timer, no cap): the flood took every descriptor, nbdinfo failed
//! (EMFILE at NBD accept), and SIGTERM waited for the half-sent requests for ever.
//!
//! The flood keeps open every socket the server keeps open: each time it has opened another
//! 500 it closes its end of those the server has already closed (evicted). Holding dead
//! sockets would cost the server nothing more, and would exhaust the test's own ephemeral
//! ports (28,000 on 127.0.0.1) and descriptors (a hard limit of 20,000 here, which the test
//! process cannot raise) long before the server noticed. A server without the cap keeps all
//! of them open, and then the flood hits those limits itself and fails.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::raw::Client;
use common::{Server, agent, bearer, have_tool, run_ok};

const FLOOD_CONNECTIONS: u64 = 25_000;
/// The server's descriptor limit: far below the flood, far above its caps.
const SERVER_NOFILE: u64 = 4_096;

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (the flood's sockets).
fn raise_own_nofile() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    );
}

/// False once the server has closed `stream` (EOF or reset); the flood sockets are
/// non-blocking.
fn open_at_server(stream: &TcpStream) -> bool {
    match stream.peek(&mut [0u8; 1]) {
        Err(err) => err.kind() == std::io::ErrorKind::WouldBlock,
        // EOF: closed; bytes: the server answered, so it is no longer half-sent.
        Ok(_) => false,
    }
}

#[test]
fn a_flood_of_half_sent_requests_starves_neither_nbd_nor_health_nor_shutdown() {
    if !have_tool("prlimit") || !have_tool("nbdinfo") {
        return;
    }
    raise_own_nofile();
    let dir = tempfile::tempdir().unwrap();
    let nofile = format!("--nofile={SERVER_NOFILE}:{SERVER_NOFILE}");
    let data = dir.path().join("data");
    let args = ["--devices", "1", "--device-size", "1GiB"];
    let server = Server::start_wrapped(&data, &["prlimit", &nofile, "--"], &args);
    server.create_volume("v", "64MiB");
    let api_addr = server.api.strip_prefix("http://").unwrap().to_string();

    // The flood: each sends half a request head (no blank line) and stops.
    let api_sockaddr: std::net::SocketAddr = api_addr.parse().unwrap();
    let started = Instant::now();
    let mut held: Vec<TcpStream> = Vec::new();
    let mut most_held = 0;
    for i in 0..FLOOD_CONNECTIONS {
        // A server that stops accepting (EMFILE) leaves connects hanging: bounded here.
        let mut stream = TcpStream::connect_timeout(&api_sockaddr, Duration::from_secs(10))
            .unwrap_or_else(|err| panic!("flood connection {i}: {err}"));
        // An evicted socket may be closed under us: that write error is the point.
        let _ = stream.write_all(b"GET /v1/volumes HTTP/1.1\r\nHost: x\r\nAuthoriz");
        stream.set_nonblocking(true).unwrap();
        held.push(stream);
        if (i + 1).is_multiple_of(500) {
            held.retain(open_at_server);
        }
        most_held = most_held.max(held.len());
    }
    held.retain(open_at_server);
    let flood_s = started.elapsed().as_secs_f64();

    // NBD: a new client is served.
    let started = Instant::now();
    run_ok(std::process::Command::new("nbdinfo").arg(server.uri("v")));
    let nbdinfo_s = started.elapsed().as_secs_f64();
    let block: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let mut client = Client::open(server.nbd, "v");
    assert_eq!(client.write(1, 8192, &block, 0), 0, "NBD write");
    assert_eq!(client.flush(2), 0, "NBD flush");
    client.disconnect();

    // Health: answered within 5 s.
    let started = Instant::now();
    let response = agent()
        .get(format!("{}/healthz", server.api))
        .config()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .call()
        .expect("/healthz within 5 s");
    let healthz_s = started.elapsed().as_secs_f64();
    assert_eq!(response.status().as_u16(), 200);
    assert!(healthz_s < 5.0, "/healthz took {healthz_s:.2} s");

    // The API's own account: capped, and the flood evicted.
    let mut response = agent()
        .get(format!("{}/v1/connections", server.api))
        .header("authorization", bearer())
        .call()
        .unwrap();
    let report: serde_json::Value = response.body_mut().read_json().unwrap();
    let api = &report["api"];
    let cap = api["max_connections"].as_u64().unwrap();
    let evicted = api["evicted_total"].as_u64().unwrap();
    assert!(api["open"].as_u64().unwrap() <= cap, "{api}");
    assert!(cap < SERVER_NOFILE, "{api}");
    assert!(evicted >= FLOOD_CONNECTIONS - cap, "{api}");
    assert_eq!(
        report["accept_errors_total"], 0,
        "NBD accept failed: {report}"
    );

    // SIGTERM with the flood still held open: flushed and gone within 15 s.
    let (status, took) = server.stop_within(Duration::from_secs(15));
    assert!(status.success(), "exit status {status}");
    let stop_s = took.as_secs_f64();
    common::report(&format!(
        "{FLOOD_CONNECTIONS} half-sent API connections opened in {flood_s:.1} s (API cap \
         {cap}, {evicted} evicted, at most {most_held} open at the client, {} still open); nbdinfo served in {nbdinfo_s:.2} s; /healthz 200 in \
         {healthz_s:.3} s; SIGTERM to exit {stop_s:.2} s",
        held.len()
    ));
    drop(held);

    // The block acknowledged before SIGTERM is there after a restart.
    let server = Server::start_with(&data, &args);
    let mut client = Client::open(server.nbd, "v");
    assert_eq!(client.read(3, 8192, 4096).expect("read back"), block);
    client.disconnect();
    server.stop();
}

/// Reads until the server closes `stream` (EOF or reset); panics past `limit`. Returns
/// whatever it answered first.
fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> String {
    use std::io::Read;
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(err) => panic!("the server did not close the connection within {limit:?}: {err}"),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// Each phase's deadline closes the connection: a head never finished, a body never
/// finished (from a client with the token), and a kept-alive connection left idle. The
/// deadlines are 300-500 ms; the test allows 20 s for each close (a loaded machine), and
/// checks the server counted three timeouts. Without the deadlines (hyper without a timer)
/// the first read waits its 20 s and fails.
#[test]
fn each_phase_of_a_request_has_a_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("headroom.toml");
    std::fs::write(
        &config,
        "[api]\nheader_read_timeout_ms = 300\nbody_read_timeout_ms = 400\nidle_timeout_ms = 500\n",
    )
    .unwrap();
    let config = config.to_str().unwrap().to_string();
    let server = Server::start_with(
        &dir.path().join("data"),
        &["--memory", "1GiB", "--config", &config],
    );
    let addr = server.api.strip_prefix("http://").unwrap().to_string();
    let limit = Duration::from_secs(20);

    let mut head = TcpStream::connect(&addr).unwrap();
    head.write_all(b"GET /v1/volumes HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    read_until_closed(&mut head, limit);

    let mut body = TcpStream::connect(&addr).unwrap();
    let request = format!(
        "POST /v1/volumes HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"name\":",
        bearer()
    );
    body.write_all(request.as_bytes()).unwrap();
    let answer = read_until_closed(&mut body, limit);
    assert!(
        answer.is_empty(),
        "answered a request whose body never came: {answer}"
    );

    let mut idle = TcpStream::connect(&addr).unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = read_until_closed(&mut idle, limit);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let mut response = agent()
        .get(format!("{}/v1/connections", server.api))
        .header("authorization", bearer())
        .call()
        .unwrap();
    let report: serde_json::Value = response.body_mut().read_json().unwrap();
    assert_eq!(report["api"]["timed_out_total"], 3, "{report}");
    assert_eq!(report["api"]["header_read_timeout_ms"], 300, "{report}");
    // Nothing was created by the half-sent POST.
    assert_eq!(server.cli(&["volume", "list", "--json"]).stdout, b"[]\n");
    server.stop();
}
