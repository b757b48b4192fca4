//! What the tests do differently per database, in one place (the only test module that names one): the
//! test's fresh database, the database clock in statements, and the views only one backend has (lock
//! waiters, server connections, catalog tables).

use std::sync::Arc;

use outbox_core::{Db, NewRecord, Outbox, Scheduled};
use sqlx::PgPool;

use super::TestDb;

impl TestDb {
    pub fn postgres(pool: PgPool) -> Self {
        Self { db: Db::from(pool), sqlite_url: None, _dir: None }
    }

    pub async fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
        Self { db: Db::connect(&url).await.unwrap(), sqlite_url: Some(url), _dir: Some(Arc::new(dir)) }
    }

    /// The connection string of this test's own database, for other processes: the SQLite file's URL,
    /// or on PostgreSQL the `DATABASE_URL` server with this test's database (`current_database()`).
    pub async fn url(&self) -> String {
        match &self.sqlite_url {
            Some(url) => url.clone(),
            None => {
                let db: String = self.scalar("SELECT current_database()", &[]).await;
                let base = std::env::var("DATABASE_URL").unwrap();
                let (server, _) = base.rsplit_once('/').unwrap();
                format!("{server}/{db}")
            }
        }
    }

    /// Renders a statement written for both backends: `{s}` is the outbox's table qualifier (`outbox.` on
    /// PostgreSQL, `outbox_` on SQLite, so `{s}records`), `{now}` the database clock as the tables store
    /// it, `{ago:N}` N seconds before it. Binds are `$1`, `$2`, … on both.
    pub fn sql(&self, text: &str) -> String {
        let qualifier = self.db.table("outbox", "");
        let sqlite = self.is_sqlite();
        let now: String =
            if sqlite { outbox_core::driver::sqlite::render("{now}", "").to_string() } else { "now()".into() };
        let mut text = text.replace("{s}", &qualifier).replace("{now}", &now);
        while let Some(start) = text.find("{ago:") {
            let end = start + text[start..].find('}').unwrap();
            let secs: i64 = text[start + 5..end].parse().unwrap();
            let ago = if sqlite {
                format!("({now} - {})", secs * 1000)
            } else {
                format!("(now() - interval '{secs} seconds')")
            };
            text.replace_range(start..=end, &ago);
        }
        text
    }

    pub fn is_sqlite(&self) -> bool {
        self.db.backend() == "sqlite"
    }

    /// Whether the database has a table of this name (in any schema).
    pub async fn table_exists(&self, name: &str) -> bool {
        let sql = if self.is_sqlite() {
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = $1"
        } else {
            "SELECT count(*) FROM information_schema.tables WHERE table_name = $1"
        };
        self.scalar::<i64>(sql, &[name.into()]).await > 0
    }

    /// The outbox's per-key lock rows, or `None` where the backend keeps none (SQLite: its single writer
    /// orders a key's writers).
    pub async fn key_rows(&self) -> Option<i64> {
        if self.is_sqlite() {
            assert!(!self.table_exists("outbox_keys").await, "SQLite keeps no per-key rows");
            return None;
        }
        Some(self.scalar("SELECT count(*) FROM outbox.keys", &[]).await)
    }

    /// How many sessions wait for a lock on a key's row, or `None` where the backend has no view of
    /// waiters (a SQLite writer sleeps in its busy handler).
    pub async fn key_lock_waiters(&self) -> Option<i64> {
        if self.is_sqlite() {
            return None;
        }
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%outbox.keys%'";
        Some(self.scalar(sql, &[]).await)
    }

    /// Terminates the server connections of the processes started with `PGAPPNAME=application`; `None`
    /// where the backend has no server connections (SQLite runs inside each process).
    pub async fn terminate_connections(&self, application: &str) -> Option<i64> {
        if self.is_sqlite() {
            return None;
        }
        let sql = "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                   WHERE application_name = $1) t";
        Some(self.scalar(sql, &[application.into()]).await)
    }

    /// Makes every update of the outbox's `instances.draining` fail, as a database that refuses it would.
    pub async fn refuse_draining(&self) {
        if self.is_sqlite() {
            self.exec(
                "CREATE TRIGGER refuse_drain BEFORE UPDATE OF draining ON {s}instances
                 BEGIN SELECT RAISE(ABORT, 'draining refused by the test'); END",
                &[],
            )
            .await;
        } else {
            self.exec(
                "CREATE FUNCTION outbox.refuse_drain() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION 'draining refused by the test'; END $$",
                &[],
            )
            .await;
            self.exec(
                "CREATE TRIGGER refuse_drain BEFORE UPDATE OF draining ON outbox.instances
                 FOR EACH ROW EXECUTE FUNCTION outbox.refuse_drain()",
                &[],
            )
            .await;
        }
    }

    /// Schedules `records` on a pooled connection outside any transaction.
    pub async fn schedule_without_transaction(&self, outbox: &Outbox, records: &[NewRecord]) -> Vec<Scheduled> {
        match &self.db {
            Db::Postgres(pool) => outbox.schedule_batch(&mut *pool.acquire().await.unwrap(), records).await.unwrap(),
            Db::Sqlite(pool) => outbox.schedule_batch(&mut *pool.acquire().await.unwrap(), records).await.unwrap(),
            _ => unreachable!("the tests build every backend"),
        }
    }
}
