//! Option haggling against a node started in this process (`tests/common`), driven option by
//! option with `headroom_nbd`'s encoders and decoders (`common::Haggle`), so every answer the
//! session gives before transmission is asserted to the reply type: the refusals the lab's
//! client only sees as "GO failed", the options it never sends, and the ways negotiation ends.

#![allow(clippy::unwrap_used)] // helpers too: a failed decode is a failed test

mod common;

use common::Haggle;
use headroom_nbd::consts::{
    NBD_FLAG_READ_ONLY, NBD_FLAG_SEND_DF, NBD_FLAG_SEND_TRIM, NBD_INFO_BLOCK_SIZE,
    NBD_INFO_DESCRIPTION, NBD_INFO_EXPORT, NBD_INFO_NAME, NBD_OPT_EXPORT_NAME, NBD_OPT_GO,
    NBD_OPT_INFO, NBD_OPT_LIST, NBD_REP_ACK, NBD_REP_ERR_INVALID, NBD_REP_ERR_TOO_BIG,
    NBD_REP_ERR_UNKNOWN, NBD_REP_ERR_UNSUP, NBD_REP_INFO, NBD_REP_META_CONTEXT, NBD_REP_SERVER,
};
use headroom_nbd::{ClientOption, InfoRequest, MetaContextRequest};

fn info(name: &str, info_types: &[u16]) -> InfoRequest {
    InfoRequest {
        export_name: name.to_string(),
        info_types: info_types.to_vec(),
    }
}

fn meta(name: &str, queries: &[&str]) -> MetaContextRequest {
    MetaContextRequest {
        export_name: name.to_string(),
        queries: queries.iter().map(|q| (*q).to_string()).collect(),
    }
}

/// The name of an `NBD_REP_SERVER` reply (u32 length, name, description).
fn server_name(reply: &common::OptionReply) -> String {
    let len = u32::from_be_bytes(reply.data[0..4].try_into().unwrap()) as usize;
    String::from_utf8(reply.data[4..4 + len].to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_on_an_unknown_export_is_err_unknown_and_haggling_goes_on() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    let replies = haggle
        .ask(&ClientOption::Go(info("no-such-volume", &[])))
        .await;
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_UNKNOWN);
    assert_eq!(replies[0].header.option, NBD_OPT_GO);
    // The same connection may go on and enter transmission on a real name.
    let (mut client, _) = haggle.go("v").await;
    assert_eq!(client.write(0, &[3u8; 512]).await, 0);
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_names_only_the_volumes_without_a_tenant() {
    let node = common::start(common::config()).await;
    node.create_volume("pub-a", 1 << 20, None).expect("volume");
    node.create_volume("pub-b", 2 << 20, None).expect("volume");
    node.store().create_tenant("alice").expect("tenant");
    let options = headroom_store::NewVolume {
        tenant: Some("alice".to_string()),
        ..headroom_store::NewVolume::default()
    };
    node.store()
        .create_volume_with("alices", 1 << 20, options)
        .expect("volume");
    let mut haggle = Haggle::open(&node).await;
    let replies = haggle.ask(&ClientOption::List).await;
    let (last, servers) = replies.split_last().unwrap();
    assert_eq!(last.reply_type(), NBD_REP_ACK);
    assert!(servers.iter().all(|r| r.reply_type() == NBD_REP_SERVER));
    let mut names: Vec<String> = servers.iter().map(server_name).collect();
    names.sort();
    assert_eq!(names, ["pub-a", "pub-b"], "a tenant's volume was listed");
    assert!(replies.iter().all(|r| r.header.option == NBD_OPT_LIST));
    drop(haggle);
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_gives_size_flags_name_description_and_block_sizes_and_stays_in_haggling() {
    let node = common::start(common::config()).await;
    let options = headroom_store::NewVolume {
        read_only: true,
        ..headroom_store::NewVolume::default()
    };
    node.store()
        .create_volume_with("ro", 3 << 20, options)
        .expect("volume");
    node.create_volume("rw", 1 << 20, None).expect("volume");
    let mut haggle = Haggle::open(&node).await;
    let replies = haggle
        .ask(&ClientOption::Info(info(
            "ro",
            &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION],
        )))
        .await;
    assert_eq!(replies.last().unwrap().reply_type(), NBD_REP_ACK);
    assert!(replies.iter().all(|r| r.header.option == NBD_OPT_INFO));
    let infos: Vec<&common::OptionReply> = replies
        .iter()
        .filter(|r| r.reply_type() == NBD_REP_INFO)
        .collect();
    let of = |kind: u16| {
        infos
            .iter()
            .find(|r| r.info_type() == kind)
            .unwrap_or_else(|| panic!("no NBD_INFO {kind}: {replies:?}"))
    };
    let export = of(NBD_INFO_EXPORT);
    assert_eq!(
        u64::from_be_bytes(export.data[2..10].try_into().unwrap()),
        3 << 20
    );
    let flags = u16::from_be_bytes([export.data[10], export.data[11]]);
    assert_ne!(
        flags & NBD_FLAG_READ_ONLY,
        0,
        "read-only volume, flags {flags:#06x}"
    );
    assert_eq!(
        flags & NBD_FLAG_SEND_TRIM,
        0,
        "TRIM offered on a read-only volume"
    );
    assert_eq!(&of(NBD_INFO_NAME).data[2..], b"ro");
    assert!(!of(NBD_INFO_DESCRIPTION).data[2..].is_empty());
    let block = &of(NBD_INFO_BLOCK_SIZE).data;
    let be = |at: usize| u32::from_be_bytes(block[at..at + 4].try_into().unwrap());
    assert_eq!(
        (be(2), be(6), be(10)),
        (
            headroom_nbd::MIN_BLOCK_BYTES,
            headroom_nbd::PREFERRED_BLOCK_BYTES,
            common::config().limits.max_request_bytes
        )
    );

    // INFO does not enter transmission: the writable volume is described on the same socket.
    let replies = haggle.ask(&ClientOption::Info(info("rw", &[]))).await;
    let export = replies
        .iter()
        .find(|r| r.reply_type() == NBD_REP_INFO && r.info_type() == NBD_INFO_EXPORT)
        .expect("NBD_INFO_EXPORT");
    let flags = u16::from_be_bytes([export.data[10], export.data[11]]);
    assert_eq!(flags & NBD_FLAG_READ_ONLY, 0);
    assert_ne!(flags & NBD_FLAG_SEND_TRIM, 0);
    let (client, flags) = haggle.go("ro").await;
    assert!(client.read_only);
    assert_ne!(flags & NBD_FLAG_READ_ONLY, 0);
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_replies_are_acked_once_then_go_advertises_df() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    let replies = haggle.ask(&ClientOption::StructuredReply).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type(), NBD_REP_ACK);
    assert!(replies[0].data.is_empty());
    // A second time is invalid, and changes nothing.
    let replies = haggle.ask(&ClientOption::StructuredReply).await;
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_INVALID);
    let (mut client, flags) = haggle.go("v").await;
    assert_ne!(flags & NBD_FLAG_SEND_DF, 0, "DF needs structured replies");
    // The session answers in chunks: a write is one NONE chunk flagged done.
    let chunks = client
        .request_chunks(
            common::Req::new(headroom_nbd::consts::NBD_CMD_WRITE, 0, 512),
            &[9u8; 512],
        )
        .await;
    assert_eq!(chunks.len(), 1);
    assert_eq!(
        chunks[0].header.chunk_type,
        headroom_nbd::consts::NBD_REPLY_TYPE_NONE
    );
    client.disconnect().await;

    // Without structured replies, GO does not advertise DF.
    let (client, flags) = Haggle::open(&node).await.go("v").await;
    assert_eq!(flags & NBD_FLAG_SEND_DF, 0);
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_meta_context_selects_base_allocation_and_only_it() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    // Before structured replies: invalid.
    let replies = haggle
        .ask(&ClientOption::SetMetaContext(meta(
            "v",
            &["base:allocation"],
        )))
        .await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_INVALID);
    let replies = haggle.ask(&ClientOption::StructuredReply).await;
    assert_eq!(replies[0].reply_type(), NBD_REP_ACK);

    // An unknown namespace selects nothing: just the ACK.
    let replies = haggle
        .ask(&ClientOption::SetMetaContext(meta(
            "v",
            &["qemu:dirty-bitmap:x"],
        )))
        .await;
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].reply_type(), NBD_REP_ACK);
    // For an export the session cannot see: unknown.
    let replies = haggle
        .ask(&ClientOption::SetMetaContext(meta(
            "nope",
            &["base:allocation"],
        )))
        .await;
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_UNKNOWN);

    let replies = haggle
        .ask(&ClientOption::SetMetaContext(meta(
            "v",
            &["base:allocation"],
        )))
        .await;
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_eq!(replies[0].reply_type(), NBD_REP_META_CONTEXT);
    let id = u32::from_be_bytes(replies[0].data[0..4].try_into().unwrap());
    assert_eq!(id, headroom_nbd::BASE_ALLOCATION_CONTEXT_ID);
    assert_eq!(
        &replies[0].data[4..],
        headroom_nbd::BASE_ALLOCATION.as_bytes()
    );
    assert_eq!(replies[1].reply_type(), NBD_REP_ACK);

    // LIST_META_CONTEXT with no query lists what there is, and selects nothing.
    let replies = haggle
        .ask(&ClientOption::ListMetaContext(meta("v", &[])))
        .await;
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_eq!(
        &replies[0].data[4..],
        headroom_nbd::BASE_ALLOCATION.as_bytes()
    );

    // The selection holds in transmission: BLOCK_STATUS is answered with that context.
    let (mut client, _) = haggle.go("v").await;
    let chunks = client
        .request_chunks(
            common::Req::new(headroom_nbd::consts::NBD_CMD_BLOCK_STATUS, 0, 4096),
            &[],
        )
        .await;
    let (context, descriptors) = chunks[0].block_status();
    assert_eq!(context, id);
    assert!(!descriptors.is_empty());
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_options_and_extended_headers_are_err_unsup() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    // An unknown option with data: the data is read past, the next option parses.
    haggle.send_raw(0x4242, 5, b"hello").await;
    let replies = haggle.replies(0x4242).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_UNSUP);
    // The withdrawn PEEK_EXPORT is unknown too.
    let peek = headroom_nbd::consts::NBD_OPT_PEEK_EXPORT;
    haggle.send_raw(peek, 0, &[]).await;
    assert_eq!(
        haggle.replies(peek).await[0].reply_type(),
        NBD_REP_ERR_UNSUP
    );
    let replies = haggle.ask(&ClientOption::ExtendedHeaders).await;
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_UNSUP);
    // LIST with data is invalid (it takes none).
    haggle.send_raw(NBD_OPT_LIST, 3, b"abc").await;
    assert_eq!(
        haggle.replies(NBD_OPT_LIST).await[0].reply_type(),
        NBD_REP_ERR_INVALID
    );
    let (client, _) = haggle.go("v").await;
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_option_too_large_to_read_is_discarded_and_refused_one_too_large_to_discard_closes() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    // Known option, over the read bound but within the discard bound: TOO_BIG, go on.
    let length = headroom_nbd::MAX_OPTION_LENGTH + 1;
    let data = vec![0u8; length as usize];
    haggle.send_raw(NBD_OPT_GO, length, &data).await;
    let replies = haggle.replies(NBD_OPT_GO).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_TOO_BIG);
    // Unknown option of the same size: UNSUP.
    haggle.send_raw(0x7777, length, &data).await;
    assert_eq!(
        haggle.replies(0x7777).await[0].reply_type(),
        NBD_REP_ERR_UNSUP
    );
    let (client, _) = haggle.go("v").await;
    client.disconnect().await;

    // Over the discard bound: TOO_BIG said, then closed without reading the data.
    let mut haggle = Haggle::open(&node).await;
    haggle
        .send_raw(
            NBD_OPT_INFO,
            headroom_nbd::MAX_OPTION_DISCARD_BYTES + 1,
            &[],
        )
        .await;
    let reply = haggle.reply().await;
    assert_eq!(reply.reply_type(), NBD_REP_ERR_TOO_BIG);
    assert!(haggle.closes().await, "the connection stayed open");

    // EXPORT_NAME over the read bound has no error reply: closed at once.
    let mut haggle = Haggle::open(&node).await;
    haggle
        .send_raw(
            NBD_OPT_EXPORT_NAME,
            headroom_nbd::MAX_OPTION_LENGTH + 1,
            &[],
        )
        .await;
    let mut stream = haggle.stream;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(
        common::GUARD,
        tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut buf),
    )
    .await
    .expect("the server closes");
    assert!(
        read.is_err() || buf.is_empty(),
        "bytes before the close: {buf:?}"
    );
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_is_acked_and_the_server_closes() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    let replies = haggle.ask(&ClientOption::Abort).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type(), NBD_REP_ACK);
    assert!(
        haggle.closes().await,
        "the connection stayed open after ABORT"
    );
    // The node goes on serving.
    let client = common::connect(&node, "v").await.expect("served");
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starttls_without_tls_configured_is_err_unsup_and_plaintext_goes_on() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    let replies = haggle.ask(&ClientOption::StartTls).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type(), NBD_REP_ERR_UNSUP);
    let (mut client, _) = haggle.go("v").await;
    assert_eq!(client.read(0, 512).await, (0, vec![0u8; 512]));
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_of_an_unknown_name_closes_and_of_a_known_one_enters_transmission() {
    let node = common::start_with_volume("v", 2 << 20).await;
    let mut haggle = Haggle::open(&node).await;
    haggle
        .send(&ClientOption::ExportName("no-such-volume".to_string()))
        .await;
    let mut stream = haggle.stream;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(
        common::GUARD,
        tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut buf),
    )
    .await
    .expect("the server closes");
    assert!(read.is_err() || buf.is_empty(), "an answer: {buf:?}");

    // A known name: size and flags, no padding (NO_ZEROES was sent), then transmission.
    let mut haggle = Haggle::open(&node).await;
    haggle
        .send(&ClientOption::ExportName("v".to_string()))
        .await;
    let mut reply = [0u8; 10];
    tokio::io::AsyncReadExt::read_exact(&mut haggle.stream, &mut reply)
        .await
        .expect("the EXPORT_NAME reply");
    assert_eq!(u64::from_be_bytes(reply[0..8].try_into().unwrap()), 2 << 20);
    let flags = u16::from_be_bytes([reply[8], reply[9]]);
    assert_eq!(flags, headroom_nbd::transmission_flags(false, false));
    let mut out = Vec::new();
    headroom_nbd::encode_request_header(
        &mut out,
        &headroom_nbd::RequestHeader {
            flags: 0,
            command: headroom_nbd::consts::NBD_CMD_FLUSH,
            cookie: 77,
            offset: 0,
            length: 0,
        },
    );
    tokio::io::AsyncWriteExt::write_all(&mut haggle.stream, &out)
        .await
        .unwrap();
    let mut header = [0u8; headroom_nbd::consts::SIMPLE_REPLY_HEADER_LEN];
    tokio::io::AsyncReadExt::read_exact(&mut haggle.stream, &mut header)
        .await
        .unwrap();
    let reply = headroom_nbd::decode_simple_reply_header(&header).unwrap();
    assert_eq!((reply.cookie, reply.error), (77, 0));
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_without_no_zeroes_pads_the_reply_with_124_zero_bytes() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let flags = headroom_nbd::ClientFlags {
        fixed_newstyle: true,
        no_zeroes: false,
    };
    let mut haggle = Haggle::open_with_flags(&node, flags.to_raw()).await;
    haggle
        .send(&ClientOption::ExportName("v".to_string()))
        .await;
    let padding = headroom_nbd::consts::EXPORT_NAME_REPLY_PADDING_BYTES;
    let mut reply = vec![0xffu8; 10 + padding];
    tokio::io::AsyncReadExt::read_exact(&mut haggle.stream, &mut reply)
        .await
        .expect("the padded reply");
    assert_eq!(u64::from_be_bytes(reply[0..8].try_into().unwrap()), 1 << 20);
    assert!(reply[10..].iter().all(|&b| b == 0));
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_client_flags_close_the_connection() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let haggle = Haggle::open_with_flags(&node, 1 << 7).await;
    assert!(haggle.closes().await, "unknown client flags were accepted");
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_nothing_is_closed_at_the_handshake_deadline() {
    let mut config = common::config();
    config.limits.handshake_timeout_ms = 150;
    let node = common::start(config).await;
    node.create_volume("v", 1 << 20, None).expect("volume");
    // Greeted, then silent: not even the client flags.
    let silent = Haggle::greeted(&node).await;
    // Flags sent, then silent in the middle of haggling (half an option header).
    let mut halfway = Haggle::open(&node).await;
    halfway.send_raw(NBD_OPT_GO, 100, &[]).await;
    assert!(silent.closes().await, "a silent client was kept");
    assert!(halfway.closes().await, "a stalled negotiation was kept");
    // The deadline is negotiation's only: a session in transmission outlives it.
    let mut client = common::connect(&node, "v").await.expect("served");
    let parked = common::connect(&node, "v").await.expect("served");
    assert!(
        common::eventually(|| node.api_state().connections.view().evicted_total == 0
            && node.api_state().connections.view().open == 2)
        .await
    );
    let silent = Haggle::greeted(&node).await;
    assert!(silent.closes().await);
    assert_eq!(client.write(0, &[1u8; 512]).await, 0);
    parked.disconnect().await;
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}
