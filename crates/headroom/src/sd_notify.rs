//! systemd readiness (`Type=notify`, `sd_notify(3)`): `READY=1` once the server's listeners
//! are bound, `STOPPING=1` when it starts shutting down, so `systemctl start` returns when
//! clients can connect and units ordered `After=headroom.service` start only then.
//!
//! The protocol is one datagram to the `AF_UNIX` socket named by `$NOTIFY_SOCKET`: a path, or
//! an abstract name when it starts with `@` (std's `SocketAddrExt::from_abstract_name`; no
//! `unsafe`, no libsystemd). Without `$NOTIFY_SOCKET` (not under systemd) nothing happens; a
//! failed send is logged and ignored: readiness is a courtesy, never a reason to stop serving.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;

/// Sends `state` (`READY=1`, `STOPPING=1`, newline-separated assignments such as
/// `STATUS=...`) to systemd if it asked for notifications.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    match send(&socket, state) {
        Ok(()) => tracing::debug!("sd_notify {state}"),
        Err(err) => tracing::warn!("sd_notify {state} to {}: {err}", socket.to_string_lossy()),
    }
}

fn send(socket: &OsStr, state: &str) -> std::io::Result<()> {
    let datagram = UnixDatagram::unbound()?;
    let name = socket.as_bytes();
    if name.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "NOTIFY_SOCKET is empty",
        ));
    }
    let sent = match name.strip_prefix(b"@") {
        Some(abstract_name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)?;
            datagram.send_to_addr(state.as_bytes(), &addr)?
        }
        None => datagram.send_to(state.as_bytes(), std::path::Path::new(socket))?,
    };
    if sent != state.len() {
        return Err(std::io::Error::other("short datagram"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_and_to_an_abstract_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let receiver = UnixDatagram::bind(&path).expect("bind");
        send(path.as_os_str(), "READY=1").expect("send to a path");
        let mut buf = [0u8; 64];
        let n = receiver.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("headroom-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .expect("abstract address");
        let receiver = UnixDatagram::bind_addr(&addr).expect("bind abstract");
        send(OsStr::new(&format!("@{name}")), "STOPPING=1").expect("send to an abstract name");
        let n = receiver.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..n], b"STOPPING=1");

        assert!(send(OsStr::new(""), "READY=1").is_err());
        assert!(send(dir.path().join("nobody").as_os_str(), "READY=1").is_err());
    }
}
