//! The library's own migrator: plain SQL files (`migrations/<database>/`, listed by each driver),
//! applied in one transaction that instances starting together serialise on (each driver says how),
//! tracked in the schema's own `schema_migrations` table, never the host application's
//! `_sqlx_migrations`. A database migrated by a newer library, or whose applied SQL changed, is refused.

use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, Result};

/// How long a migration's statement waits for a table lock before the migration steps out of the
/// table's lock queue (see [`patiently`]): well inside a worker's lease (6 s at the defaults).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_secs(1);

/// The pauses a migration takes between tries for its table locks before it fails (see [`patiently`]).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
const PATIENCE: Duration = Duration::from_secs(300);

/// Runs `once` (a migrate of `schema` whose statements wait at most [`LOCK_TIMEOUT`] for a table lock)
/// until it ends otherwise than by such a wait, after pauses, for about [`PATIENCE`] of pauses (the
/// waits add a second each, and jitter lengthens the pauses). While its request waits in the table's
/// lock queue, every statement on the table waits behind it, the workers' heartbeats included: so it
/// steps out of the queue now and then, and lets them through.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn patiently<F: Future<Output = Result<()>>>(schema: &str, once: impl FnMut() -> F) -> Result<()> {
    use backon::{ExponentialBuilder, Retryable};
    let pauses = ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .with_total_delay(Some(PATIENCE));
    once.retry(pauses)
        .when(Error::is_time_limit)
        .notify(|e, pause| {
            tracing::warn!(schema, error = %e, ?pause, "migration ran out of time (a lock another transaction holds, or the role's statement_timeout); trying again");
        })
        .await
}

/// A forward-only migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version, increasing.
    pub version: i64,
    /// Short name.
    pub name: &'static str,
    /// SQL with unqualified names; runs with `search_path` set to the schema.
    pub sql: &'static str,
    /// Checksums of earlier texts of this migration, corrected after they were applied (to databases
    /// they worked on, with the same effect): a database holding one of them is not refused.
    pub earlier: &'static [i64],
}

/// A migration's checksum, stored when it is applied: a known migration whose text changed is refused.
/// Line endings do not count: a checkout that turned them into CRLF builds the same migrations.
pub(crate) fn checksum(sql: &str) -> i64 {
    raw_checksum(&sql.replace("\r\n", "\n"))
}

/// The checksum of the text as it is, line endings and all (what builds before line endings stopped
/// counting stored).
fn raw_checksum(sql: &str) -> i64 {
    i64::from_ne_bytes(xxh3_64(sql.as_bytes()).to_ne_bytes())
}

/// The migrations of `known` still to apply, in order; refuses a database holding a migration this
/// library does not know, or a known one whose text changed. `applied` are (version, checksum).
pub(crate) fn pending<'a>(schema: &str, applied: &[(i64, i64)], known: &'a [Migration]) -> Result<Vec<&'a Migration>> {
    let latest = known.last().map_or(0, |m| m.version);
    for &(version, sum) in applied {
        let bad = |reason: String| Err(Error::Migration { schema: schema.to_string(), version, reason });
        match known.iter().find(|m| m.version == version) {
            None if version > latest => {
                return bad(format!("applied by a newer library version (this one knows up to {latest})"));
            }
            None => return bad("applied but unknown to this library".into()),
            // A database migrated by an earlier build from a CRLF checkout holds its text's own checksum.
            Some(m) if checksum(m.sql) != sum && raw_checksum(m.sql) != sum && !m.earlier.contains(&sum) => {
                return bad("its SQL changed after it was applied".into());
            }
            Some(_) => {}
        }
    }
    Ok(known.iter().filter(|m| !applied.iter().any(|&(v, _)| v == m.version)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database migrated from a checkout with LF line endings is not refused by a build from one
    /// with CRLF, nor the other way round; any other change to the text still is.
    #[test]
    fn line_endings_do_not_change_a_checksum() {
        let lf = "CREATE TABLE t (\n    id bigint\n);\n";
        assert_eq!(checksum(lf), checksum(&lf.replace('\n', "\r\n")));
        assert_ne!(checksum(lf), checksum(&lf.replace("bigint", "int")));
        let known =
            [Migration { version: 1, name: "t", sql: "CREATE TABLE t (\r\n    id bigint\r\n);\r\n", earlier: &[] }];
        assert_eq!(pending("s", &[(1, checksum(lf))], &known).unwrap().len(), 0);
        // Migrated by an earlier build from a CRLF checkout: the raw text's checksum stands too.
        assert_eq!(pending("s", &[(1, raw_checksum(known[0].sql))], &known).unwrap().len(), 0);
        assert!(pending("s", &[(1, checksum("another"))], &known).is_err());
    }
}
