//! TLS on the NBD port, driven by the real clients: qemu-img (GnuTLS, PSK
//! and X.509 credentials objects) and libnbd's nbdinfo/nbdcopy (`nbds://` URIs). Credentials
//! are generated here with the openssl CLI into a temporary directory. A build without the
//! `tls` feature checks instead that the TLS flags fail with a clear message.
//!
//! Tenants: the PSK identity or the client certificate's CN is the
//! session's tenant; it lists and opens only its tenant's volumes, and anything else is
//! answered as a missing volume is (the plaintext side is in `tenants.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

#[cfg(not(feature = "tls"))]
#[test]
fn tls_flags_without_the_feature_say_how_to_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    for flags in [
        vec!["--tls-psk-file", "keys.psk"],
        vec!["--tls-cert-dir", "certs"],
        vec!["--tls-required"],
    ] {
        let out = std::process::Command::new(common::BIN)
            .args(["serve", "--memory", "1GiB"])
            .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
            .args(&flags)
            .current_dir(dir.path())
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let text = common::text(&out);
        assert!(!out.status.success(), "{flags:?}: {text}");
        assert!(
            text.contains("built without TLS; rebuild with --features tls"),
            "{flags:?}: {text}"
        );
    }
}

#[cfg(feature = "tls")]
mod with_tls {
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output};

    use serde_json::Value;

    use super::common::raw::*;
    use super::common::{Server, have_tool, random_file, run_ok, start_fails, text};
    use headroom_nbd::consts::*;

    fn openssl(dir: &Path, args: &[&str]) {
        run_ok(Command::new("openssl").args(args).current_dir(dir));
    }

    /// A CA, and a certificate signed by it for `cn` (`server`: for 127.0.0.1 and localhost).
    fn ca(dir: &Path, name: &str) {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &format!("{name}-key.pem"),
                "-out",
                &format!("{name}-cert.pem"),
                "-days",
                "2",
                "-subj",
                &format!("/CN={name}"),
            ],
        );
    }

    fn signed(dir: &Path, ca_name: &str, name: &str, cn: &str, server: bool) {
        let ext = if server {
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n\
             keyUsage=digitalSignature\nbasicConstraints=CA:FALSE\n"
        } else {
            "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature\nbasicConstraints=CA:FALSE\n"
        };
        std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &format!("{name}-key.pem"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN={cn}"),
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                &format!("{ca_name}-cert.pem"),
                "-CAkey",
                &format!("{ca_name}-key.pem"),
                "-CAcreateserial",
                "-out",
                &format!("{name}-cert.pem"),
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
            ],
        );
    }

    /// Directories in qemu's layout: `server/` for headroom (with `ca-crl.pem`, which revokes
    /// `revoked/`'s certificate), `client/` (trusted client certificate, CN `tenant-a`),
    /// `hostb/` (trusted, CN `host-b.example`), `unmapped/` (trusted, CN `tenant-b`, which
    /// `CERT_TENANTS` does not map), `revoked/` (signed by the CA, CN `host-r.example`, then
    /// revoked), `rogue/` (a client certificate from another CA), `nocert/` (CA only).
    struct Certs {
        server: PathBuf,
        client: PathBuf,
        hostb: PathBuf,
        unmapped: PathBuf,
        revoked: PathBuf,
        rogue: PathBuf,
        nocert: PathBuf,
    }

    /// The certificate-to-tenant map the servers get: CN `tenant-a` acts for tenant-a,
    /// `host-b.example` and `host-r.example` for tenant-b; a certificate with CN `tenant-b`
    /// (`unmapped/`) acts for nobody, its name notwithstanding.
    const CERT_TENANTS: [&str; 6] = [
        "--tls-cert-tenant",
        "tenant-a=tenant-a",
        "--tls-cert-tenant",
        "host-b.example=tenant-b",
        "--tls-cert-tenant",
        "host-r.example=tenant-b",
    ];

    /// Revokes `name-cert.pem` with `openssl ca` and writes the CA's list to `ca-crl.pem`.
    fn revoke(dir: &Path, name: &str) {
        std::fs::write(
            dir.join("ca.cnf"),
            "[ca]\ndefault_ca = headroom_test\n[headroom_test]\ndatabase = index.txt\n\
             crlnumber = crlnumber\ndefault_md = sha256\ndefault_crl_days = 2\n",
        )
        .unwrap();
        std::fs::write(dir.join("index.txt"), "").unwrap();
        std::fs::write(dir.join("crlnumber"), "01\n").unwrap();
        let ca = [
            "-config",
            "ca.cnf",
            "-keyfile",
            "ca-key.pem",
            "-cert",
            "ca-cert.pem",
        ];
        let cert = format!("{name}-cert.pem");
        openssl(dir, &[&["ca"], &ca[..], &["-revoke", &cert]].concat());
        openssl(
            dir,
            &[&["ca"], &ca[..], &["-gencrl", "-out", "ca-crl.pem"]].concat(),
        );
    }

    fn make_certs(root: &Path) -> Certs {
        let work = root.join("pki");
        std::fs::create_dir_all(&work).unwrap();
        ca(&work, "ca");
        ca(&work, "otherca");
        signed(&work, "ca", "server", "localhost", true);
        signed(&work, "ca", "client", "tenant-a", false);
        signed(&work, "ca", "hostb", "host-b.example", false);
        signed(&work, "ca", "unmapped", "tenant-b", false);
        signed(&work, "ca", "revoked", "host-r.example", false);
        signed(&work, "otherca", "rogue", "tenant-a", false);
        revoke(&work, "revoked");
        let layout = |dir: &str, files: &[(&str, &str)]| {
            let path = root.join(dir);
            std::fs::create_dir_all(&path).unwrap();
            for (from, to) in files {
                std::fs::copy(work.join(from), path.join(to)).unwrap();
            }
            path
        };
        let client_layout = |name: &str| {
            layout(
                name,
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    (&format!("{name}-cert.pem"), "client-cert.pem"),
                    (&format!("{name}-key.pem"), "client-key.pem"),
                ],
            )
        };
        Certs {
            server: layout(
                "server",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("ca-crl.pem", "ca-crl.pem"),
                    ("server-cert.pem", "server-cert.pem"),
                    ("server-key.pem", "server-key.pem"),
                ],
            ),
            client: layout(
                "client",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("client-cert.pem", "client-cert.pem"),
                    ("client-key.pem", "client-key.pem"),
                ],
            ),
            hostb: client_layout("hostb"),
            unmapped: client_layout("unmapped"),
            revoked: client_layout("revoked"),
            rogue: layout(
                "rogue",
                &[
                    ("ca-cert.pem", "ca-cert.pem"),
                    ("rogue-cert.pem", "client-cert.pem"),
                    ("rogue-key.pem", "client-key.pem"),
                ],
            ),
            nocert: layout("nocert", &[("ca-cert.pem", "ca-cert.pem")]),
        }
    }

    /// qemu's PSK directory: `keys.psk` with `identity:hexkey`.
    fn psk_dir(root: &Path, name: &str, line: &str) -> PathBuf {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("keys.psk");
        std::fs::write(&keys, format!("{line}\n")).unwrap();
        // The server refuses a key file others may read.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
        dir
    }

    const KEY_A: &str = "7d1f4c0b9e3a2f68a1c5e9d0b4f7a3c26e8d1b5f9a0c4e7d2b6f8a1c3e5d7f90";
    const KEY_B: &str = "3b9e0d7c5a1f8e2d4c6b0a9f7e5d3c1b2a4f6e8d0c9b7a5f3e1d2c4b6a8f0e9d";
    const KEY_WRONG: &str = "0000000000000000000000000000000000000000000000000000000000000001";

    /// A server on a 1 GiB memory backend in `data_dir`, with these TLS flags.
    fn tls_server(data_dir: &Path, tls_flags: &[&str]) -> Server {
        let mut args = vec!["--memory", "1GiB"];
        args.extend_from_slice(tls_flags);
        Server::start_with(data_dir, &args)
    }

    fn tools() -> bool {
        have_tool("openssl")
            && have_tool("qemu-img")
            && have_tool("nbdinfo")
            && have_tool("nbdcopy")
    }

    fn qemu_img(args: &[&str], object: &str, server: &Server, export: &str) -> Output {
        let image = format!(
            "driver=nbd,host=127.0.0.1,port={},export={export},tls-creds=tls0",
            server.nbd.port()
        );
        Command::new("timeout")
            .arg("60")
            .arg("qemu-img")
            .args(args)
            .args(["--object", object, "--image-opts", &image])
            .output()
            .unwrap()
    }

    fn qemu_img_convert_in(source: &Path, object: &str, server: &Server, export: &str) -> Output {
        let image = format!(
            "driver=nbd,host=127.0.0.1,port={},export={export},tls-creds=tls0",
            server.nbd.port()
        );
        Command::new("timeout")
            .arg("60")
            .args(["qemu-img", "convert", "-n", "-f", "raw", "--object", object])
            .arg(source)
            .args(["--target-image-opts", &image])
            .output()
            .unwrap()
    }

    fn nbds(server: &Server, export: &str, user: Option<&str>, query: &str) -> String {
        let user = user.map(|u| format!("{u}@")).unwrap_or_default();
        format!("nbds://{user}{}/{export}?{query}", server.nbd)
    }

    fn nbdinfo(uri: &str) -> Output {
        Command::new("timeout")
            .args(["60", "nbdinfo", uri])
            .output()
            .unwrap()
    }

    /// `TLSv1.x` versions the server logged for finished handshakes.
    fn handshake_versions(server: &Server) -> Vec<String> {
        server
            .log()
            .lines()
            .filter_map(|line| line.split("TLS handshake done: ").nth(1))
            .map(|rest| rest.split_whitespace().next().unwrap_or("").to_string())
            .collect()
    }

    #[test]
    fn psk_qemu_writes_and_libnbd_reads_back_over_tls_1_3_and_1_2() {
        if !tools() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let psk = psk_dir(root, "psk", &format!("alice:{KEY_A}"));
        let keys = psk.join("keys.psk");
        let server = tls_server(
            &root.join("mem"),
            &["--tls-psk-file", keys.to_str().unwrap(), "--tls-required"],
        );
        server.create_tenant("alice");
        server.create_volume_with("v", "16MiB", &["--tenant", "alice"]);

        let object = format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
            psk.display()
        );
        let info = qemu_img(&["info"], &object, &server, "v");
        assert!(
            info.status.success(),
            "qemu-img info over PSK: {}",
            text(&info)
        );
        assert!(
            String::from_utf8_lossy(&info.stdout).contains("16 MiB"),
            "{}",
            text(&info)
        );

        let source = root.join("source.raw");
        random_file(&source, 16 << 20, 11);
        let convert = qemu_img_convert_in(&source, &object, &server, "v");
        assert!(
            convert.status.success(),
            "qemu-img convert over PSK: {}",
            text(&convert)
        );

        let query = format!("tls-psk-file={}", keys.display());
        let uri = nbds(&server, "v", Some("alice"), &query);
        let copy = root.join("copy.raw");
        run_ok(
            Command::new("timeout")
                .args(["60", "nbdcopy", &uri])
                .arg(&copy),
        );
        assert!(
            std::fs::read(&copy).unwrap() == std::fs::read(&source).unwrap(),
            "data read back over TLS differs from what qemu-img wrote"
        );
        let versions = handshake_versions(&server);
        assert!(
            versions.len() >= 3 && versions.iter().all(|v| v == "TLSv1.3"),
            "GnuTLS clients negotiate TLS 1.3 PSK by default: {versions:?}"
        );

        // TLS 1.2 PSK, as a GnuTLS whose system policy disables TLS 1.3 negotiates it.
        let policy = root.join("gnutls-no-tls13.conf");
        std::fs::write(&policy, "[overrides]\ndisabled-version = tls1.3\n").unwrap();
        let info12 = Command::new("timeout")
            .args(["60", "nbdinfo", &uri])
            .env("GNUTLS_SYSTEM_PRIORITY_FILE", &policy)
            .output()
            .unwrap();
        assert!(
            info12.status.success(),
            "nbdinfo over TLS 1.2 PSK: {}",
            text(&info12)
        );
        let last = handshake_versions(&server).pop();
        assert_eq!(
            last.as_deref(),
            Some("TLSv1.2"),
            "the policy file forces TLS 1.2"
        );
        server.stop();
    }

    #[test]
    fn wrong_psk_and_untrusted_certificates_fail_cleanly_and_spare_other_sessions() {
        if !tools() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let certs = make_certs(root);
        let good = psk_dir(root, "psk", &format!("alice:{KEY_A}"));
        let wrong = psk_dir(root, "wrong", &format!("alice:{KEY_WRONG}"));
        let stranger = psk_dir(root, "stranger", &format!("mallory:{KEY_A}"));
        // SELECTIVETLS (TLS not required), so a plaintext session can watch.
        let server = tls_server(
            &root.join("mem"),
            &[
                "--tls-psk-file",
                good.join("keys.psk").to_str().unwrap(),
                "--tls-cert-dir",
                certs.server.to_str().unwrap(),
                CERT_TENANTS[0],
                CERT_TENANTS[1],
            ],
        );
        // `v` has no tenant (the plaintext watcher's); the good clients open their own.
        server.create_volume("v", "16MiB");
        server.create_tenant("alice");
        server.create_volume_with("va", "16MiB", &["--tenant", "alice"]);
        server.create_tenant("tenant-a");
        server.create_volume_with("vt", "16MiB", &["--tenant", "tenant-a"]);
        let mut watcher = Client::open(server.nbd, "v");
        assert_eq!(watcher.write(1, 0, &[0xa5; 4096], 0), 0);

        // Wrong key for a known identity, and an unknown identity.
        for (dir, user) in [(&wrong, "alice"), (&stranger, "mallory")] {
            let query = format!("tls-psk-file={}", dir.join("keys.psk").display());
            let out = nbdinfo(&nbds(&server, "v", Some(user), &query));
            assert!(
                !out.status.success(),
                "{user} with a bad key got in: {}",
                text(&out)
            );
            let object = format!(
                "tls-creds-psk,id=tls0,endpoint=client,dir={},username={user}",
                dir.display()
            );
            let out = qemu_img(&["info"], &object, &server, "v");
            assert!(
                !out.status.success(),
                "qemu-img {user} with a bad key: {}",
                text(&out)
            );
        }
        // A client certificate from another CA, and no client certificate at all.
        for bad in [&certs.rogue, &certs.nocert] {
            let query = format!("tls-certificates={}", bad.display());
            let out = nbdinfo(&nbds(&server, "v", None, &query));
            assert!(
                !out.status.success(),
                "{} got in: {}",
                bad.display(),
                text(&out)
            );
            let object = format!(
                "tls-creds-x509,id=tls0,endpoint=client,dir={}",
                bad.display()
            );
            let out = qemu_img(&["info"], &object, &server, "v");
            assert!(
                !out.status.success(),
                "qemu-img {}: {}",
                bad.display(),
                text(&out)
            );
        }
        assert!(
            server.log().contains("TLS handshake"),
            "the failures are logged as TLS handshake errors"
        );

        // The plaintext session never noticed, and good credentials still work.
        assert_eq!(watcher.read(2, 0, 4096).unwrap(), vec![0xa5; 4096]);
        let query = format!("tls-certificates={}", certs.client.display());
        let out = nbdinfo(&nbds(&server, "vt", None, &query));
        assert!(
            out.status.success(),
            "trusted client certificate: {}",
            text(&out)
        );
        let object = format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            certs.client.display()
        );
        let out = qemu_img(&["info"], &object, &server, "vt");
        assert!(out.status.success(), "qemu-img x509: {}", text(&out));
        let query = format!("tls-psk-file={}", good.join("keys.psk").display());
        let out = nbdinfo(&nbds(&server, "va", Some("alice"), &query));
        assert!(out.status.success(), "good PSK: {}", text(&out));
        assert!(
            server
                .log()
                .contains("peer Certificate { cn: \"tenant-a\", tenant: \"tenant-a\" }")
                && server.log().contains("peer PskIdentity(\"alice\")"),
            "the server knows who connected"
        );
        watcher.disconnect();
        server.stop();
    }

    #[test]
    fn tls_required_refuses_plaintext_clients() {
        if !tools() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let certs = make_certs(root);
        let server = tls_server(
            &root.join("mem"),
            &[
                "--tls-cert-dir",
                certs.server.to_str().unwrap(),
                CERT_TENANTS[0],
                CERT_TENANTS[1],
                "--tls-required",
            ],
        );
        server.create_tenant("tenant-a");
        server.create_volume_with("v", "16MiB", &["--tenant", "tenant-a"]);

        // Real plaintext clients fail.
        let out = nbdinfo(&server.uri("v"));
        assert!(
            !out.status.success(),
            "plaintext nbdinfo got in: {}",
            text(&out)
        );
        let out = Command::new("timeout")
            .args(["60", "qemu-img", "info", &server.uri("v")])
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "plaintext qemu-img got in: {}",
            text(&out)
        );

        // Byte level: every option but STARTTLS and ABORT gets NBD_REP_ERR_TLS_REQD.
        let mut stream = connect(server.nbd);
        greet(&mut stream);
        for (option, data) in [
            (NBD_OPT_STRUCTURED_REPLY, Vec::new()),
            (NBD_OPT_LIST, Vec::new()),
            (NBD_OPT_INFO, go_payload("v")),
            (NBD_OPT_GO, go_payload("v")),
            (NBD_OPT_GO, go_payload("missing")),
        ] {
            send_option(&mut stream, option, &data);
            let reply = read_option_reply(&mut stream);
            assert_eq!(
                (reply.option, reply.reply_type),
                (option, NBD_REP_ERR_TLS_REQD),
                "option {option}"
            );
        }
        send_option(&mut stream, NBD_OPT_STARTTLS, &[]);
        let reply = read_option_reply(&mut stream);
        assert_eq!(reply.reply_type, NBD_REP_ACK, "STARTTLS is acknowledged");
        drop(stream);

        // EXPORT_NAME cannot be refused with an error: the server closes.
        let mut stream = connect(server.nbd);
        greet(&mut stream);
        send_option(&mut stream, NBD_OPT_EXPORT_NAME, b"v");
        let mut byte = [0u8; 1];
        let closed = matches!(std::io::Read::read(&mut stream, &mut byte), Ok(0) | Err(_));
        assert!(closed, "EXPORT_NAME before TLS must close the connection");

        // With TLS, both clients get in.
        let query = format!("tls-certificates={}", certs.client.display());
        let out = nbdinfo(&nbds(&server, "v", None, &query));
        assert!(out.status.success(), "nbdinfo x509: {}", text(&out));
        let object = format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            certs.client.display()
        );
        let out = qemu_img(&["info"], &object, &server, "v");
        assert!(out.status.success(), "qemu-img x509: {}", text(&out));
        server.stop();
    }

    /// The export names `nbdinfo --list` finds at `uri`, sorted.
    fn listed(uri: &str) -> Vec<String> {
        let out = Command::new("timeout")
            .args(["60", "nbdinfo", "--list", "--json", uri])
            .output()
            .unwrap();
        assert!(out.status.success(), "nbdinfo --list {uri}: {}", text(&out));
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut names: Vec<String> = json["exports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|export| export["export-name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        names
    }

    /// (status, stdout, stderr) of a client run, to compare two runs exactly.
    fn outcome(out: &Output) -> (Option<i32>, String, String) {
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn psk_tenants_list_and_open_only_their_own_volumes() {
        if !tools() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // One file for the server and both clients (a client takes its identity's line).
        let psk = psk_dir(root, "psk", &format!("alice:{KEY_A}\nbob:{KEY_B}"));
        let keys = psk.join("keys.psk");
        // SELECTIVETLS: plaintext clients are served too.
        let server = tls_server(
            &root.join("mem"),
            &["--tls-psk-file", keys.to_str().unwrap()],
        );
        server.create_tenant("alice");
        server.create_volume_with("a1", "16MiB", &["--tenant", "alice"]);
        server.create_volume_with("a2", "8MiB", &["--tenant", "alice"]);
        server.create_tenant("bob");
        server.create_volume_with("b1", "16MiB", &["--tenant", "bob", "--read-only"]);
        server.create_volume("shared", "8MiB");
        let query = format!("tls-psk-file={}", keys.display());
        let as_user = |user: &str, export: &str| nbds(&server, export, Some(user), &query);
        let object = |user: &str| {
            format!(
                "tls-creds-psk,id=tls0,endpoint=client,dir={},username={user}",
                psk.display()
            )
        };

        // NBD_OPT_LIST (and the INFO nbdinfo sends for each name): own volumes only.
        assert_eq!(listed(&as_user("alice", "")), ["a1", "a2"]);
        assert_eq!(listed(&as_user("bob", "")), ["b1"]);
        assert_eq!(listed(&server.uri("")), ["shared"], "plaintext");

        // Each tenant opens its own; bob's is read-only.
        let source = root.join("source.raw");
        random_file(&source, 1 << 20, 5);
        let out = qemu_img_convert_in(&source, &object("alice"), &server, "a1");
        assert!(out.status.success(), "alice writes a1: {}", text(&out));
        let out = qemu_img_convert_in(&source, &object("bob"), &server, "b1");
        assert!(
            !out.status.success(),
            "bob wrote to his read-only volume: {}",
            text(&out)
        );
        let out = Command::new("timeout")
            .args(["60", "nbdinfo", "--json", &as_user("bob", "b1")])
            .output()
            .unwrap();
        assert!(out.status.success(), "bob opens b1: {}", text(&out));
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["exports"][0]["is_read_only"], Value::Bool(true));

        // Another tenant's volume, and one without a tenant, fail for alice (NBD_OPT_GO from
        // nbdinfo and qemu-img) and bob exactly as they do once no volume has the name.
        let probe = || {
            let mut seen = Vec::new();
            for export in ["b1", "shared"] {
                seen.push(outcome(&nbdinfo(&as_user("alice", export))));
                seen.push(outcome(&qemu_img(
                    &["info"],
                    &object("alice"),
                    &server,
                    export,
                )));
            }
            seen.push(outcome(&nbdinfo(&as_user("bob", "a2"))));
            seen
        };
        let foreign = probe();
        for (status, _, stderr) in &foreign {
            assert_ne!(
                *status,
                Some(0),
                "a tenant opened a volume not its own: {stderr}"
            );
        }
        for name in ["b1", "shared", "a2"] {
            let out = server.cli(&["volume", "delete", name]);
            assert!(out.status.success(), "{}", text(&out));
        }
        assert_eq!(
            foreign,
            probe(),
            "foreign volumes look exactly like missing ones"
        );
        server.stop();
    }

    #[test]
    fn certificates_act_for_the_tenant_their_cn_is_mapped_to_and_anonymous_tls_sees_only_volumes_without_one()
     {
        if !tools() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let certs = make_certs(root);
        // Verifying client certificates without saying which tenant each acts for is refused
        // at start, naming the fix.
        let err = start_fails(
            &root.join("mem0"),
            &[
                "--memory",
                "1GiB",
                "--tls-cert-dir",
                certs.server.to_str().unwrap(),
            ],
        );
        assert!(
            err.contains("certificate_tenants") && err.contains("--tls-cert-tenant CN=TENANT"),
            "{err}"
        );
        let mut flags = vec![
            "--tls-cert-dir",
            certs.server.to_str().unwrap(),
            "--tls-required",
        ];
        flags.extend_from_slice(&CERT_TENANTS);
        let server = tls_server(&root.join("mem"), &flags);
        server.create_tenant("tenant-a");
        server.create_volume_with("ta", "16MiB", &["--tenant", "tenant-a"]);
        server.create_tenant("tenant-b");
        server.create_volume_with("tb", "16MiB", &["--tenant", "tenant-b"]);
        server.create_volume("shared", "16MiB");
        let query = format!("tls-certificates={}", certs.client.display());
        assert_eq!(listed(&nbds(&server, "", None, &query)), ["ta"]);
        let out = nbdinfo(&nbds(&server, "tb", None, &query));
        assert!(
            !out.status.success(),
            "CN tenant-a opened tb: {}",
            text(&out)
        );
        let object = format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            certs.client.display()
        );
        let out = qemu_img(&["info"], &object, &server, "shared");
        assert!(
            !out.status.success(),
            "CN tenant-a opened a volume without a tenant: {}",
            text(&out)
        );
        let out = qemu_img(&["info"], &object, &server, "ta");
        assert!(out.status.success(), "CN tenant-a opens ta: {}", text(&out));
        // The map, not the name: host-b.example acts for tenant-b; a certificate whose CN is
        // `tenant-b` but is not in the map, and a revoked one (ca-crl.pem), get no session.
        let query = format!("tls-certificates={}", certs.hostb.display());
        assert_eq!(listed(&nbds(&server, "", None, &query)), ["tb"]);
        for refused in [&certs.unmapped, &certs.revoked] {
            let query = format!("tls-certificates={}", refused.display());
            let out = nbdinfo(&nbds(&server, "tb", None, &query));
            assert!(
                !out.status.success(),
                "{} opened tb: {}",
                refused.display(),
                text(&out)
            );
        }
        let log = server.log();
        assert!(
            log.contains("its CN is not in [tls] certificate_tenants") && log.contains("tenant-b"),
            "the unmapped CN is logged: {log}"
        );
        assert!(
            log.contains("revoked"),
            "the revoked certificate is logged: {log}"
        );
        server.stop();

        // Without ca-cert.pem the server asks for no client certificate: every TLS client is
        // anonymous (even one holding a certificate) and sees the volumes without a tenant,
        // with --tls-required too.
        let noca = root.join("server-noca");
        std::fs::create_dir_all(&noca).unwrap();
        for file in ["server-cert.pem", "server-key.pem"] {
            std::fs::copy(certs.server.join(file), noca.join(file)).unwrap();
        }
        let server = tls_server(
            &root.join("mem2"),
            &["--tls-cert-dir", noca.to_str().unwrap(), "--tls-required"],
        );
        server.create_tenant("tenant-a");
        server.create_volume_with("ta", "16MiB", &["--tenant", "tenant-a"]);
        server.create_volume("shared", "16MiB");
        for client in [&certs.nocert, &certs.client] {
            let query = format!("tls-certificates={}", client.display());
            assert_eq!(
                listed(&nbds(&server, "", None, &query)),
                ["shared"],
                "{}",
                client.display()
            );
        }
        assert!(
            server.log().contains("peer Anonymous"),
            "the sessions were anonymous"
        );
        server.stop();
    }
}
