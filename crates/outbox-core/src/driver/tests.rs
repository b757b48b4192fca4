//! The driver conformance suite: each operation's contract (see its method on [`Db`]) checked against
//! every backend, a fresh PostgreSQL database per test and a private in-memory SQLite database.

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use sqlx::{AssertSqlSafe, PgPool};

use super::{ConnectOptions, Db};
use crate::assignment::{Epoch, InstanceId};
use crate::stored::{Found, Outcome, Request, Verdict};
use crate::{Config, Error, NewRecord, Outbox};

/// A fresh database of every backend: `pool`'s PostgreSQL database, an in-memory SQLite one and a new
/// MySQL database.
pub(crate) async fn backends(pool: PgPool) -> Vec<Db> {
    vec![Db::Postgres(pool), Db::Sqlite(super::sqlite::memory().await), super::mysql::test_database().await]
}

/// Registers an instance with a lease a day long and gives it every partition at epoch 1.
pub(crate) async fn hold_all(db: &Db) -> InstanceId {
    let all: Vec<i16> = (0..256).collect();
    hold(db, &all, Epoch(1)).await
}

/// Registers an instance with a lease a day long and gives it `partitions` at `epoch`.
pub(crate) async fn hold(db: &Db, partitions: &[i16], epoch: Epoch) -> InstanceId {
    let me = InstanceId::new();
    let (register, own) = match db {
        Db::Postgres(_) => (
            "INSERT INTO outbox.instances (id, name, expires_at) VALUES ($1, 'test', now() + interval '1 day')",
            "UPDATE outbox.partitions SET owner = $1, epoch = $2 WHERE partition = ANY($3)",
        ),
        Db::Sqlite(_) => (
            "INSERT INTO outbox_instances (id, name, expires_at) VALUES ($1, 'test', 4611686018427387903)",
            "UPDATE outbox_partitions SET owner = $1, epoch = $2 WHERE partition IN (SELECT value FROM json_each($3))",
        ),
        Db::MySql(_) => (
            "INSERT INTO outbox_instances (id, name, expires_at) VALUES ($1, 'test', UTC_TIMESTAMP(6) + INTERVAL 1 DAY)",
            "UPDATE outbox_partitions SET owner = $1, epoch = $2
             WHERE `partition` IN (SELECT x.p FROM JSON_TABLE($3, '$[*]' COLUMNS (p INT PATH '$')) x)",
        ),
    };
    match db {
        Db::Postgres(pool) => {
            sqlx::query(register).bind(me).execute(pool).await.unwrap();
            sqlx::query(own).bind(me).bind(epoch).bind(partitions).execute(pool).await.unwrap();
        }
        Db::Sqlite(_) | Db::MySql(_) => {
            db.execute(register, &[me.into()]).await.unwrap();
            db.execute(own, &[me.into(), epoch.into(), format!("{partitions:?}").as_str().into()]).await.unwrap();
        }
    }
    me
}

async fn migrated(db: &Db, config: Config) -> Outbox {
    let outbox = Outbox::new(config).unwrap();
    outbox.migrate(db).await.unwrap();
    outbox
}

async fn commit(outbox: &Outbox, db: &Db, records: &[NewRecord]) -> Vec<crate::Scheduled> {
    let mut tx = db.begin().await.unwrap();
    let scheduled = outbox.schedule_batch(&mut tx, records).await.unwrap();
    tx.commit().await.unwrap();
    scheduled
}

fn request(instance: InstanceId, limit: usize, followers: usize, budget: usize) -> Request {
    Request {
        instance,
        partitions: crate::partition::all_partitions().map(|p| (p, Epoch(1), None)).collect(),
        exclude: vec![],
        limit,
        followers,
        budget,
    }
}

/// A key's run stops before the record that would take its payloads past the byte budget; a head larger
/// than the budget still comes, alone.
#[sqlx::test(migrations = false)]
async fn fetch_cuts_runs_to_the_byte_budget(pool: PgPool) {
    for db in backends(pool).await {
        let outbox = migrated(&db, Config::default()).await;
        let mut records = Vec::new();
        for _ in 0..5 {
            records.push(NewRecord::new("large", "t", vec![0_u8; 30 * 1024]));
            records.push(NewRecord::new("small", "t", vec![0_u8; 10]));
        }
        records.push(NewRecord::new("huge", "t", vec![0_u8; 100 * 1024]));
        records.push(NewRecord::new("huge", "t", vec![0_u8; 10]));
        commit(&outbox, &db, &records).await;
        let instance = hold_all(&db).await;
        let found = db.fetch(outbox.statements(), &request(instance, 10, 7, 64 * 1024)).await.unwrap();
        let mut lengths: Vec<(String, usize)> =
            found.runs.iter().map(|run| (run[0].record.key.clone(), run.len())).collect();
        lengths.sort();
        let expected = [("huge".to_string(), 1), ("large".to_string(), 2), ("small".to_string(), 5)];
        assert_eq!(lengths, expected, "{}", db.backend());
        for run in &found.runs {
            assert!(run.windows(2).all(|w| w[1].record.seq > w[0].record.seq), "a run is in order: {run:?}");
            assert!(run.iter().all(|f| f.record.epoch == Epoch(1) && f.instance == instance));
        }
    }
}

/// A fetch returns nothing once the instance's lease has expired, even of partitions it still owns, and
/// nothing of a partition held at another epoch.
#[sqlx::test(migrations = false)]
async fn fetch_returns_nothing_without_a_live_lease_or_at_another_epoch(pool: PgPool) {
    for db in backends(pool).await {
        let outbox = migrated(&db, Config::default()).await;
        commit(&outbox, &db, &[NewRecord::new("k", "t", "")]).await;
        let instance = hold_all(&db).await;
        let fetch = |request: Request| {
            let (db, outbox) = (db.clone(), outbox.clone());
            async move { db.fetch(outbox.statements(), &request).await.unwrap().runs.len() }
        };
        assert_eq!(fetch(request(instance, 10, 0, usize::MAX)).await, 1, "{}", db.backend());
        let mut other_epoch = request(instance, 10, 0, usize::MAX);
        other_epoch.partitions.iter_mut().for_each(|p| p.1 = Epoch(2));
        assert_eq!(fetch(other_epoch).await, 0, "{}: another epoch", db.backend());
        let expire = match db {
            Db::Postgres(_) => "UPDATE outbox.instances SET expires_at = now() - interval '1 second'",
            Db::Sqlite(_) => "UPDATE outbox_instances SET expires_at = 0",
            Db::MySql(_) => "UPDATE outbox_instances SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND",
        };
        db.execute(expire, &[]).await.unwrap();
        assert_eq!(fetch(request(instance, 10, 0, usize::MAX)).await, 0, "{}: lease expired", db.backend());
    }
}

/// The outcome of the first attempt at `scheduled` (key "k", epoch 1) held by `instance`.
fn first_attempt(scheduled: &crate::Scheduled, instance: InstanceId, verdict: Verdict) -> Outcome {
    Outcome {
        id: scheduled.id,
        partition: scheduled.partition,
        instance,
        epoch: Epoch(1),
        key: "k".into(),
        attempts: 1,
        requeues: 0,
        due_since: chrono::Utc::now(),
        verdict,
    }
}

/// A FAILED outcome written again after an operator requeued its record (as a completion retried after
/// an ambiguous commit would) leaves the requeue in place, and is reported held but not written: settled.
/// An outcome under an epoch that moved on is neither written nor held: fenced.
#[sqlx::test(migrations = false)]
async fn complete_says_what_it_wrote_and_what_the_fence_held(pool: PgPool) {
    for db in backends(pool).await {
        let outbox = migrated(&db, Config::default()).await;
        let instance = hold_all(&db).await;
        let scheduled = commit(&outbox, &db, &[NewRecord::new("k", "t", "")]).await.remove(0);
        let outcome = first_attempt(&scheduled, instance, Verdict::Failed { error: "permanent: no".into() });
        let first = db.complete(outbox.statements(), std::slice::from_ref(&outcome)).await.unwrap();
        assert!(first.ids.contains(&scheduled.id), "{}", db.backend());
        outbox.requeue(&db, scheduled.id).await.unwrap();

        let late = db.complete(outbox.statements(), std::slice::from_ref(&outcome)).await.unwrap();
        assert!(!late.ids.contains(&scheduled.id), "{}: the requeued record was failed again", db.backend());
        assert!(late.held.contains(&outcome.grant()), "{}: settled, not fenced", db.backend());
        assert!(outbox.failed(&db, &Default::default()).await.unwrap().is_empty());

        let stale = Outcome { epoch: Epoch(0), verdict: Verdict::Delivered, ..outcome };
        let fenced = db.complete(outbox.statements(), std::slice::from_ref(&stale)).await.unwrap();
        assert!(fenced.ids.is_empty() && fenced.held.is_empty(), "{}: fenced", db.backend());
        let stats = outbox.stats(&db).await.unwrap();
        assert_eq!((stats[0].pending, stats[0].failed), (1, 0), "{}", db.backend());
    }
}

/// A call counted before it was made (an attempt due in an hour, "did not finish") and then not made
/// puts its record back as it was fetched: its attempts, no error, due at once.
#[sqlx::test(migrations = false)]
async fn a_call_not_made_takes_its_count_back(pool: PgPool) {
    for db in backends(pool).await {
        let outbox = migrated(&db, Config::default()).await;
        let instance = hold_all(&db).await;
        let scheduled = commit(&outbox, &db, &[NewRecord::new("k", "t", "")]).await.remove(0);
        let unfinished = Verdict::Retry { delay: std::time::Duration::from_secs(3600), error: "did not finish".into() };
        let counted = first_attempt(&scheduled, instance, unfinished);
        db.complete(outbox.statements(), std::slice::from_ref(&counted)).await.unwrap();
        let fetch = async || db.fetch(outbox.statements(), &request(instance, 10, 0, usize::MAX)).await.unwrap().runs;
        assert!(fetch().await.is_empty(), "{}: counted, the record backs off", db.backend());

        let not_called = Outcome { attempts: 0, verdict: Verdict::NotCalled { unfinished: false }, ..counted };
        let written = db.complete(outbox.statements(), std::slice::from_ref(&not_called)).await.unwrap();
        assert!(written.ids.contains(&scheduled.id), "{}", db.backend());
        let runs = fetch().await;
        let attempts: Vec<i32> = runs.iter().flatten().map(|f| f.record.attempts).collect();
        assert_eq!(attempts, [0], "{}: due again, with its attempts as fetched", db.backend());
        let table = db.table("outbox", "records");
        let error: (Option<String>,) =
            db.fetch_one(sqlx::AssertSqlSafe(format!("SELECT last_error FROM {table}")), &[]).await.unwrap();
        assert_eq!(error, (None,), "{}", db.backend());
    }
}

/// A completion batch larger than the server takes in one statement (MySQL's `max_allowed_packet`: many
/// keys in flight failing with long errors) is written whole, as is one of more deliveries than a
/// statement's list of them holds: the batch comes back on every retry, and its keys would wait for good.
#[sqlx::test(migrations = false)]
async fn a_completion_batch_of_any_size_is_written(pool: PgPool) {
    for db in backends(pool).await {
        let outbox = migrated(&db, Config::default()).await;
        let instance = hold_all(&db).await;
        // An error at its longest, each character escaped in JSON: about 8 KiB a failure.
        let error = "\"".repeat(crate::MAX_ERROR_BYTES);
        let failures = match &db {
            Db::MySql(_) => {
                let (packet,): (i64,) = db.fetch_one("SELECT CAST(@@max_allowed_packet AS SIGNED)", &[]).await.unwrap();
                usize::try_from(packet).unwrap() / (2 * error.len()) + 64
            }
            _ => 64,
        };
        let deliveries = 25_000;
        let records: Vec<NewRecord> =
            (0..failures + deliveries).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect();
        let scheduled = commit(&outbox, &db, &records).await;
        let outcomes: Vec<Outcome> = scheduled
            .iter()
            .zip(&records)
            .enumerate()
            .map(|(i, (scheduled, record))| {
                let verdict = if i < failures { Verdict::Failed { error: error.clone() } } else { Verdict::Delivered };
                Outcome { key: record.key.clone(), ..first_attempt(scheduled, instance, verdict) }
            })
            .collect();
        let written = db.complete(outbox.statements(), &outcomes).await.unwrap();
        assert_eq!(written.ids.len(), outcomes.len(), "{}", db.backend());
        let stats = outbox.stats(&db).await.unwrap();
        let (pending, failed) = stats.iter().fold((0, 0), |(p, f), s| (p + s.pending, f + s.failed));
        assert_eq!((pending, failed), (0, failures as i64), "{}", db.backend());
    }
}

/// A record's state in the fetch model.
#[derive(Debug, Clone, Copy)]
enum State {
    Due,
    BackingOff,
    Failed,
}

fn state() -> impl Strategy<Value = State> {
    prop_oneof![3 => Just(State::Due), 1 => Just(State::BackingOff), 1 => Just(State::Failed)]
}

/// One key of the model: partition, name, first sequence, step between sequences, record states.
type Key = (i16, String, i64, i64, Vec<State>);

/// A record of the model: its sequence number and whether it is due.
type Seq = (i64, bool);

/// A random backlog and fetch request.
#[derive(Debug, Clone)]
struct Case {
    keys: Vec<Key>,
    order: Vec<i16>,
    unheld: Vec<i16>,
    cursors: [Option<String>; 4],
    exclude: Vec<String>,
    limit: usize,
    followers: usize,
    budget: usize,
}

fn key_name(partition: i16, n: u8) -> String {
    // Names sort differently from numbers ("p1-k10" < "p1-k5"), and some differ only in case or by a
    // trailing space: distinct keys in byte order, one key to a case-insensitive or padding collation.
    let name = format!("p{partition}-k{}", u32::from(n / 3) * 5 % 11);
    match n % 3 {
        0 => name,
        1 => name.to_uppercase(),
        _ => format!("{name} "),
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec((0i16..4, 0u8..9, 1i64..4, 1i64..4, proptest::collection::vec(state(), 1..8)), 0..14),
        proptest::sample::subsequence(vec![0i16, 1, 2, 3], 0..=4).prop_shuffle(),
        proptest::sample::subsequence(vec![0i16, 1, 2, 3], 0..=2),
        proptest::collection::vec(proptest::option::of(0u8..12), 4),
        proptest::collection::vec(0u8..9, 0..3),
        (1usize..6, 0usize..5, prop_oneof![Just(usize::MAX), 0usize..60]),
    )
        .prop_map(|(keys, order, unheld, cursors, exclude, (limit, followers, budget))| {
            // One key per (partition, name). Sequence numbers are database-wide, as the databases give
            // them (on SQLite the number is the row's id): no two keys share one.
            let mut seen = std::collections::BTreeSet::new();
            let keys = keys
                .into_iter()
                .filter(|(p, k, ..)| seen.insert((*p, *k)))
                .enumerate()
                .map(|(j, (p, k, first, step, states))| (p, key_name(p, k), first * 16 + j as i64, step * 16, states))
                .collect();
            // Cursors fall between, on and around the keys.
            let cursors = std::array::from_fn(|p| cursors[p].map(|n| format!("p{p}-k{}", u32::from(n) * 3 % 13)));
            let exclude = exclude.iter().map(|k| key_name(1, *k)).collect();
            Case { keys, order, unheld, cursors, exclude, limit, followers, budget }
        })
}

/// A record's payload size in the fetch test: varied, and known to the model.
fn size(key: &str, seq: i64) -> usize {
    ((seq * 7 + key.len() as i64 * 3) % 23) as usize
}

/// The keys served in order, each key's records, and the key where a walk that read all it may
/// stopped.
type Expected = (Vec<(i16, String)>, BTreeMap<String, Vec<Seq>>, Option<(i16, String)>);

/// What the fetch should find, computed the plain way: per served partition in the given order (those
/// held: not in `unheld`), keys in byte order starting after the partition's cursor and then wrapping
/// around, each key's head by the mode's rule, the first `limit` keys served, each with the records from
/// its head to head + `followers`. A walk reads at most `walk` records (every record of a key, due or
/// not, in flight or not), then stops at the key it read last. Returns the keys served in order, each
/// key's records, and where the walk stopped.
fn model(case: &Case, followers: usize, stop_on_first_failure: bool, walk: usize) -> Expected {
    let (mut heads, mut runs, mut stopped) = (Vec::new(), BTreeMap::new(), None);
    let mut read = 0;
    for &partition in case.order.iter().filter(|p| !case.unheld.contains(p)) {
        let mut in_partition: Vec<&Key> = case.keys.iter().filter(|k| k.0 == partition).collect();
        in_partition.sort_by(|a, b| a.1.cmp(&b.1));
        if let Some(after) = &case.cursors[partition as usize] {
            let (up_to, past): (Vec<&Key>, Vec<&Key>) = in_partition.iter().partition(|k| &k.1 <= after);
            in_partition = past.into_iter().chain(up_to).collect();
        }
        for (_, key, first, step, states) in in_partition {
            if read >= walk {
                break;
            }
            read += states.len();
            if read >= walk {
                stopped = Some((partition, key.clone()));
            }
            let due = |i: usize| matches!(states[i], State::Due);
            let head = if stop_on_first_failure { due(0).then_some(0) } else { (0..states.len()).find(|&i| due(i)) };
            let Some(head) = head else { continue };
            if case.exclude.contains(key) || heads.len() == case.limit {
                continue;
            }
            heads.push((partition, key.clone()));
            let run =
                (head..states.len().min(head + followers + 1)).map(|i| (first + i as i64 * step, due(i))).collect();
            runs.insert(key.clone(), run);
        }
    }
    (heads, runs, stopped)
}

async fn insert(db: &Db, partition: i16, key: &str, seq: i64, state: State) {
    insert_sized(db, partition, key, seq, state, size(key, seq)).await;
}

/// A record of `bytes` payload bytes.
async fn insert_sized(db: &Db, partition: i16, key: &str, seq: i64, state: State, bytes: usize) {
    let payload = vec![b'x'; bytes];
    let (id, failed, backing_off) =
        (uuid::Uuid::now_v7(), matches!(state, State::Failed), matches!(state, State::BackingOff));
    let sql = match db {
        Db::Postgres(_) => {
            "INSERT INTO outbox.records (id, partition, key, seq, event_type, payload, next_attempt_at, failed_at)
             VALUES ($1, $2, $3, $4, 't', $5, CASE WHEN $6 THEN now() + interval '1 day' END, CASE WHEN $7 THEN now() END)"
        }
        Db::Sqlite(_) => {
            "INSERT INTO outbox_records (id, partition, key, seq, event_type, payload, next_attempt_at, failed_at)
             VALUES ($1, $2, $3, $4, 't', $5, CASE WHEN $6 THEN 4611686018427387903 END, CASE WHEN $7 THEN 1 END)"
        }
        Db::MySql(_) => {
            "INSERT INTO outbox_records (id, `partition`, `key`, seq, event_type, payload, headers, next_attempt_at, failed_at)
             VALUES ($1, $2, $3, $4, 't', $5, '{}', CASE WHEN $6 THEN UTC_TIMESTAMP(6) + INTERVAL 1 DAY END,
                     CASE WHEN $7 THEN UTC_TIMESTAMP(6) END)"
        }
    };
    let args =
        [id.into(), partition.into(), key.into(), seq.into(), (&payload).into(), backing_off.into(), failed.into()];
    db.execute(sql, &args).await.unwrap();
}

/// A page of FAILED records with their payloads ends after the record that takes its payloads to
/// `FAILED_PAGE_PAYLOAD_BYTES`, the first record always coming; the next page goes on after it. Without
/// payloads the limit alone ends a page.
#[sqlx::test]
async fn a_page_of_payloads_ends_at_its_byte_budget(pool: PgPool) {
    const BUDGET: usize = crate::stored::FAILED_PAGE_PAYLOAD_BYTES;
    let sizes = [BUDGET * 3 / 4, BUDGET / 4 - 1, 10, BUDGET + 1, 10];
    for db in backends(pool).await {
        let outbox = migrated(&db, Config::default()).await;
        for (seq, bytes) in (1..).zip(sizes) {
            insert_sized(&db, 7, "k", seq, State::Failed, bytes).await;
        }
        let page = async |after: Option<i64>, payloads| {
            let after = after.map(|seq| crate::FailedPosition { partition: 7, key: "k".into(), seq });
            let filter = crate::FailedFilter { after, payloads, ..Default::default() };
            let listed = outbox.failed(&db, &filter).await.unwrap();
            listed.iter().map(|r| (r.seq, r.payload.as_ref().map(Vec::len))).collect::<Vec<_>>()
        };
        let backend = db.backend();
        assert_eq!(page(None, true).await, [(1, Some(sizes[0])), (2, Some(sizes[1])), (3, Some(10))], "{backend}");
        assert_eq!(page(Some(3), true).await, [(4, Some(sizes[3]))], "{backend}");
        assert_eq!(page(Some(4), true).await, [(5, Some(10))], "{backend}");
        assert_eq!(page(None, false).await, (1..=5).map(|seq| (seq, None)).collect::<Vec<_>>(), "{backend}");
    }
}

/// Checks one case on `db` in both modes; `Err` describes the first difference.
async fn check(db: &Db, case: &Case) -> Result<(), String> {
    let empty = match db {
        Db::Postgres(_) => "DELETE FROM outbox.records",
        Db::Sqlite(_) | Db::MySql(_) => "DELETE FROM outbox_records",
    };
    db.execute(empty, &[]).await.unwrap();
    for (partition, key, first, step, states) in &case.keys {
        for (i, state) in states.iter().enumerate() {
            insert(db, *partition, key, first + i as i64 * step, *state).await;
        }
    }
    let instance = hold(db, &[0, 1, 2, 3], Epoch(1)).await;
    for stop_on_first_failure in [true, false] {
        let outbox = Outbox::new(Config { stop_on_first_failure, ..Config::default() }).unwrap();
        let followers = if stop_on_first_failure { case.followers } else { 0 };
        let request = Request {
            instance,
            partitions: case
                .order
                .iter()
                .map(|&p| {
                    (
                        p as u8,
                        if case.unheld.contains(&p) { Epoch(2) } else { Epoch(1) },
                        case.cursors[p as usize].clone(),
                    )
                })
                .collect(),
            exclude: case.exclude.clone(),
            limit: case.limit,
            followers,
            budget: case.budget,
        };
        let found: Found = db.fetch(outbox.statements(), &request).await.map_err(|e| e.to_string())?;
        let walk = match db {
            Db::MySql(_) => super::mysql::walk_records(&request),
            Db::Postgres(_) | Db::Sqlite(_) => usize::MAX,
        };
        let (heads, want, stopped) = model(case, followers, stop_on_first_failure, walk);
        let got: BTreeMap<String, Vec<i64>> = found
            .runs
            .iter()
            .map(|run| (run[0].record.key.clone(), run.iter().map(|f| f.record.seq).collect()))
            .collect();
        let mode = if stop_on_first_failure { "stop on first failure" } else { "no stop" };
        if got.keys().ne(want.keys()) {
            return Err(format!(
                "{mode}: keys {:?}, want {:?}",
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>()
            ));
        }
        // Each run: a prefix of the key's due records from the head, holding at least what the byte
        // budget admits (the head always), and within the budget unless it is the head alone.
        for (key, all) in &want {
            let due: Vec<i64> = all.iter().take_while(|r| r.1).map(|r| r.0).collect();
            let kept = &got[key];
            let mut sum = 0;
            let admitted = all
                .iter()
                .take_while(|r| {
                    sum += size(key, r.0);
                    r.0 == all[0].0 || sum <= case.budget
                })
                .count()
                .min(due.len());
            let bytes: usize = kept.iter().map(|&seq| size(key, seq)).sum();
            if !(kept.len() <= due.len() && kept[..] == due[..kept.len()] && kept.len() >= admitted) {
                return Err(format!("{mode}: {key}: kept {kept:?} of {all:?} ({admitted} admitted)"));
            }
            if kept.len() > 1 && bytes > case.budget {
                return Err(format!("{mode}: {key}: {bytes} bytes kept"));
            }
        }
        // Each partition's last head in walk order, and where the walk was cut: at the last head of a
        // full batch, else where a walk that read all it may stopped (which moves on from there).
        let mut last: BTreeMap<u8, String> = BTreeMap::new();
        for (partition, key) in &heads {
            last.insert(*partition as u8, key.clone());
        }
        let mut cut_in = None;
        if heads.len() == case.limit {
            cut_in = heads.last().map(|(partition, _)| *partition as u8);
        } else if let Some((partition, key)) = stopped {
            last.insert(partition as u8, key);
            cut_in = Some(partition as u8);
        }
        if found.last_served != last {
            return Err(format!("{mode}: last served {:?}, want {last:?}", found.last_served));
        }
        if found.cut_in != cut_in {
            return Err(format!("{mode}: cut in {:?}, want {cut_in:?}", found.cut_in));
        }
    }
    Ok(())
}

/// The fetch finds what the model says, on every backend, in both modes, for random backlogs: keys with
/// FAILED and backing-off records anywhere and gaps between their sequence numbers, keys in flight,
/// partitions served in a random order (some not at all, some no longer held at the requested epoch),
/// a start key per partition, limits that cut the walk off, byte budgets that cut runs short.
#[sqlx::test(migrations = false)]
async fn fetch_finds_what_the_model_says(pool: PgPool) {
    for db in backends(pool).await {
        migrated(&db, Config::default()).await;
        let cases = if matches!(db, Db::Postgres(_)) { 64 } else { 256 };
        let mut runner = TestRunner::deterministic();
        for _ in 0..cases {
            let case = case().new_tree(&mut runner).unwrap().current();
            if let Err(difference) = check(&db, &case).await {
                panic!("{}: {difference}\n{case:#?}", db.backend());
            }
        }
    }
}

/// Connecting says what went wrong, typed: a scheme this build does not know, a URL that does not parse,
/// a server that does not answer (naming backend and address, and transient: it may come up).
#[tokio::test]
async fn connect_errors_are_typed_and_name_the_database() {
    let err = Db::connect("oracle://root@127.0.0.1/test").await.unwrap_err();
    assert!(matches!(&err, Error::UnsupportedUrl { scheme, .. } if scheme == "oracle"), "{err:?}");
    for scheme in ["postgres://", "sqlite://", "mysql://", "mariadb://"] {
        assert!(err.to_string().contains(scheme), "{err}");
    }
    let err = Db::connect("mysql://root@127.0.0.1:notaport/test").await.unwrap_err();
    assert!(matches!(err, Error::BadUrl(_)), "{err:?}");
    let err = Db::connect("postgres://root@127.0.0.1:notaport/test").await.unwrap_err();
    assert!(matches!(err, Error::BadUrl(_)), "{err:?}");
    let err = Db::connect("sqlite://db?nonsense=1").await.unwrap_err();
    assert!(matches!(err, Error::BadUrl(_)), "{err:?}");

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let quick = ConnectOptions { max_connections: 1, acquire_timeout: std::time::Duration::from_millis(300) };
    let err = Db::connect_with(&format!("postgres://root@127.0.0.1:{port}/test"), &quick).await.unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    assert!(
        err.to_string().starts_with(&format!("cannot connect to PostgreSQL database \"test\" at 127.0.0.1:{port} (")),
        "{err}"
    );
    assert!(err.is_transient(), "{err:?}");
    // A server (or a proxy before it) that ends each connection unanswered, as one going down does: sqlx
    // reads that end, at its TLS request, as a protocol error; transient all the same.
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closing_port = closing.local_addr().unwrap().port();
    let closer = tokio::spawn(async move {
        while let Ok((mut socket, _)) = closing.accept().await {
            // The client's first message read, so that closing sends an end (FIN), not a reset.
            let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut [0; 64]).await;
        }
    });
    let url = format!("postgres://root@127.0.0.1:{closing_port}/test");
    let err = Error::Database(<sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap_err());
    assert!(err.is_transient(), "{err:?}");
    closer.abort();
    let err = Db::connect_with(&format!("mysql://root@127.0.0.1:{port}/test"), &quick).await.unwrap_err();
    assert!(
        err.to_string().starts_with(&format!("cannot connect to MySQL database \"test\" at 127.0.0.1:{port} (")),
        "{err}"
    );
    assert!(err.is_transient(), "{err:?}");
    // A server that answers but has no such database: named, and not worth retrying.
    #[cfg(feature = "mysql")]
    {
        let base = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".into());
        let err = Db::connect_with(&format!("{base}/outbox_no_such_database"), &quick).await.unwrap_err();
        assert!(matches!(err, Error::Connect { .. }), "{err:?}");
        assert!(err.to_string().contains("MySQL database \"outbox_no_such_database\" at "), "{err}");
        assert!(err.to_string().contains("Unknown database"), "{err}");
        assert!(!err.is_transient(), "{err:?}");
    }
    let err = Db::connect("sqlite:///nonexistent-directory/outbox.db").await.unwrap_err();
    assert!(err.to_string().contains("the SQLite database /nonexistent-directory/outbox.db"), "{err}");
}

/// A new pool reaches the same database with the same settings: on SQLite the synchronous mode a
/// caller chose (here `NORMAL`, 1, not the default `FULL`, 2).
#[tokio::test]
async fn a_new_pool_keeps_the_connection_settings() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("settings.db").display());
    let options = super::sqlite::options(&url).unwrap().synchronous(sqlx::sqlite::SqliteSynchronous::Normal);
    let db = Db::from(sqlx::SqlitePool::connect_with(options).await.unwrap());
    db.execute("CREATE TABLE marker (id INTEGER)", &[]).await.unwrap();
    let other = db.new_pool(&ConnectOptions { max_connections: 2, ..ConnectOptions::default() }).await.unwrap();
    let (synchronous,): (i64,) = other.fetch_one("PRAGMA synchronous", &[]).await.unwrap();
    assert_eq!(synchronous, 1);
    let (tables,): (i64,) =
        other.fetch_one("SELECT count(*) FROM sqlite_master WHERE name = 'marker'", &[]).await.unwrap();
    assert_eq!(tables, 1, "the same database file");
}

/// After a failover the old primary's open connections answer every write "read-only", while a new
/// connection reaches the new primary by its address. The pool closes the connections opened before
/// that answer instead of handing them out again (until their `max_lifetime`, half an hour), so the
/// retried write gets a new one. A session turned read-only stands in for the server, which other
/// tests share.
#[sqlx::test]
async fn a_read_only_answer_retires_the_connections_opened_before_it(pool: PgPool) {
    for db in [Db::Postgres(pool), super::mysql::test_database().await] {
        let (session, read_only) = match db {
            Db::Postgres(_) => ("SELECT pg_backend_pid()::bigint", "SET SESSION default_transaction_read_only = on"),
            Db::MySql(_) => ("SELECT CAST(CONNECTION_ID() AS SIGNED)", "SET SESSION TRANSACTION READ ONLY"),
            Db::Sqlite(_) => unreachable!(),
        };
        let one = db.new_pool(&ConnectOptions { max_connections: 1, ..ConnectOptions::default() }).await.unwrap();
        let outbox = migrated(&one, Config::default()).await;
        let (old,): (i64,) = one.fetch_one(session, &[]).await.unwrap();
        one.execute(read_only, &[]).await.unwrap();
        let record = [NewRecord::new("k", "t", b"x".to_vec())];

        let mut tx = one.begin().await.unwrap();
        let refused = outbox.schedule_batch(&mut tx, &record).await.unwrap_err();
        drop(tx);
        assert!(refused.is_transient(), "{}: {refused:?}", db.backend());

        // Tried again as an application would (the mark moves at most once a second, and may have
        // moved just before this pool's connection was opened).
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let mut tx = one.begin().await.unwrap();
            match outbox.schedule_batch(&mut tx, &record).await {
                Ok(_) => break tx.commit().await.unwrap(),
                Err(e) => assert!(tokio::time::Instant::now() < deadline, "{}: still refused: {e:?}", db.backend()),
            }
            drop(tx);
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        let (new,): (i64,) = one.fetch_one(session, &[]).await.unwrap();
        assert_ne!(old, new, "{}: a new connection", db.backend());
    }
}

/// A `begin` dropped at any point, even while its `BEGIN` is in flight, leaves no transaction open on
/// the pooled connection: the pool's next statement commits as it runs, so another connection sees its
/// row (inside a transaction left open it would not, and would hold its locks). The application's
/// `Db::begin`, the outbox's own begin (completions, ownership rounds) and `migrate` are swept.
#[sqlx::test(migrations = false)]
async fn a_dropped_begin_leaves_no_transaction_open(pool: PgPool) {
    use futures::FutureExt;
    use futures::future::BoxFuture;
    let dir = tempfile::tempdir().unwrap();
    let file = Db::connect(&format!("sqlite://{}", dir.path().join("dropped.db").display())).await.unwrap();
    for db in [Db::Postgres(pool), file, super::mysql::test_database().await] {
        db.execute("CREATE TABLE dropped_begins (step BIGINT)", &[]).await.unwrap();
        let single = db.new_pool(&ConnectOptions { max_connections: 1, ..ConnectOptions::default() }).await.unwrap();
        let own = || -> BoxFuture<'static, ()> {
            match single.clone() {
                Db::Postgres(pool) => async move {
                    let statements =
                        super::postgres::PgStatements::new("outbox", true, true, std::time::Duration::from_secs(10));
                    let began =
                        super::finishing(&pool, async |conn| super::postgres::begin(conn, &statements).await.map(drop));
                    drop(began.await)
                }
                .boxed(),
                Db::Sqlite(pool) => async move { drop(super::sqlite::write(&pool).await) }.boxed(),
                Db::MySql(pool) => async move {
                    let begin = super::mysql::begin_statement(std::time::Duration::from_secs(10));
                    let began = super::finishing(&pool, async |conn| {
                        super::mysql::transaction(conn, &begin, async |_| Ok::<_, sqlx::Error>(())).await
                    });
                    drop(began.await)
                }
                .boxed(),
            }
        };
        let outbox = Outbox::new(Config::default()).unwrap();
        let migrate = || -> BoxFuture<'static, ()> {
            let (outbox, single) = (outbox.clone(), single.clone());
            async move { drop(outbox.migrate(&single).await) }.boxed()
        };
        let mut rows = 0;
        for polls in 0..12 {
            for gap in [0, 20, 100].map(std::time::Duration::from_micros) {
                let begins =
                    [("Db::begin", single.begin().map(drop).boxed()), ("own begin", own()), ("migrate", migrate())];
                for (name, begin) in begins {
                    dropped_after(begin, polls, gap).await;
                    let dropped = format!("{name} at poll {polls} ({gap:?} apart)");
                    commits_at_once(&db, &single, "dropped_begins", &mut rows, &dropped).await;
                }
            }
        }
    }
}

/// Writes row number `rows` into `table` on `single` (one connection) and checks that `db` sees all of
/// them: it would not if `dropped` had left a transaction open on that connection.
async fn commits_at_once(db: &Db, single: &Db, table: &str, rows: &mut i64, dropped: &str) {
    let insert = format!("INSERT INTO {table} (step) VALUES ($1)");
    single.execute(AssertSqlSafe(insert), &[(*rows).into()]).await.unwrap();
    *rows += 1;
    let (seen,): (i64,) = db.fetch_one(AssertSqlSafe(format!("SELECT count(*) FROM {table}")), &[]).await.unwrap();
    assert_eq!(seen, *rows, "{}: a row written after dropping {dropped}", db.backend());
}

/// Polls `fut` up to `polls` times, `gap` of real time apart (a server answers meanwhile), and drops it
/// unless it finished first: a drop point anywhere in a round trip, where a timer (1 ms grain) cannot
/// place one.
async fn dropped_after(fut: impl Future<Output = ()>, polls: u32, gap: std::time::Duration) {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..polls {
        if futures::poll!(fut.as_mut()).is_ready() {
            return;
        }
        std::thread::sleep(gap);
        tokio::task::yield_now().await;
    }
}

/// A statement's time limit and a full database are worth retrying on every backend, as they are on
/// PostgreSQL: the processor writes a delivered record FAILED on an error it takes as permanent.
#[sqlx::test(migrations = false)]
async fn a_time_limit_and_a_full_database_are_worth_retrying(pool: PgPool) {
    for db in backends(pool).await {
        let backend = db.backend();
        let err = match db {
            Db::Postgres(_) => {
                let mut tx = db.begin().await.unwrap();
                tx.execute("SET LOCAL statement_timeout = 10", &[]).await.unwrap();
                tx.execute("SELECT pg_sleep(1)", &[]).await.unwrap_err()
            }
            Db::MySql(_) => {
                let late = db.execute("SET STATEMENT max_statement_time = 0.01 FOR SELECT SLEEP(1)", &[]).await;
                assert!(late.unwrap_err().is_transient(), "{backend}: a statement past its time limit");
                // A table that is full answers 1114 (InnoDB's out of disk or tablespace, not 1021,
                // MyISAM's); a MEMORY table past its size limit answers the same, on one connection.
                let mut tx = db.begin().await.unwrap();
                tx.execute("SET SESSION max_heap_table_size = 16384", &[]).await.unwrap();
                tx.execute("CREATE TEMPORARY TABLE filler (b VARBINARY(1000)) ENGINE = MEMORY", &[]).await.unwrap();
                let mut full = None;
                while full.is_none() {
                    full = tx.execute("INSERT INTO filler VALUES (REPEAT('x', 1000))", &[]).await.err();
                }
                full.unwrap()
            }
            Db::Sqlite(_) => {
                // The test pool has one connection, so the page limit holds for the insert.
                db.execute("CREATE TABLE filler (b BLOB)", &[]).await.unwrap();
                let (pages,): (i64,) = db.fetch_one("PRAGMA page_count", &[]).await.unwrap();
                db.execute_script(sqlx::AssertSqlSafe(format!("PRAGMA max_page_count = {}", pages + 2))).await.unwrap();
                db.execute("INSERT INTO filler VALUES (zeroblob(1000000))", &[]).await.unwrap_err()
            }
        };
        assert!(err.is_transient(), "{backend}: {err:?}");
    }
}

/// A session PostgreSQL ends because its transaction sat idle past the limit the library sets
/// (`idle_in_transaction_session_timeout`: a process stalled between a completion's statements) is
/// worth retrying; it was taken for a refusal of the records, which then were written one at a time and
/// could turn FAILED after their handlers had succeeded.
#[sqlx::test(migrations = false)]
async fn a_transaction_ended_for_sitting_idle_is_worth_retrying(pool: PgPool) {
    let db = Db::Postgres(pool);
    let mut tx = db.begin().await.unwrap();
    tx.execute("SET LOCAL idle_in_transaction_session_timeout = 50", &[]).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let err = tx.execute("SELECT 1", &[]).await.unwrap_err();
    assert!(err.is_transient(), "{err:?}");
}

/// Pool settings out of range are a configuration error naming the field, before anything is dialled:
/// a wait past `Instant`'s range panicked inside sqlx, and an empty pool waited its whole
/// `acquire_timeout` to fail as if the database were down.
#[sqlx::test(migrations = false)]
async fn bad_pool_settings_are_a_typed_error(pool: PgPool) {
    let postgres = Db::Postgres(pool);
    let cases = [
        (ConnectOptions { max_connections: 0, ..ConnectOptions::default() }, "max_connections"),
        (ConnectOptions { acquire_timeout: std::time::Duration::MAX, ..ConnectOptions::default() }, "acquire_timeout"),
        (ConnectOptions { acquire_timeout: std::time::Duration::ZERO, ..ConnectOptions::default() }, "acquire_timeout"),
    ];
    for (options, field) in cases {
        let connected = Db::connect_with("sqlite::memory:", &options).await;
        assert!(matches!(&connected, Err(Error::Config(m)) if m.contains(field)), "{field}: {connected:?}");
        let sized = postgres.new_pool(&options).await;
        assert!(matches!(&sized, Err(Error::Config(m)) if m.contains(field)), "{field}: {sized:?}");
    }
}

/// A `schedule` on a connection outside any transaction, dropped at any point (a request's time limit),
/// leaves no transaction open on it: the connection's next statement commits as it runs, so another
/// connection sees its row. Inside a transaction left open it would not, and the next borrower of the
/// pooled connection would write, uncommitted, inside it. Not MySQL, whose `schedule` begins a
/// transaction of its own there and cannot arm its rollback before the `BEGIN` is answered on a
/// borrowed connection (transact-rs/sqlx#4393; see `Conn::schedule`): it fails here at some drop points.
#[sqlx::test(migrations = false)]
async fn a_dropped_schedule_leaves_no_transaction_open(pool: PgPool) {
    use futures::FutureExt;
    let dir = tempfile::tempdir().unwrap();
    let file = Db::connect(&format!("sqlite://{}", dir.path().join("dropped.db").display())).await.unwrap();
    for db in [Db::Postgres(pool), file] {
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(db.clone()).await.unwrap();
        db.execute("CREATE TABLE dropped_schedules (step BIGINT)", &[]).await.unwrap();
        let single = db.new_pool(&ConnectOptions { max_connections: 1, ..ConnectOptions::default() }).await.unwrap();
        let mut rows = 0;
        for polls in 0..16 {
            for gap in [0, 20, 100].map(std::time::Duration::from_micros) {
                let schedule = match single.clone() {
                    Db::Postgres(pool) => {
                        let outbox = outbox.clone();
                        async move {
                            let mut conn = pool.acquire().await.unwrap();
                            drop(outbox.schedule(&mut *conn, NewRecord::new("k", "t", "")).await);
                        }
                        .boxed()
                    }
                    Db::Sqlite(pool) => {
                        let outbox = outbox.clone();
                        async move {
                            let mut conn = pool.acquire().await.unwrap();
                            drop(outbox.schedule(&mut *conn, NewRecord::new("k", "t", "")).await);
                        }
                        .boxed()
                    }
                    #[allow(unreachable_patterns)]
                    _ => unreachable!("PostgreSQL and SQLite only"),
                };
                dropped_after(schedule, polls, gap).await;
                let dropped = format!("a schedule at poll {polls} ({gap:?} apart)");
                commits_at_once(&db, &single, "dropped_schedules", &mut rows, &dropped).await;
            }
        }
    }
}

/// A migration that waits for a table lock another transaction holds (a `pg_dump`, a long report, a
/// transaction left open after a `schedule`) gives up its place in the lock queue after a while and
/// tries again: waiting on, it held up every statement on the table behind it, the workers' heartbeats
/// included, for as long as the other transaction lasted (on MySQL up to `lock_wait_timeout`, a year by
/// default). The migrator's connection keeps its own lock wait after.
#[sqlx::test(migrations = false)]
async fn a_migration_waiting_for_a_table_lock_lets_the_others_through(pool: PgPool) {
    for db in [Db::Postgres(pool), super::mysql::test_database().await] {
        let backend = db.backend();
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(db.clone()).await.unwrap();
        // The migrations from the one that alters the table the heartbeats write undone, as on a
        // database the new release has not migrated yet.
        let migrations = db.migrations();
        let from = migrations.iter().position(|m| m.name == "ended leases").unwrap();
        let undone: Vec<&str> = migrations[from..].iter().map(|m| m.name).collect();
        let known = ["ended leases", "migration_compatibility", "due_heads", "quiet_periods"];
        assert!(
            undone.iter().all(|m| known.contains(m)),
            "{backend}: the undo below is that of {known:?}, not {undone:?}"
        );
        let (instances, applied) = (db.table("outbox", "instances"), db.table("outbox", "schema_migrations"));
        let mut undo = format!(
            "ALTER TABLE {instances} DROP COLUMN taken_over_at; ALTER TABLE {applied} DROP COLUMN older_versions_run;
             DELETE FROM {applied} WHERE version >= {};",
            migrations[from].version
        );
        if undone.contains(&"due_heads") {
            undo.push_str("DROP INDEX outbox.records_ready, outbox.records_held, outbox.records_waiting;");
        }
        if undone.contains(&"quiet_periods") {
            let partitions = db.table("outbox", "partitions");
            undo.push_str(&format!("ALTER TABLE {partitions} DROP COLUMN quiet_until;"));
        }
        db.execute_script(AssertSqlSafe(undo)).await.unwrap();
        let waiting = match db {
            Db::MySql(_) => {
                "SELECT count(*) FROM information_schema.processlist
                 WHERE db = DATABASE() AND state = 'Waiting for table metadata lock'"
            }
            _ => "SELECT count(*) FROM pg_locks WHERE relation = 'outbox.instances'::regclass AND NOT granted",
        };

        let mut reader = db.begin().await.unwrap();
        reader.execute(AssertSqlSafe(format!("SELECT count(*) FROM {instances}")), &[]).await.unwrap();
        // The migrator's pool: one connection, whose session is read after.
        let own = db.new_pool(&ConnectOptions { max_connections: 1, ..ConnectOptions::default() }).await.unwrap();
        let migrating = tokio::spawn({
            let (outbox, own) = (outbox.clone(), own.clone());
            async move { outbox.migrate(own).await }
        });
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while db.fetch_one::<(i64,)>(waiting, &[]).await.unwrap().0 == 0 {
            assert!(tokio::time::Instant::now() < deadline, "{backend}: the migration never asked for the table");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // A heartbeat's statement, queued behind the migration's request.
        let renewal = db.execute(AssertSqlSafe(format!("UPDATE {instances} SET name = name")), &[]);
        tokio::time::timeout(std::time::Duration::from_secs(30), renewal)
            .await
            .unwrap_or_else(|_| panic!("{backend}: a statement on the table waited for as long as the reader lasted"))
            .unwrap();
        reader.commit().await.unwrap();
        migrating.await.unwrap().unwrap();
        let column = format!("SELECT count(taken_over_at) FROM {instances}");
        db.fetch_one::<(i64,)>(AssertSqlSafe(column), &[]).await.expect("migrated once the reader was done");
        if let Db::MySql(_) = own {
            let kept = "SELECT CAST(@@SESSION.lock_wait_timeout = @@GLOBAL.lock_wait_timeout AS SIGNED)";
            assert_eq!(own.fetch_one::<(i64,)>(kept, &[]).await.unwrap().0, 1, "the session keeps its own lock wait");
        }
    }
}

/// A role that may read and write the outbox's tables but create nothing (an application's role, the
/// tables made by an owner's migration) runs `migrate` with nothing pending: every pod calls it at
/// start, and it failed with "permission denied" at the migrations table it had only to read.
#[sqlx::test(migrations = false)]
async fn migrate_with_nothing_pending_needs_no_right_to_create(pool: PgPool) {
    let outbox = Outbox::new(Config::default()).unwrap();
    for db in backends(pool).await {
        let backend = db.backend();
        let role = format!("outbox_app_{}", uuid::Uuid::now_v7().simple());
        let (grants, drop_role) = match &db {
            Db::Sqlite(_) => continue, // no roles
            Db::Postgres(_) => (
                vec![
                    format!("CREATE ROLE {role} LOGIN PASSWORD 'app-secret'"),
                    format!("GRANT USAGE ON SCHEMA outbox TO {role}"),
                    format!("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA outbox TO {role}"),
                ],
                vec![format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")],
            ),
            Db::MySql(_) => (
                vec![
                    format!("CREATE USER '{role}'@'%' IDENTIFIED BY 'app-secret'"),
                    format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {}.* TO '{role}'@'%'", database(&db).await),
                ],
                vec![format!("DROP USER '{role}'@'%'")],
            ),
        };
        outbox.migrate(&db).await.unwrap();
        for sql in grants {
            db.execute_script(AssertSqlSafe(sql)).await.unwrap();
        }
        // The role's own password: a server that does not trust loopback asks for it.
        let app = match &db {
            Db::Postgres(pool) => {
                let options = pool.connect_options().as_ref().clone().username(&role).password("app-secret");
                PgPool::connect_with(options).await.map(Db::Postgres)
            }
            Db::MySql(pool) => {
                let options = pool.connect_options().as_ref().clone().username(&role).password("app-secret");
                sqlx::MySqlPool::connect_with(options).await.map(Db::MySql)
            }
            Db::Sqlite(_) => unreachable!(),
        };
        let migrated = match app {
            Ok(app) => {
                let migrated = outbox.migrate(&app).await.map_err(|e| e.to_string());
                app.close().await;
                migrated
            }
            Err(e) => Err(format!("connecting as the role: {e}")),
        };
        for sql in drop_role {
            db.execute_script(AssertSqlSafe(sql)).await.unwrap();
        }
        migrated.unwrap_or_else(|e| panic!("{backend}: {e}"));
    }
}

/// The database `db` is connected to.
async fn database(db: &Db) -> String {
    let (name,): (String,) = db.fetch_one("SELECT DATABASE()", &[]).await.unwrap();
    name
}

/// A pruning pass reads each key row once: it goes on from where its last batch ended. Each batch
/// started over from the first key row and probed the records of every key that still had some, so
/// behind 300,000 such keys each batch of 5,000 took 0.8 s. Counted here as index lookups (the
/// server's own counters, read on the pass's one connection): 2,000 keys with a record before 100
/// without, read 10 at a time.
#[sqlx::test(migrations = false)]
async fn a_prune_pass_reads_each_key_row_once(pool: PgPool) {
    for db in backends(pool).await {
        let db = match db {
            Db::Postgres(pool) => Db::Postgres(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect_with((*pool.connect_options()).clone())
                    .await
                    .unwrap(),
            ),
            Db::MySql(pool) => Db::MySql(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect_with((*pool.connect_options()).clone())
                    .await
                    .unwrap(),
            ),
            Db::Sqlite(_) => continue, // keeps no key rows
        };
        let outbox = migrated(&db, Config::default()).await;
        let live: Vec<NewRecord> = (0..2_000).map(|k| NewRecord::new(format!("a-{k:04}"), "t", "")).collect();
        let gone: Vec<NewRecord> = (0..100).map(|k| NewRecord::new(format!("z-{k:03}"), "gone", "")).collect();
        commit(&outbox, &db, &live).await;
        commit(&outbox, &db, &gone).await;
        let records = db.table("outbox", "records");
        db.execute(AssertSqlSafe(format!("DELETE FROM {records} WHERE event_type = 'gone'")), &[]).await.unwrap();
        let before = index_lookups(&db).await;
        assert_eq!(outbox.prune_keys(&db, 10).await.unwrap(), 100, "{}", db.backend());
        let lookups = index_lookups(&db).await - before;
        // A probe per key row and a few per statement: 2,100 on PostgreSQL, about 4,500 on MySQL (whose
        // deletes look keys up too). Reading every record again each batch made 22,100 on PostgreSQL.
        assert!(lookups <= 3 * 2_100, "{}: {lookups} index lookups to prune 100 of 2,100 key rows", db.backend());
    }
}

/// Index lookups this connection made so far (a pool of one): PostgreSQL's index scans of the records,
/// flushed to its statistics first; MySQL's `Handler_read_key`.
async fn index_lookups(db: &Db) -> i64 {
    match db {
        Db::Postgres(_) => {
            db.execute("SELECT pg_stat_force_next_flush()", &[]).await.unwrap();
            let (scans,): (i64,) = db
                .fetch_one(
                    "SELECT coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname = 'records'",
                    &[],
                )
                .await
                .unwrap();
            scans
        }
        _ => {
            let (_, reads): (String, String) =
                db.fetch_one("SHOW SESSION STATUS LIKE 'Handler_read_key'", &[]).await.unwrap();
            reads.parse().unwrap()
        }
    }
}

/// Requeuing every FAILED record goes a batch at a time, each committed: a call given up part way
/// (here behind a record another transaction holds) keeps the batches before it, and the next call
/// requeues the rest, each record once. As one statement, a call given up (an HTTP request a proxy
/// timed out, after an outage that failed millions) rolled back all it had done. (SQLite, whose write
/// lock is the whole database's, has its own test.)
#[sqlx::test(migrations = false)]
async fn requeuing_all_failed_records_keeps_the_batches_done(pool: PgPool) {
    for db in backends(pool).await {
        if matches!(db, Db::Sqlite(_)) {
            continue;
        }
        let outbox =
            migrated(&db, Config { query_timeout: std::time::Duration::from_secs(60), ..Config::default() }).await;
        let records: Vec<NewRecord> = (0..2_500).map(|k| NewRecord::new(format!("k-{k:04}"), "t", "")).collect();
        commit(&outbox, &db, &records).await;
        let table = db.table("outbox", "records");
        let fail = match db {
            Db::Postgres(_) => format!("UPDATE {table} SET failed_at = now(), attempts = 3"),
            _ => format!("UPDATE {table} SET failed_at = UTC_TIMESTAMP(6), attempts = 3"),
        };
        db.execute(AssertSqlSafe(fail), &[]).await.unwrap();
        let count = |sql: String| {
            let db = db.clone();
            async move { db.fetch_one::<(i64,)>(AssertSqlSafe(sql), &[]).await.unwrap().0 }
        };
        // The 2,101st in the order batches take them (in the third batch), locked by its id.
        let quote = if matches!(db, Db::Postgres(_)) { "" } else { "`" };
        let nth = format!(
            "SELECT id FROM {table} ORDER BY {quote}partition{quote}, {quote}key{quote}, seq LIMIT 1 OFFSET 2100"
        );
        let (id,): (uuid::Uuid,) = db.fetch_one(AssertSqlSafe(nth), &[]).await.unwrap();
        let mut holder = db.begin().await.unwrap();
        holder
            .execute(AssertSqlSafe(format!("SELECT id FROM {table} WHERE id = $1 FOR UPDATE")), &[id.into()])
            .await
            .unwrap();
        let given_up = tokio::time::timeout(std::time::Duration::from_secs(3), outbox.requeue_all(&db)).await;
        assert!(given_up.is_err(), "{}: the call waits behind the record held", db.backend());
        holder.rollback().await.unwrap();
        let failed = format!("SELECT count(*) FROM {table} WHERE failed_at IS NOT NULL");
        assert_eq!(count(failed.clone()).await, 500, "{}: the two batches before it requeued", db.backend());
        assert_eq!(outbox.requeue_all(&db).await.unwrap(), 500, "{}", db.backend());
        assert_eq!(count(failed).await, 0, "{}", db.backend());
        let once = format!("SELECT count(*) FROM {table} WHERE requeues = 1 AND attempts = 0");
        assert_eq!(count(once).await, 2_500, "{}: each record requeued once", db.backend());
    }
}
