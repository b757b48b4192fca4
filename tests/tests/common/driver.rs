//! What the tests do differently per database, in one place (the only test module that names one): the
//! test's fresh database, the database clock in statements, and the views only one backend has (lock
//! waiters, server connections, catalog tables).

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Db, NewRecord, Outbox, Scheduled};
use outbox_tests::proxy::DelayProxy;
use sqlx::{AssertSqlSafe, PgPool};

use super::TestDb;

impl TestDb {
    pub fn postgres(pool: PgPool) -> Self {
        Self { db: Db::from(pool), sqlite_url: None, _dir: None }
    }

    pub async fn mysql() -> Self {
        Self { db: outbox_core::driver::mysql::test_database().await, sqlite_url: None, _dir: None }
    }

    pub async fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
        Self { db: Db::connect(&url).await.unwrap(), sqlite_url: Some(url), _dir: Some(Arc::new(dir)) }
    }

    /// The connection string of this test's own database, for other processes: the SQLite file's URL,
    /// or the `DATABASE_URL` (PostgreSQL) or `MYSQL_URL` server with this test's database.
    pub async fn url(&self) -> String {
        if let Some(url) = &self.sqlite_url {
            return url.clone();
        }
        if self.is_mysql() {
            let db: String = self.scalar("SELECT DATABASE()", &[]).await;
            let server = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
            return format!("{server}/{db}");
        }
        let db: String = self.scalar("SELECT current_database()", &[]).await;
        let base = std::env::var("DATABASE_URL").unwrap();
        let (server, _) = base.rsplit_once('/').unwrap();
        format!("{server}/{db}")
    }

    /// The same database reached through a proxy of its own on loopback (no delay), in a pool of its
    /// own. A server's only: SQLite is not reached over a network.
    pub async fn through_proxy(&self) -> (TestDb, DelayProxy) {
        self.far_away(Duration::ZERO).await
    }

    /// [`TestDb::through_proxy`], its proxy delaying everything by `delay` each way.
    pub async fn far_away(&self, delay: Duration) -> (TestDb, DelayProxy) {
        self.proxied(|port| DelayProxy::start(port, delay)).await
    }

    /// [`TestDb::through_proxy`], each connection carrying at most `bytes_per_second` each way.
    pub async fn narrow_link(&self, bytes_per_second: u64) -> (TestDb, DelayProxy) {
        self.proxied(|port| DelayProxy::narrow(port, bytes_per_second)).await
    }

    async fn proxied(&self, proxy: impl AsyncFnOnce(u16) -> DelayProxy) -> (TestDb, DelayProxy) {
        assert!(!self.is_sqlite(), "SQLite is not reached over a network");
        let url = self.url().await;
        let (server, database) = url.rsplit_once('/').unwrap();
        let (host, port) = server.rsplit_once(':').unwrap();
        let proxy = proxy(port.parse().unwrap()).await;
        let db = Db::connect(&format!("{host}:{}/{database}", proxy.port)).await.unwrap();
        (TestDb { db, ..self.clone() }, proxy)
    }

    /// The same database through a proxy that passes on everything the server says but its notices
    /// (see [`DelayProxy::without_notices`]): `LISTEN` answered, `NOTIFY` never heard. PostgreSQL's
    /// only: the other backends have no notices.
    pub async fn deaf_to_notices(&self) -> (TestDb, DelayProxy) {
        assert_eq!(self.db.backend(), "postgres", "only PostgreSQL has notices");
        let url = self.url().await;
        let (server, database) = url.rsplit_once('/').unwrap();
        let (host, port) = server.rsplit_once(':').unwrap();
        let proxy = DelayProxy::without_notices(port.parse().unwrap()).await;
        let db = Db::connect(&format!("{host}:{}/{database}?sslmode=disable", proxy.port)).await.unwrap();
        (TestDb { db, ..self.clone() }, proxy)
    }

    /// The same database in a pool of its own whose connections run `setting` (a MySQL `SET`) when they
    /// open, as a server-wide setting or an application's connect hook leaves them. MySQL's only.
    pub async fn with_session_set(&self, setting: &'static str) -> TestDb {
        assert!(self.is_mysql(), "a MySQL setting");
        use sqlx::Executor;
        let options: sqlx::mysql::MySqlConnectOptions = self.url().await.parse().unwrap();
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(4)
            .after_connect(move |conn, _| Box::pin(async move { conn.execute(setting).await.map(drop) }))
            .connect_with(options)
            .await
            .unwrap();
        TestDb { db: Db::from(pool), ..self.clone() }
    }

    /// Renders a statement written for every backend: `{s}` is the outbox's table qualifier (`outbox.` on
    /// PostgreSQL, `outbox_` on SQLite and MySQL, so `{s}records`), `{now}` the database clock as the
    /// tables store it, `{ago:N}` N seconds before it; on MySQL the columns `key` and `partition`
    /// (reserved words there) are quoted. Binds are `$1`, `$2`, … on every backend.
    pub fn sql(&self, text: &str) -> String {
        let qualifier = self.db.table("outbox", "");
        let now: String = match self.db.backend() {
            "sqlite" => outbox_core::driver::sqlite::render("{now}", "").to_string(),
            "mysql" => outbox_core::driver::mysql::NOW.into(),
            _ => "now()".into(),
        };
        let mut text = text.replace("{s}", &qualifier).replace("{now}", &now);
        while let Some(start) = text.find("{ago:") {
            let end = start + text[start..].find('}').unwrap();
            let secs: i64 = text[start + 5..end].parse().unwrap();
            let ago = match self.db.backend() {
                "sqlite" => format!("({now} - {})", secs * 1000),
                "mysql" => format!("({now} - INTERVAL {secs} SECOND)"),
                _ => format!("(now() - interval '{secs} seconds')"),
            };
            text.replace_range(start..=end, &ago);
        }
        if self.is_mysql() { quote_reserved(&text) } else { text }
    }

    pub fn is_sqlite(&self) -> bool {
        self.db.backend() == "sqlite"
    }

    pub fn is_mysql(&self) -> bool {
        self.db.backend() == "mysql"
    }

    /// Whether the database has a table of this name (in any schema).
    pub async fn table_exists(&self, name: &str) -> bool {
        let sql = match self.db.backend() {
            "sqlite" => "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = $1",
            "mysql" => {
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = $1"
            }
            _ => "SELECT count(*) FROM information_schema.tables WHERE table_name = $1",
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
        Some(self.scalar("SELECT count(*) FROM {s}keys", &[]).await)
    }

    /// How many sessions wait for a lock on a key's row, or `None` where the backend has no view of
    /// waiters (a SQLite writer sleeps in its busy handler).
    pub async fn key_lock_waiters(&self) -> Option<i64> {
        if self.is_sqlite() {
            return None;
        }
        let sql = if self.is_mysql() {
            // A session still inside the key upsert: it takes microseconds unless it waits for the lock
            // (InnoDB's own view of lock waits, innodb_trx, is refreshed lazily and missed them here).
            "SELECT count(*) FROM information_schema.processlist
             WHERE db = DATABASE() AND command = 'Execute' AND info LIKE 'INSERT INTO outbox_keys%'"
        } else {
            r#"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%"outbox".keys%'"#
        };
        Some(self.scalar(sql, &[]).await)
    }

    /// How many sessions of the test's database wait for a row lock (0 on SQLite, whose writers sleep
    /// in their busy handler).
    pub async fn lock_waiters(&self) -> i64 {
        let sql = match self.db.backend() {
            "sqlite" => return 0,
            "mysql" => {
                // InnoDB refreshes this view only when it was last read over 100 ms ago: polled more
                // often, it never changes.
                tokio::time::sleep(std::time::Duration::from_millis(150)).await;
                "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
            }
            _ => {
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            }
        };
        self.scalar(sql, &[]).await
    }

    /// How many sessions of the test's database wait for a lock on a table: any lock on PostgreSQL, a
    /// table's metadata lock (which `LOCK TABLES` holds) on MySQL; 0 on SQLite.
    pub async fn table_lock_waiters(&self) -> i64 {
        if !self.is_mysql() {
            return self.lock_waiters().await;
        }
        let sql = "SELECT count(*) FROM information_schema.processlist
                   WHERE db = DATABASE() AND state LIKE 'Waiting for table%lock'";
        self.scalar(sql, &[]).await
    }

    /// How many ownership acquisitions wait for the lock on an owner's instance row (0 on SQLite).
    pub async fn acquisitions_waiting(&self) -> i64 {
        let sql = match self.db.backend() {
            "sqlite" => return 0,
            // A locking read of the owners runs for microseconds unless it waits.
            "mysql" => {
                "SELECT count(*) FROM information_schema.processlist
                 WHERE db = DATABASE() AND info LIKE 'SELECT i.id FROM %instances i%FOR UPDATE'"
            }
            _ => {
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
                 AND query LIKE 'WITH owners AS MATERIALIZED%'"
            }
        };
        self.scalar(sql, &[]).await
    }

    /// Ends every other session of the test's database: those whose clients vanished stay until told.
    pub async fn end_other_sessions(&self) {
        if self.is_sqlite() {
            return;
        }
        if self.is_mysql() {
            let others = "SELECT CAST(id AS SIGNED) FROM information_schema.processlist
                          WHERE db = DATABASE() AND id <> CONNECTION_ID()";
            for (id,) in self.rows::<(i64,)>(others, &[]).await {
                // The session may have ended meanwhile (1094: unknown thread).
                let _ = self.db.execute(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")), &[]).await;
            }
            return;
        }
        let rest = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                    WHERE datname = current_database() AND pid <> pg_backend_pid()";
        self.scalar::<i64>(rest, &[]).await;
    }

    /// Terminates the server connections of process `pid`, started with `PGAPPNAME=application`; `None`
    /// where the backend has no server connections (SQLite runs inside each process). PostgreSQL knows
    /// its clients by application name; MariaDB only by address, so the process's client ports are
    /// read from `/proc` and their sessions killed with `KILL CONNECTION`.
    pub async fn terminate_connections(&self, application: &str, pid: u32) -> Option<i64> {
        if self.is_sqlite() {
            return None;
        }
        if self.is_mysql() {
            let server_port: i64 = self.scalar("SELECT CAST(@@port AS SIGNED)", &[]).await;
            let ports = client_ports(pid, u16::try_from(server_port).unwrap());
            let hosts: Vec<(i64, String)> = self
                .db
                .fetch_all(
                    "SELECT CAST(id AS SIGNED), host FROM information_schema.processlist WHERE host LIKE '%:%'",
                    &[],
                )
                .await
                .unwrap();
            let mut killed = 0;
            for (id, host) in hosts {
                let port = host.rsplit_once(':').and_then(|(_, port)| port.parse::<u16>().ok());
                if port.is_some_and(|port| ports.contains(&port)) {
                    // The session may have ended meanwhile (1094: unknown thread).
                    if self.db.execute(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")), &[]).await.is_ok() {
                        killed += 1;
                    }
                }
            }
            return Some(killed);
        }
        let sql = "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                   WHERE application_name = $1) t";
        Some(self.scalar(sql, &[application.into()]).await)
    }

    /// Makes every update of the outbox's `instances.draining` fail, as a database that refuses it would.
    pub async fn refuse_draining(&self) {
        self.refusing_trigger(
            "CREATE TRIGGER refuse_drain BEFORE UPDATE ON outbox_instances FOR EACH ROW
             BEGIN IF NEW.draining <> OLD.draining THEN
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'draining refused by the test';
             END IF; END",
            "CREATE TRIGGER refuse_drain BEFORE UPDATE OF draining ON {s}instances
             BEGIN SELECT RAISE(ABORT, 'draining refused by the test'); END",
            "CREATE TRIGGER refuse_drain BEFORE UPDATE OF draining ON outbox.instances
             FOR EACH ROW EXECUTE FUNCTION outbox.refuse('draining refused by the test')",
        )
        .await;
    }

    /// Makes every change of a partition's target fail, as a database that refuses it would (or a lock
    /// it waits for past the time limit).
    pub async fn refuse_targets(&self) {
        self.refusing_trigger(
            "CREATE TRIGGER refuse_target BEFORE UPDATE ON outbox_partitions FOR EACH ROW
             BEGIN IF NOT (NEW.target_owner <=> OLD.target_owner) THEN
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'target refused by the test';
             END IF; END",
            "CREATE TRIGGER refuse_target BEFORE UPDATE OF target_owner ON {s}partitions
             WHEN NEW.target_owner IS NOT OLD.target_owner
             BEGIN SELECT RAISE(ABORT, 'target refused by the test'); END",
            "CREATE TRIGGER refuse_target BEFORE UPDATE OF target_owner ON outbox.partitions
             FOR EACH ROW WHEN (NEW.target_owner IS DISTINCT FROM OLD.target_owner)
             EXECUTE FUNCTION outbox.refuse('target refused by the test')",
        )
        .await;
    }

    /// Makes every deletion of an instance row named `stale` fail, as a database that refuses it would
    /// (or a lock it waits for past the time limit); [`TestDb::allow_deleting_instances`] ends it.
    pub async fn refuse_deleting_stale_instances(&self) {
        self.refusing_trigger(
            "CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox_instances FOR EACH ROW
             BEGIN IF OLD.name = 'stale' THEN
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'deletion refused by the test';
             END IF; END",
            "CREATE TRIGGER refuse_delete BEFORE DELETE ON {s}instances WHEN OLD.name = 'stale'
             BEGIN SELECT RAISE(ABORT, 'deletion refused by the test'); END",
            "CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox.instances
             FOR EACH ROW WHEN (OLD.name = 'stale') EXECUTE FUNCTION outbox.refuse('deletion refused by the test')",
        )
        .await;
    }

    /// Locks outbox table `table` (`records`, `instances`, ...) against every other session, as
    /// maintenance or a migration does, until [`TableLock::release`]. A server's only: SQLite has no
    /// table locks.
    pub async fn lock_table(&self, table: &str) -> TableLock {
        use sqlx::{Connection, Executor};
        assert!(!self.is_sqlite(), "SQLite has no table locks");
        if self.is_mysql() {
            let mut conn = sqlx::MySqlConnection::connect(&self.url().await).await.unwrap();
            conn.execute(AssertSqlSafe(format!("LOCK TABLES outbox_{table} WRITE"))).await.unwrap();
            return TableLock::MySql(conn);
        }
        let mut tx = self.begin().await;
        let lock = self.sql(&format!("LOCK TABLE {{s}}{table} IN ACCESS EXCLUSIVE MODE"));
        tx.execute(AssertSqlSafe(lock), &[]).await.unwrap();
        TableLock::Postgres(tx)
    }

    /// Makes every release of a partition (its owner cleared) fail, as a database that refuses it would
    /// (or a lock it waits for past the time limit); [`TestDb::allow_releases`] ends it.
    pub async fn refuse_releases(&self) {
        self.refusing_trigger(
            "CREATE TRIGGER refuse_release BEFORE UPDATE ON outbox_partitions FOR EACH ROW
             BEGIN IF NEW.owner IS NULL AND OLD.owner IS NOT NULL THEN
                 SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'release refused by the test';
             END IF; END",
            "CREATE TRIGGER refuse_release BEFORE UPDATE OF owner ON {s}partitions
             WHEN NEW.owner IS NULL AND OLD.owner IS NOT NULL
             BEGIN SELECT RAISE(ABORT, 'release refused by the test'); END",
            "CREATE TRIGGER refuse_release BEFORE UPDATE OF owner ON outbox.partitions
             FOR EACH ROW WHEN (NEW.owner IS NULL AND OLD.owner IS NOT NULL)
             EXECUTE FUNCTION outbox.refuse('release refused by the test')",
        )
        .await;
    }

    /// Ends [`TestDb::refuse_releases`].
    pub async fn allow_releases(&self) {
        self.drop_trigger("refuse_release", "partitions").await;
    }

    /// Makes every deletion of a record row take `millis` more (a slow disk, a trigger of the
    /// application's). A server's only: SQLite cannot sleep in a statement.
    pub async fn slow_record_deletes(&self, millis: u32) {
        let seconds = f64::from(millis) / 1000.0;
        if self.is_mysql() {
            let trigger =
                format!("CREATE TRIGGER slow_delete BEFORE DELETE ON outbox_records FOR EACH ROW DO SLEEP({seconds})");
            self.db.execute_script(AssertSqlSafe(trigger)).await.unwrap();
        } else {
            assert!(!self.is_sqlite(), "SQLite cannot sleep in a statement");
            self.db
                .execute_script(AssertSqlSafe(format!(
                    "CREATE FUNCTION outbox.slow() RETURNS trigger LANGUAGE plpgsql AS
                     $$ BEGIN PERFORM pg_sleep({seconds}); RETURN OLD; END $$;
                     CREATE TRIGGER slow_delete BEFORE DELETE ON outbox.records FOR EACH ROW EXECUTE FUNCTION outbox.slow()"
                )))
                .await
                .unwrap();
        }
    }

    /// Creates the trigger written for this backend; on PostgreSQL its function `outbox.refuse(message)`,
    /// which raises the message it is given, is created first.
    async fn refusing_trigger(&self, mysql: &'static str, sqlite: &str, postgres: &str) {
        if self.is_mysql() {
            self.db.execute_script(mysql).await.unwrap();
        } else if self.is_sqlite() {
            self.exec(sqlite, &[]).await;
        } else {
            self.exec(
                "CREATE OR REPLACE FUNCTION outbox.refuse() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION '%', TG_ARGV[0]; END $$",
                &[],
            )
            .await;
            self.exec(postgres, &[]).await;
        }
    }

    /// Ends [`TestDb::refuse_deleting_stale_instances`].
    pub async fn allow_deleting_instances(&self) {
        self.drop_trigger("refuse_delete", "instances").await;
    }

    /// Drops trigger `name` of the outbox table `table` (PostgreSQL names a trigger with its table).
    async fn drop_trigger(&self, name: &str, table: &str) {
        let on = if self.is_sqlite() || self.is_mysql() { String::new() } else { format!(" ON outbox.{table}") };
        self.exec(&format!("DROP TRIGGER {name}{on}"), &[]).await;
    }

    /// On a pooled connection, begins a transaction with the application's own `BEGIN` (which sqlx does
    /// not know of), runs `business` in it, schedules `records`, and ends it with `end` (`COMMIT` or
    /// `ROLLBACK`) whatever the schedule returned.
    pub async fn schedule_in_own_transaction(
        &self,
        outbox: &Outbox,
        business: &str,
        records: &[NewRecord],
        end: &str,
    ) -> outbox_core::Result<Vec<Scheduled>> {
        let business = AssertSqlSafe(self.sql(business));
        macro_rules! run {
            ($pool:expr) => {{
                let mut conn = $pool.acquire().await.unwrap();
                sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
                sqlx::raw_sql(business).execute(&mut *conn).await.unwrap();
                let scheduled = outbox.schedule_batch(&mut *conn, records).await;
                sqlx::raw_sql(AssertSqlSafe(end.to_string())).execute(&mut *conn).await.unwrap();
                scheduled
            }};
        }
        match &self.db {
            Db::Postgres(pool) => run!(pool),
            Db::Sqlite(pool) => run!(pool),
            Db::MySql(pool) => run!(pool),
            _ => unreachable!("the tests build every backend"),
        }
    }

    /// Schedules `records` on a pooled connection outside any transaction.
    pub async fn schedule_without_transaction(&self, outbox: &Outbox, records: &[NewRecord]) -> Vec<Scheduled> {
        match &self.db {
            Db::Postgres(pool) => outbox.schedule_batch(&mut *pool.acquire().await.unwrap(), records).await.unwrap(),
            Db::Sqlite(pool) => outbox.schedule_batch(&mut *pool.acquire().await.unwrap(), records).await.unwrap(),
            Db::MySql(pool) => outbox.schedule_batch(&mut *pool.acquire().await.unwrap(), records).await.unwrap(),
            _ => unreachable!("the tests build every backend"),
        }
    }
}

/// `sql` with the identifiers `key` and `partition` (outside quotes) in MySQL's quotes.
fn quote_reserved(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let flush = |word: &mut String, out: &mut String| {
        if matches!(word.as_str(), "key" | "partition") {
            out.push('`');
            out.push_str(word);
            out.push('`');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in sql.chars() {
        if let Some(q) = quote {
            out.push(c);
            if c == q {
                quote = None;
            }
        } else if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            if matches!(c, '\'' | '"' | '`') {
                quote = Some(c);
            }
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// The local ports of process `pid`'s TCP connections to `server_port` on loopback: its sockets (the
/// inodes its descriptors point to) matched against the kernel's TCP tables.
fn client_ports(pid: u32, server_port: u16) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(target.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let port = |address: &str| u16::from_str_radix(address.rsplit_once(':')?.1, 16).ok();
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(remote), Some(inode)) = (fields.get(1), fields.get(2), fields.get(9)) else {
                continue;
            };
            if port(remote) == Some(server_port) && inodes.contains(*inode) {
                ports.extend(port(local));
            }
        }
    }
    ports
}

/// A lock on an outbox table ([`TestDb::lock_table`]).
pub enum TableLock {
    Postgres(outbox_core::Tx),
    MySql(sqlx::MySqlConnection),
}

impl TableLock {
    pub async fn release(self) {
        use sqlx::Connection;
        match self {
            TableLock::Postgres(tx) => tx.rollback().await.unwrap(),
            TableLock::MySql(conn) => conn.close().await.unwrap(),
        }
    }
}
