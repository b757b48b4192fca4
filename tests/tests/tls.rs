//! TLS to the database, against PostgreSQL servers of the test's own: a URL that asks for it connects
//! through rustls and checks the server's certificate, and every connection the outbox opens (the pool's,
//! the heartbeat's, the wake-up listener's) is encrypted; a certificate no trusted CA signed, or a server
//! without TLS, is a connect error that retrying will not mend.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{Sink, TestDb, commit, count, recording, start, wait_for};
use outbox_core::{Db, Error, NewRecord};
use outbox_tests::postgres::PgCluster;
use outbox_tests::tls::Certificates;

const LONG: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_url_that_asks_for_tls_gets_it_on_every_connection() {
    let certificates = Certificates::new();
    let settings = certificates.postgres_settings();
    let server = PgCluster::start(&settings.iter().map(|(name, value)| (*name, value.as_str())).collect::<Vec<_>>());
    server.create_database("outbox_tls").await;
    let url = server.url("outbox_tls");
    let verified = format!("{url}?sslmode=verify-full&sslrootcert={}", certificates.ca().display());

    let db = Db::connect(&verified).await.unwrap();
    let Db::Postgres(pool) = &db else { unreachable!("a PostgreSQL URL") };
    let db = TestDb::postgres(pool.clone());
    let outbox = common::outbox(&db, |_| {}).await;
    let sink = Sink::new();
    let node = start(&outbox, &db, recording(&sink)).await;
    let listening =
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'";
    wait_for("the processor listening", LONG, || async { count(&db, listening).await == 1 }).await;
    commit(&outbox, &db, (1..=3).map(|i| NewRecord::new("k", "t", i.to_string())).collect()).await;
    wait_for("the records delivered", LONG, || async { sink.len() == 3 }).await;
    assert_eq!(sink.seqs_of("k").len(), 3);
    let connections = "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
        WHERE a.datname = current_database()";
    let plain = format!("{connections} AND NOT s.ssl");
    // The pool's connections, the heartbeat's and the listener's.
    assert!(count(&db, connections).await >= 3, "the node's connections");
    assert_eq!(count(&db, &plain).await, 0, "connections without TLS");
    node.shutdown().await.unwrap();

    // The machine's own CAs do not know the test's: the certificate is refused, for good.
    let err = Db::connect(&format!("{url}?sslmode=verify-full")).await.unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    assert!(!err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("certificate"), "{err}");

    // A server without TLS, asked for it.
    let plain_server = PgCluster::start(&[]);
    let err = Db::connect(&format!("{}?sslmode=require", plain_server.url("postgres"))).await.unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    assert!(!err.is_transient(), "{err:?}");
    assert!(err.to_string().contains("TLS"), "{err}");
}
