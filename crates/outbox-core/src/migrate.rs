//! The library's own migrator: plain SQL files (`migrations/<database>/`, listed by each driver),
//! applied in one transaction that instances starting together serialise on (each driver says how),
//! tracked in the schema's own `schema_migrations` table, never the host application's
//! `_sqlx_migrations`. A database whose applied SQL changed is refused, and so is one migrated by a newer
//! library, unless each migration this library does not know says that older libraries still run on
//! the schema it leaves (stored with it): a deploy rolled back then starts, `migrate` included.

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
    /// Whether every library that runs on the schema before this migration still runs correctly on
    /// the schema it leaves (it only adds what they ignore: a table, a column with a default, an index).
    /// A library accepts a run of newer migrations that all say so, so the flag must hold for all of
    /// them, not only for the version just before. Stored with the migration, where the older library
    /// reads it: a deploy rolled back after this migration then goes on, where it would be refused.
    /// Read only by libraries from the migration that added the column on (PostgreSQL 8, MySQL 7,
    /// SQLite 10); those before it refuse every newer migration.
    pub older_versions_run: bool,
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

/// The columns a migration's record is inserted with, and what follows its three bound values
/// (version, name, checksum): the flag only where it is set, as its column comes with a migration of
/// its own, after the earlier ones were recorded.
pub(crate) fn recorded_columns(m: &Migration) -> (&'static str, &'static str) {
    if m.older_versions_run {
        ("version, name, checksum, older_versions_run", ", TRUE")
    } else {
        ("version, name, checksum", "")
    }
}

/// The migrations of `known` still to apply ([`pending`]), reading which applied migrations say older
/// versions still run on their schema (`read_flags`) only where one is newer than all of `known`: the
/// column holding the flags came with a migration of its own, which such a database has.
pub(crate) async fn to_apply<'a>(
    schema: &str,
    applied: &[(i64, i64)],
    known: &'a [Migration],
    read_flags: impl AsyncFnOnce() -> Result<Vec<i64>>,
) -> Result<Vec<&'a Migration>> {
    let older_versions_run = if has_newer(applied, known) { read_flags().await? } else { Vec::new() };
    pending(schema, applied, &older_versions_run, known)
}

/// Whether `applied` (version, checksum) holds a migration newer than every one of `known`.
fn has_newer(applied: &[(i64, i64)], known: &[Migration]) -> bool {
    let latest = known.last().map_or(0, |m| m.version);
    applied.iter().any(|&(version, _)| version > latest)
}

/// The migrations of `known` still to apply, in order; refuses a database holding a migration this
/// library does not know, unless it is newer than all of them and among `older_versions_run` (the
/// applied migrations that say older libraries still run on their schema), or a known one whose text
/// changed. `applied` are (version, checksum).
pub(crate) fn pending<'a>(
    schema: &str,
    applied: &[(i64, i64)],
    older_versions_run: &[i64],
    known: &'a [Migration],
) -> Result<Vec<&'a Migration>> {
    let latest = known.last().map_or(0, |m| m.version);
    for &(version, sum) in applied {
        let bad = |reason: String| Err(Error::Migration { schema: schema.to_string(), version, reason });
        match known.iter().find(|m| m.version == version) {
            None if version > latest && older_versions_run.contains(&version) => {}
            None if version > latest => {
                return bad(format!(
                    "applied by a newer library version, which says older versions do not run on its schema \
                     (this one knows up to {latest}): run that version or a newer one"
                ));
            }
            None => return bad("applied but unknown to this library".into()),
            // A database migrated by an earlier build from a CRLF checkout holds its text's own checksum.
            Some(m) if checksum(m.sql) != sum && raw_checksum(m.sql) != sum && !m.earlier.contains(&sum) => {
                return bad("its SQL changed after it was applied".into());
            }
            Some(_) => {}
        }
    }
    if has_newer(applied, known) {
        tracing::info!(
            schema,
            latest,
            "the outbox schema was migrated by a newer library version, which says this one still runs on it"
        );
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
        let known = [Migration {
            version: 1,
            name: "t",
            sql: "CREATE TABLE t (\r\n    id bigint\r\n);\r\n",
            earlier: &[],
            older_versions_run: false,
        }];
        assert_eq!(pending("s", &[(1, checksum(lf))], &[], &known).unwrap().len(), 0);
        // Migrated by an earlier build from a CRLF checkout: the raw text's checksum stands too.
        assert_eq!(pending("s", &[(1, raw_checksum(known[0].sql))], &[], &known).unwrap().len(), 0);
        assert!(pending("s", &[(1, checksum("another"))], &[], &known).is_err());
    }

    /// A database migrated by a newer library is refused unless every migration this library does not
    /// know says older versions still run on its schema; an unknown one older than the latest known,
    /// or a changed known one, is refused whatever it says.
    #[test]
    fn newer_migrations_are_refused_unless_they_say_older_versions_run() {
        let m = |version, sql| Migration { version, name: "m", sql, earlier: &[], older_versions_run: false };
        let known = [m(1, "one"), m(2, "two")];
        let base = [(1, checksum("one")), (2, checksum("two"))];
        let with = |extra: &[(i64, i64)]| [&base[..], extra].concat();
        assert!(!has_newer(&base, &known));
        assert!(has_newer(&with(&[(3, 0)]), &known));

        let newer = with(&[(3, 0), (4, 0)]);
        assert_eq!(pending("s", &newer, &[3, 4], &known).unwrap().len(), 0, "both say older versions run");
        let refused = pending("s", &newer, &[3], &known).unwrap_err();
        assert!(matches!(refused, Error::Migration { version: 4, .. }), "{refused:?}");
        assert!(refused.to_string().contains("knows up to 2"), "{refused}");
        // Flags do not cover what is not newer: an unknown migration among the known ones, a changed one.
        let gap = [(1, checksum("one")), (3, 0)];
        assert!(pending("s", &gap, &[3], &[m(1, "one"), m(2, "two"), m(4, "four")]).is_err());
        assert!(pending("s", &[(1, checksum("changed")), (2, checksum("two")), (3, 0)], &[1, 3], &known).is_err());
    }
}
