//! Negotiation and transmission tested against a node started in this process
//! (`tests/common`: `Node::start` on an in-memory store, the lab's NBD client over loopback).
//! Each test starts its own node and stops it; together they run in well under a second.

mod common;

use headroom_nbd::consts::{NBD_CMD_FLUSH, NBD_CMD_READ};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_is_offered_with_its_size_and_written_data_reads_back() {
    let node = common::start_with_volume("v", 4 << 20).await;
    let mut client = common::connect(&node, "v")
        .await
        .expect("the export is offered");
    assert_eq!(client.size_bytes, 4 << 20);
    assert!(!client.read_only);

    let data: Vec<u8> = (0..64 << 10).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(client.write(1 << 20, &data).await, 0);
    let (error, back) = client.read(1 << 20, 64 << 10).await;
    assert_eq!(error, 0);
    assert!(
        back == data,
        "the data read back differs from the data written"
    );
    // Never written: zeros.
    let (error, zeros) = client.read(3 << 20, 4096).await;
    assert_eq!(error, 0);
    assert!(zeros.iter().all(|&b| b == 0));
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_no_volume_has_is_refused_in_negotiation() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let refused = common::connect(&node, "no-such-volume").await;
    assert!(refused.is_err(), "an unknown export was offered");
    // The refusal does not end the node's service: the real name still works.
    let client = common::connect(&node, "v")
        .await
        .expect("the export is offered");
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_the_end_gets_einval_and_the_session_goes_on() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut client = common::connect(&node, "v")
        .await
        .expect("the export is offered");
    let (error, _) = client
        .request(NBD_CMD_READ, 0, (1 << 20) - 512, 4096, &[])
        .await;
    assert_eq!(error, headroom_nbd::consts::NBD_EINVAL, "past the end");
    assert_eq!(
        client.write(0, &[1u8; 4096]).await,
        0,
        "the session goes on"
    );
    let (error, _) = client.request(NBD_CMD_FLUSH, 0, 0, 0, &[]).await;
    assert_eq!(error, 0, "FLUSH");
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_acknowledged_over_nbd_is_in_the_store_the_node_holds() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let mut client = common::connect(&node, "v")
        .await
        .expect("the export is offered");
    assert_eq!(client.write(8192, &[0xAB; 4096]).await, 0);
    // Read through the node's own store handle, not the protocol.
    let volume = node.store().open_volume("v").expect("the volume");
    let mut buf = vec![0u8; 4096];
    volume.read_at(8192, &mut buf).expect("a store read");
    assert!(buf.iter().all(|&b| b == 0xAB));
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_out_of_range_is_refused_before_anything_listens() {
    let mut config = common::config();
    config.io_threads = 100_000;
    let refused = headroom_node::server::Node::start(config).await;
    let Err(err) = refused else {
        panic!("a node started with io_threads = 100000");
    };
    assert!(err.to_string().contains("server.io_threads"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_volume_is_offered_read_only_and_refuses_writes_with_eperm() {
    let node = common::start(common::config()).await;
    let options = headroom_store::NewVolume {
        read_only: true,
        ..headroom_store::NewVolume::default()
    };
    node.store()
        .create_volume_with("ro", 1 << 20, options)
        .expect("the volume");
    let mut client = common::connect(&node, "ro")
        .await
        .expect("the export is offered");
    assert!(client.read_only, "the export's flags do not say read-only");
    assert_eq!(
        client.write(0, &[1u8; 4096]).await,
        headroom_nbd::consts::NBD_EPERM
    );
    let (error, data) = client.read(0, 4096).await;
    assert_eq!(error, 0, "reads are served");
    assert!(
        data.iter().all(|&b| b == 0),
        "the refused write changed the volume"
    );
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_volume_is_answered_to_an_anonymous_client_as_a_name_no_volume_has() {
    let node = common::start(common::config()).await;
    node.store().create_tenant("alice").expect("the tenant");
    let options = headroom_store::NewVolume {
        tenant: Some("alice".to_string()),
        ..headroom_store::NewVolume::default()
    };
    node.store()
        .create_volume_with("alices", 1 << 20, options)
        .expect("the volume");
    node.create_volume("public", 1 << 20, None)
        .expect("the volume");
    let hidden = common::connect(&node, "alices").await;
    let unknown = common::connect(&node, "nobody-has-this").await;
    let (Err(hidden), Err(unknown)) = (hidden, unknown) else {
        panic!("a plaintext client was offered a tenant's volume or an unknown name");
    };
    // The same answer: nothing tells an outsider that the name exists.
    assert_eq!(
        hidden.to_string().replace("alices", "NAME"),
        unknown.to_string().replace("nobody-has-this", "NAME")
    );
    let client = common::connect(&node, "public")
        .await
        .expect("the export is offered");
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}
