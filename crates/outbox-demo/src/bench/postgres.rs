//! The bench's PostgreSQL side (the only bench file naming it): the database the outbox scenarios run
//! on by default, the idealised relay's statements, and the statistics the cost figures come from.

use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use super::SCHEMA;
use crate::Failure;

/// The bench's PostgreSQL database.
pub struct Postgres {
    pool: PgPool,
}

impl Postgres {
    pub async fn connect(url: &str) -> Result<Postgres, Failure> {
        if !url.starts_with("postgres") {
            return Err(Failure(
                "bench measures PostgreSQL and NATS JetStream: set DATABASE_URL=postgres://… and NATS_URL (./scripts/bench.sh does)"
                    .into(),
            ));
        }
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(16).connect(url).await.map_err(pg)?;
        Ok(Postgres { pool })
    }

    /// The database as the outbox takes it.
    pub fn db(&self) -> outbox_core::Db {
        outbox_core::Db::from(&self.pool)
    }

    /// Empties the bench outbox's tables at once (and its per-key lock rows), leaving no dead rows behind
    /// for the next scenario.
    pub async fn truncate(&self) -> Result<(), Failure> {
        let tables = ["records", "completed", "instances", "keys"].map(|t| format!("{SCHEMA}.{t}")).join(", ");
        let reset = format!("TRUNCATE {tables}; UPDATE {SCHEMA}.partitions SET owner = NULL, target_owner = NULL");
        sqlx::raw_sql(AssertSqlSafe(reset)).execute(&self.pool).await.map_err(pg)?;
        Ok(())
    }

    /// Rows inserted, updated and deleted in the bench schema so far, as counted by the statistics of
    /// backends that have exited (callers close the pools that wrote first).
    pub async fn rows_written(&self) -> Result<i64, Failure> {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let n: Option<i64> = sqlx::query_scalar(
            "SELECT sum(n_tup_ins + n_tup_upd + n_tup_del)::bigint FROM pg_stat_user_tables WHERE schemaname = $1",
        )
        .bind(SCHEMA)
        .fetch_one(&self.pool)
        .await
        .map_err(pg)?;
        Ok(n.unwrap_or(0))
    }

    /// Transactions committed and rolled back in the database so far.
    pub async fn transactions(&self) -> Result<i64, Failure> {
        sqlx::query_scalar(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(pg)
    }

    /// Holds the backlog back: moves it into a table of its own, so workers can start and settle on an
    /// empty outbox before the clock.
    pub async fn hold_backlog(&self) -> Result<(), Failure> {
        let hold = format!(
            "DROP TABLE IF EXISTS {SCHEMA}.held; CREATE TABLE {SCHEMA}.held AS SELECT * FROM {SCHEMA}.records;
             TRUNCATE {SCHEMA}.records"
        );
        sqlx::raw_sql(AssertSqlSafe(hold)).execute(&self.pool).await.map_err(pg)?;
        Ok(())
    }

    /// Puts the held backlog back in one transaction, with fresh table statistics (as autovacuum would
    /// have gathered while it grew), so it appears to the workers all at once at the commit.
    pub async fn release_backlog(&self) -> Result<(), Failure> {
        let release = format!(
            "BEGIN; INSERT INTO {SCHEMA}.records SELECT * FROM {SCHEMA}.held; ANALYZE {SCHEMA}.records; COMMIT;
             DROP TABLE {SCHEMA}.held"
        );
        sqlx::raw_sql(AssertSqlSafe(release)).execute(&self.pool).await.map_err(pg)?;
        Ok(())
    }

    /// The process id of one of the server's backends: the CPU meter finds the postmaster from it.
    pub async fn backend_pid(&self) -> Result<i32, Failure> {
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&self.pool).await.map_err(pg)
    }

    /// (distinct owners, partitions without an owner or with a handover pending).
    pub async fn ownership(&self) -> Result<(i64, i64), Failure> {
        let query = format!(
            "SELECT count(DISTINCT owner), count(*) FILTER (WHERE owner IS NULL OR target_owner IS DISTINCT FROM owner)
             FROM {SCHEMA}.partitions"
        );
        sqlx::query_as(AssertSqlSafe(query)).fetch_one(&self.pool).await.map_err(pg)
    }

    /// A fresh, empty table of the records' shape (columns, constraints, indexes): the producer's
    /// yardstick writes into it.
    pub async fn plain_table(&self) -> Result<String, Failure> {
        let sql = format!(
            "DROP TABLE IF EXISTS {SCHEMA}.plain; CREATE TABLE {SCHEMA}.plain (LIKE {SCHEMA}.records INCLUDING ALL)"
        );
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(&self.pool).await.map_err(pg)?;
        Ok(format!("{SCHEMA}.plain"))
    }

    /// The idealised relay's statements on a pool of its own (closed by [`Relay::close`], so its
    /// statistics cannot land in a later scenario's count).
    pub async fn relay(&self) -> Result<Relay, Failure> {
        let options = self.pool.connect_options().as_ref().clone();
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(8).connect_with(options).await.map_err(pg)?;
        Ok(Relay { pool })
    }
}

/// The idealised relay's database side: oldest rows first, by id, no ordering or fencing.
pub struct Relay {
    pool: PgPool,
}

impl Relay {
    /// The next 500 pending rows: (id, payload).
    pub async fn next(&self) -> Result<Vec<(Uuid, Vec<u8>)>, Failure> {
        let select = format!("SELECT id, payload FROM {SCHEMA}.records ORDER BY id LIMIT 500");
        sqlx::query_as(AssertSqlSafe(select)).fetch_all(&self.pool).await.map_err(pg)
    }

    pub async fn delete(&self, ids: &[Uuid]) -> Result<(), Failure> {
        let delete = format!("DELETE FROM {SCHEMA}.records WHERE id = ANY($1)");
        sqlx::query(AssertSqlSafe(delete)).bind(ids).execute(&self.pool).await.map_err(pg)?;
        Ok(())
    }

    pub async fn close(self) {
        self.pool.close().await;
    }
}

fn pg(e: sqlx::Error) -> Failure {
    Failure(format!("bench: PostgreSQL: {e}"))
}
