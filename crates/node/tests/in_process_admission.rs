//! Admission on a node started in this process (`tests/common`): the connection cap.

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_with_every_connection_transmitting_a_new_one_is_closed() {
    let mut config = common::config();
    config.limits.max_connections = 2;
    config.limits.max_connections_per_ip = 2;
    let node = common::start(config).await;
    node.create_volume("v", 1 << 20, None).expect("the volume");
    let mut first = common::connect(&node, "v").await.expect("first");
    let mut second = common::connect(&node, "v").await.expect("second");
    assert!(
        common::connect(&node, "v").await.is_err(),
        "a third connection was served with two transmitting and a cap of two"
    );
    // The two admitted ones are unaffected.
    assert_eq!(first.write(0, &[7u8; 512]).await, 0);
    assert_eq!(second.read(0, 512).await, (0, vec![7u8; 512]));
    first.disconnect().await;
    // (Whether the freed slot serves a new client at once is not asserted: the slot is given
    // back when the session's task ends, just after the client sees the socket close.)
    second.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}
