//! The bench's MySQL side (the only bench file naming it): a fresh database on the `MYSQL_URL` server.

use outbox_core::{ConnectOptions, Db};

use crate::Failure;

const DATABASE: &str = "outbox_bench";

/// The `outbox_bench` database on the `MYSQL_URL` server (`./scripts/bench.sh` starts MariaDB on
/// loopback), created anew.
pub async fn database() -> Result<Db, Failure> {
    let server = std::env::var("MYSQL_URL")
        .map_err(|_| Failure("bench: the mysql scenarios need MYSQL_URL (./scripts/bench.sh sets it)".into()))?;
    let admin = Db::connect(&server).await?;
    let create = format!("DROP DATABASE IF EXISTS {DATABASE}; CREATE DATABASE {DATABASE}");
    admin.execute_script(sqlx::AssertSqlSafe(create)).await?;
    admin.close().await;
    let options = ConnectOptions { max_connections: 16, ..ConnectOptions::default() };
    Ok(Db::connect_with(&format!("{server}/{DATABASE}"), &options).await?)
}
