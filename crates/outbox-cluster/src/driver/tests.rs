//! The cluster driver conformance suite: each operation's contract (see its method on [`Store`]) checked
//! against every backend: a fresh PostgreSQL database per test, a private in-memory SQLite database and
//! a fresh MySQL database.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_core::{Config, Db, Epoch, Epochs, InstanceId, Outbox, Partition};
use sqlx::{Connection, PgPool};

use super::Store;
use crate::stored::Lease;

/// A migrated outbox on every backend: `pool`'s PostgreSQL database, an in-memory SQLite one and a new
/// MySQL database.
pub(crate) async fn stores(pool: PgPool) -> Vec<Store> {
    let options = outbox_core::driver::sqlite::options("sqlite::memory:").unwrap();
    let sqlite = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options).await.unwrap();
    let outbox = Outbox::new(Config::default()).unwrap();
    let mut stores = Vec::new();
    let mysql = outbox_core::driver::mysql::test_database().await;
    for db in [Db::from(pool), Db::from(sqlite), mysql] {
        outbox.migrate(&db).await.unwrap();
        stores.push(Store::new(db, &outbox, outbox.config().query_timeout));
    }
    stores
}

pub(crate) const DAY: Lease = Lease { live: Duration::from_secs(86_400), heartbeat: Duration::from_millis(700) };
/// A lease that has expired by the time the next statement runs.
const GONE: Lease = Lease { live: Duration::from_millis(1), heartbeat: Duration::from_millis(300) };

pub(crate) async fn registered(store: &Store, lease: Lease) -> InstanceId {
    let id = InstanceId::new();
    store.register(id, "test", lease).await.unwrap();
    if lease.live == GONE.live {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    id
}

pub(crate) async fn target(store: &Store, partitions: impl IntoIterator<Item = Partition>, to: InstanceId) {
    store.set_targets(&partitions.into_iter().map(|p| (p, to)).collect()).await.unwrap();
}

/// Ends `id`'s lease now, keeping its row.
pub(crate) async fn end_lease(store: &Store, id: InstanceId) {
    let ended = match store.db() {
        Db::Postgres(_) => "UPDATE outbox.instances SET expires_at = now() WHERE id = $1",
        Db::MySql(_) => "UPDATE outbox_instances SET expires_at = UTC_TIMESTAMP(6) WHERE id = $1",
        _ => "UPDATE outbox_instances SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1 WHERE id = $1",
    };
    assert_eq!(store.db().execute(ended, &[id.into()]).await.unwrap(), 1, "{}", store.db().backend());
}

fn epochs_of(store_rows: &[crate::stored::PartitionRow], partitions: &[Partition]) -> Epochs {
    store_rows.iter().filter(|r| partitions.contains(&r.partition)).map(|r| (r.partition, r.epoch)).collect()
}

#[sqlx::test(migrations = false)]
async fn a_lease_is_renewed_only_until_it_expires(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let id = InstanceId::new();
        let remaining = store.register(id, "test", DAY).await.unwrap();
        assert!(remaining > Duration::from_secs(86_000) && remaining <= DAY.live, "{backend}: {remaining:?}");
        let mut conn = super::HeartbeatConnection::default();
        let renewed = conn.renew(&store, id, DAY.live, 42).await.unwrap();
        assert!(renewed.is_some_and(|r| r > Duration::from_secs(86_000)), "{backend}: {renewed:?}");

        let dead = registered(&store, GONE).await;
        assert_eq!(
            conn.renew(&store, dead, DAY.live, 0).await.unwrap(),
            None,
            "{backend}: an expired lease stays expired"
        );
        assert_eq!(
            conn.renew(&store, InstanceId::new(), DAY.live, 0).await.unwrap(),
            None,
            "{backend}: unknown instance"
        );

        let live: BTreeSet<InstanceId> = store.view().await.unwrap().live.into_iter().collect();
        assert_eq!(live, BTreeSet::from([id]), "{backend}");
        let instances = store.instances().await.unwrap();
        assert_eq!(
            instances.iter().map(|i| (i.id, i.live, i.draining, i.delivered)).collect::<Vec<_>>(),
            [(id, true, false, 42), (dead, false, false, 0)],
            "{backend}: the renewal reported 42 deliveries"
        );
        let ages: Vec<i64> = instances.iter().map(|i| i.heartbeat_age_ms).collect();
        assert!(
            ages.iter().all(|age| (0..60_000).contains(age)),
            "{backend}: heartbeat ages by database time {ages:?}"
        );

        assert_eq!(store.reap(Duration::from_secs(3600)).await.unwrap(), 0, "{backend}: within the grace");
        // Both leases ended; one declared heartbeats every 300 ms, the other every hour: a row stays
        // until twice its heartbeat has passed since.
        let slow = registered(&store, Lease { heartbeat: Duration::from_secs(3600), ..GONE }).await;
        tokio::time::sleep(2 * GONE.heartbeat).await;
        assert_eq!(
            store.reap(Duration::ZERO).await.unwrap(),
            1,
            "{backend}: only the one expired twice its heartbeat ago"
        );
        store.deregister(slow).await.unwrap();
        store.drain(id).await.unwrap();
        assert!(store.view().await.unwrap().live.is_empty(), "{backend}: a draining instance takes no part");
        store.deregister(id).await.unwrap();
        assert!(store.instances().await.unwrap().is_empty(), "{backend}");
    }
}

#[sqlx::test(migrations = false)]
async fn an_id_registered_again_is_registered_afresh(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        // A registration written whose answer was lost, then drained and expired: the retry under the
        // same id must not fail on the row, nor leave a second one.
        let id = registered(&store, DAY).await;
        let mut conn = super::HeartbeatConnection::default();
        conn.renew(&store, id, GONE.live, 42).await.unwrap();
        store.drain(id).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;

        let remaining = store.register(id, "again", DAY).await.unwrap();
        assert!(remaining > Duration::from_secs(86_000), "{backend}: {remaining:?}");
        let instances = store.instances().await.unwrap();
        assert_eq!(
            instances.iter().map(|i| (i.id, i.name.as_str(), i.live, i.draining, i.delivered)).collect::<Vec<_>>(),
            [(id, "again", true, false, 0)],
            "{backend}"
        );
        assert_eq!(store.view().await.unwrap().live, [id], "{backend}");
        assert!(conn.renew(&store, id, DAY.live, 0).await.unwrap().is_some(), "{backend}: renewable again");
    }
}

#[sqlx::test(migrations = false)]
async fn acquire_takes_free_and_dead_owners_partitions_only_and_bumps_epochs(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let (me, alive, dead, also_dead) = (
            registered(&store, DAY).await,
            registered(&store, DAY).await,
            registered(&store, Lease { heartbeat: Duration::from_millis(1234), ..DAY }).await,
            registered(&store, Lease { heartbeat: Duration::from_millis(2345), ..DAY }).await,
        );
        target(&store, [1, 2], alive).await;
        target(&store, [3, 4], dead).await;
        target(&store, [7], also_dead).await;
        assert_eq!(store.acquire(alive, DAY.heartbeat).await.unwrap().len(), 2, "{backend}");
        assert_eq!(store.acquire(dead, DAY.heartbeat).await.unwrap().len(), 2, "{backend}");
        assert_eq!(store.acquire(also_dead, DAY.heartbeat).await.unwrap().len(), 1, "{backend}");
        end_lease(&store, dead).await;
        end_lease(&store, also_dead).await;

        // Targets: only those that differ are written and reported.
        let mut targets: crate::rebalance::Targets = [1, 2, 3, 4, 5, 7].into_iter().map(|p| (p, me)).collect();
        targets.insert(6, alive);
        let mut changed = store.set_targets(&targets).await.unwrap();
        changed.sort_unstable();
        assert_eq!(changed, [1, 2, 3, 4, 5, 6, 7], "{backend}");
        assert!(store.set_targets(&targets).await.unwrap().is_empty(), "{backend}: nothing changed");

        let before = store.view().await.unwrap().partitions;
        let mut taken = store.acquire(me, DAY.heartbeat).await.unwrap();
        taken.sort_by_key(|t| t.partition);
        let got: Vec<_> = taken.iter().map(|t| (t.partition, t.previous, t.quiet_ms)).collect();
        // 1 and 2 belong to a live owner; 3, 4 and 7 to two dead ones, taken in one acquisition, each
        // quiet for twice its heartbeat interval; 5 is free; 6 is targeted elsewhere.
        assert_eq!(
            got,
            [
                (3, Some(dead), Some(2468)),
                (4, Some(dead), Some(2468)),
                (5, None, None),
                (7, Some(also_dead), Some(4690))
            ],
            "{backend}"
        );
        for t in &taken {
            let old = before.iter().find(|r| r.partition == t.partition).unwrap().epoch;
            assert_eq!(t.epoch, Epoch(old.0 + 1), "{backend}: partition {}", t.partition);
            // When it was taken from an owner that did not give it up; never for a free one.
            assert_eq!(t.taken_over_at.is_some(), t.previous.is_some(), "{backend}: partition {}", t.partition);
        }
        let after = store.view().await.unwrap().partitions;
        for t in &taken {
            let row = after.iter().find(|r| r.partition == t.partition).unwrap();
            assert_eq!(row.taken_over_at, t.taken_over_at, "{backend}: partition {} as stored", t.partition);
            let (stored, returned) = (row.quiet.map(|q| q.as_millis()), t.quiet_ms.map(i128::from));
            let stored_ok = match returned {
                // Read back after the acquisition: no more than it returned, and not ms taken for µs.
                Some(ms) => stored.is_some_and(|left| (ms / 10..=ms).contains(&i128::try_from(left).unwrap())),
                None => stored.is_none(),
            };
            assert!(stored_ok, "{backend}: partition {}: {stored:?} left of {returned:?}", t.partition);
        }
        assert!(store.acquire(me, DAY.heartbeat).await.unwrap().is_empty(), "{backend}: nothing left to take");
        let owned = store.owned(me).await.unwrap();
        assert_eq!(owned, taken.iter().map(|t| (t.partition, t.epoch)).collect(), "{backend}");

        // An owner's row reaped: its partitions (1 and 2, targeted at `me` above) are taken, quiet for
        // twice the acquirer's heartbeat interval.
        store.deregister(alive).await.unwrap();
        let mut taken = store.acquire(me, Duration::from_millis(900)).await.unwrap();
        taken.sort_by_key(|t| t.partition);
        assert_eq!(
            taken.iter().map(|t| (t.partition, t.previous, t.quiet_ms)).collect::<Vec<_>>(),
            [(1, Some(alive), Some(1800)), (2, Some(alive), Some(1800))],
            "{backend}"
        );
    }
}

/// A quiet period outlives the instance that took the partition: whoever takes it next, from that
/// instance's lapsed lease (before it ever renewed) or free once it was released, gets what is left of
/// the period, however short its own or that instance's heartbeat. Before, the next owner waited twice
/// the heartbeat interval of the instance it took the partition from, while the owner the period was
/// for might still be delivering. Once the period is over, nobody waits.
#[sqlx::test(migrations = false)]
async fn a_quiet_period_outlives_the_instance_that_took_the_partition(pool: PgPool) {
    let brief = Lease { heartbeat: Duration::from_millis(10), ..DAY };
    for store in stores(pool).await {
        let backend = store.db().backend();
        let first = registered(&store, Lease { heartbeat: Duration::from_secs(30), ..DAY }).await;
        target(&store, [1, 2], first).await;
        assert_eq!(store.acquire(first, brief.heartbeat).await.unwrap().len(), 2, "{backend}");
        end_lease(&store, first).await;
        let taker = registered(&store, brief).await;
        target(&store, [1, 2], taker).await;
        let taken = store.acquire(taker, brief.heartbeat).await.unwrap();
        assert!(taken.iter().all(|t| t.quiet_ms == Some(60_000)), "{backend}: {taken:?}");
        end_lease(&store, taker).await;

        let (next, last) = (registered(&store, brief).await, registered(&store, brief).await);
        target(&store, [1, 2], next).await;
        let taken = store.acquire(next, brief.heartbeat).await.unwrap();
        let rest = |taken: &[crate::stored::Taken], from: Option<InstanceId>| -> Vec<bool> {
            taken.iter().map(|t| t.previous == from && t.quiet_ms.is_some_and(|ms| ms > 50_000)).collect()
        };
        assert_eq!(rest(&taken, Some(taker)), [true, true], "{backend}: from a lapsed taker: {taken:?}");
        store.release(next, &taken.iter().map(|t| (t.partition, t.epoch)).collect()).await.unwrap();
        target(&store, [1, 2], last).await;
        let taken = store.acquire(last, brief.heartbeat).await.unwrap();
        assert_eq!(rest(&taken, None), [true, true], "{backend}: released: {taken:?}");

        // A period that is over: taken from a dead owner that heartbeated every 50 ms, then released.
        let quick = registered(&store, Lease { heartbeat: Duration::from_millis(50), ..DAY }).await;
        target(&store, [3], quick).await;
        store.acquire(quick, brief.heartbeat).await.unwrap();
        end_lease(&store, quick).await;
        target(&store, [3], last).await;
        let taken = store.acquire(last, brief.heartbeat).await.unwrap();
        assert_eq!(taken.iter().map(|t| t.quiet_ms).collect::<Vec<_>>(), [Some(100)], "{backend}");
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(store.view().await.unwrap().partitions[3].quiet, None, "{backend}: over");
        store.release(last, &taken.iter().map(|t| (t.partition, t.epoch)).collect()).await.unwrap();
        target(&store, [3], next).await;
        let taken = store.acquire(next, brief.heartbeat).await.unwrap();
        assert_eq!(taken.iter().map(|t| (t.previous, t.quiet_ms)).collect::<Vec<_>>(), [(None, None)], "{backend}");
    }
}

#[sqlx::test(migrations = false)]
async fn release_frees_only_what_is_still_held_at_its_epoch(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let (me, other) = (registered(&store, DAY).await, registered(&store, DAY).await);
        target(&store, [7, 8, 9], me).await;
        store.acquire(me, DAY.heartbeat).await.unwrap();
        let rows = store.view().await.unwrap().partitions;
        let mut held = epochs_of(&rows, &[7, 8, 9]);
        held.insert(8, Epoch(held[&8].0 - 1)); // a stale epoch
        held.insert(10, Epoch(0)); // never ours
        let mut released = store.release(me, &held).await.unwrap();
        released.sort_unstable();
        assert_eq!(released, [7, 9], "{backend}");
        assert!(store.release(other, &epochs_of(&rows, &[8])).await.unwrap().is_empty(), "{backend}: not the owner");

        let after = store.view().await.unwrap().partitions;
        for p in [7u8, 9] {
            let (old, new) = (&rows[usize::from(p)], &after[usize::from(p)]);
            assert_eq!((new.owner, new.epoch), (None, Epoch(old.epoch.0 + 1)), "{backend}: partition {p}");
        }
        assert_eq!(store.owned(me).await.unwrap().into_keys().collect::<Vec<_>>(), [8], "{backend}");
        assert_eq!(after.len(), 256, "{backend}");
        let instance = store.instances().await.unwrap().into_iter().find(|i| i.id == me).unwrap();
        assert_eq!(instance.partitions, 1, "{backend}");
    }
}

/// A renewal written before its lease ran out but committed after another instance began to look for
/// partitions to take is waited for: the renewed owner keeps its partitions. Judged from the look's
/// snapshot, the lease seemed expired, and the partitions were taken from an instance that, renewed,
/// went on delivering them. SQLite has one writer at a time, so a renewal in flight holds off every
/// acquisition there.
#[sqlx::test(migrations = false)]
async fn an_acquisition_waits_for_a_renewal_in_flight(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let short = Lease { live: Duration::from_millis(500), heartbeat: Duration::from_millis(100) };
        let (owner, taker) = (registered(&store, short).await, registered(&store, DAY).await);
        target(&store, [7, 8], owner).await;
        assert_eq!(store.acquire(owner, DAY.heartbeat).await.unwrap().len(), 2, "{backend}");
        target(&store, [7, 8], taker).await;
        let (written, renewal_written) = tokio::sync::oneshot::channel();
        let (commit, committing) = tokio::sync::oneshot::channel::<()>();
        let renew = match store.db() {
            Db::Postgres(_) => "UPDATE outbox.instances SET expires_at = now() + interval '1 day' WHERE id = $1",
            Db::MySql(_) => "UPDATE outbox_instances SET expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 DAY WHERE id = $1",
            _ => continue,
        };
        let db = store.db().clone();
        let renewal = tokio::spawn(async move {
            let mut tx = db.begin().await.unwrap();
            tx.execute(renew, &[owner.into()]).await.unwrap();
            written.send(()).unwrap();
            committing.await.unwrap();
            tx.commit().await.unwrap();
        });
        renewal_written.await.unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        let acquiring = tokio::spawn({
            let store = store.clone();
            async move { store.acquire(taker, DAY.heartbeat).await.unwrap() }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        commit.send(()).unwrap();
        renewal.await.unwrap();
        let taken: Vec<Partition> = acquiring.await.unwrap().iter().map(|t| t.partition).collect();
        assert!(taken.is_empty(), "{backend}: took {taken:?} from an owner whose renewal was in flight");
    }
}

/// A renewal that waits for its row behind an acquisition, while the lease runs out, and an acquisition
/// that then finds the lease expired never both succeed: the partitions are not taken from an owner
/// whose lease is renewed, which would go on delivering them beside the new owner. Here the acquisition
/// has locked the owner's row and waits for another owner's row (held by the test) when the renewal
/// comes. Also on a MariaDB started with `--sysdate-is-now` (a setting of some replication setups),
/// where `SYSDATE()` answers the statement's start as `NOW()` does. SQLite has one writer at a time:
/// a renewal never waits inside an acquisition there.
#[sqlx::test(migrations = false)]
async fn a_renewal_that_waited_out_its_lease_behind_a_takeover_revives_nothing(pool: PgPool) {
    let server = OwnMariaDb::start(&["--sysdate-is-now"]).await;
    let mut stores: Vec<(&str, Store)> = stores(pool).await.into_iter().map(|s| (s.db().backend(), s)).collect();
    stores.push(("mysql --sysdate-is-now", server.store().await));
    for (backend, store) in stores {
        let hold = match store.db() {
            Db::Postgres(_) => "SELECT id FROM outbox.instances WHERE id = $1 FOR UPDATE",
            Db::MySql(_) => "SELECT id FROM outbox_instances WHERE id = $1 FOR UPDATE",
            _ => continue,
        };
        let short = Lease { live: Duration::from_millis(500), heartbeat: Duration::from_millis(100) };
        // Ids grow with time: the acquisition meets the owner's row before the other's.
        let (owner, other, taker) =
            (registered(&store, short).await, registered(&store, DAY).await, registered(&store, DAY).await);
        target(&store, [7], owner).await;
        target(&store, [8], other).await;
        assert_eq!(store.acquire(owner, DAY.heartbeat).await.unwrap().len(), 1, "{backend}");
        assert_eq!(store.acquire(other, DAY.heartbeat).await.unwrap().len(), 1, "{backend}");
        target(&store, [7, 8], taker).await;
        let mut holder = store.db().begin().await.unwrap();
        holder.execute(hold, &[other.into()]).await.unwrap();
        let acquisition = tokio::spawn({
            let store = store.clone();
            async move { store.acquire(taker, DAY.heartbeat).await.unwrap() }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let renewal = tokio::spawn({
            let store = store.clone();
            async move { super::HeartbeatConnection::default().renew(&store, owner, short.live, 0).await.unwrap() }
        });
        // The owner's lease runs out while the acquisition waits.
        tokio::time::sleep(Duration::from_millis(800)).await;
        holder.commit().await.unwrap();
        let taken: Vec<Partition> = acquisition.await.unwrap().iter().map(|t| t.partition).collect();
        let renewed = renewal.await.unwrap();
        assert!(
            !(taken.contains(&7) && renewed.is_some()),
            "{backend}: partition 7 was taken from an owner whose lease was renewed ({renewed:?})"
        );
    }
}

/// A reap or an acquisition that waits for one instance's row (here an owner's, held as a renewal in
/// flight or an acquisition whose host vanished would hold it) holds no other instance's: a live
/// bystander renews its lease meanwhile. On MySQL a statement that chose the rows while locking them kept
/// rows it had read locked while it waited for one, so the bystander's renewal waited as long, past its
/// lease if the wait was long enough. SQLite has one writer at a time.
#[sqlx::test(migrations = false)]
async fn a_wait_for_one_instance_row_holds_up_no_other_renewal(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let hold = match store.db() {
            Db::Postgres(_) => "SELECT id FROM outbox.instances WHERE id = $1 FOR UPDATE",
            Db::MySql(_) => "SELECT id FROM outbox_instances WHERE id = $1 FOR UPDATE",
            _ => continue,
        };
        // Ids grow with time: a scan in id order meets the bystander's row first.
        let bystander = registered(&store, DAY).await;
        let expired = registered(&store, GONE).await;
        tokio::time::sleep(2 * GONE.heartbeat).await;
        let (owner, taker) = (registered(&store, DAY).await, registered(&store, DAY).await);
        target(&store, [7], owner).await;
        assert_eq!(store.acquire(owner, DAY.heartbeat).await.unwrap().len(), 1, "{backend}");
        target(&store, [7], taker).await;
        for waiting in ["reap", "acquisition"] {
            let mut holder = store.db().begin().await.unwrap();
            holder.execute(hold, &[owner.into()]).await.unwrap();
            let store2 = store.clone();
            let waiter = tokio::spawn(async move {
                match waiting {
                    "reap" => store2.reap(Duration::ZERO).await.map(|n| vec![n as usize]),
                    _ => store2.acquire(taker, DAY.heartbeat).await.map(|t| vec![t.len()]),
                }
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut heartbeat = super::HeartbeatConnection::default();
            let renewal = heartbeat.renew(&store, bystander, DAY.live, 0);
            let renewed = tokio::time::timeout(Duration::from_secs(3), renewal).await;
            holder.commit().await.unwrap();
            assert!(
                matches!(renewed, Ok(Ok(Some(_)))),
                "{backend}: the bystander's renewal waited behind the {waiting}: {renewed:?}"
            );
            let done = waiter.await.unwrap().unwrap();
            let expected = if waiting == "reap" { 1 } else { 0 };
            assert_eq!(done, [expected], "{backend}: {waiting} reaped {expired} / took from a live owner");
        }
    }
}

/// An owner whose partitions were taken because its lease ran out is never renewed again, even when
/// its expiry reads live once more (the database's clock stepped back; on SQLite, the host's): it
/// would go on delivering them beside their new owner. Nor is it counted live, or as the live owner of
/// the partitions it still holds: the leader gave it a share nobody took, and nobody could take what
/// it held, for as long as the clock had stepped back.
#[sqlx::test(migrations = false)]
async fn a_lease_whose_partitions_were_taken_stays_ended(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let short = Lease { live: Duration::from_millis(300), heartbeat: Duration::from_millis(100) };
        let (owner, taker) = (registered(&store, short).await, registered(&store, DAY).await);
        target(&store, [7, 8], owner).await;
        assert_eq!(store.acquire(owner, DAY.heartbeat).await.unwrap().len(), 2, "{backend}");
        tokio::time::sleep(Duration::from_millis(400)).await;
        target(&store, [7], taker).await;
        let taken = store.acquire(taker, DAY.heartbeat).await.unwrap();
        assert_eq!(taken.iter().map(|t| t.previous).collect::<Vec<_>>(), [Some(owner)], "{backend}");
        let clock_back = match store.db() {
            Db::Postgres(_) => "UPDATE outbox.instances SET expires_at = now() + interval '1 hour' WHERE id = $1",
            Db::MySql(_) => "UPDATE outbox_instances SET expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE id = $1",
            _ => "UPDATE outbox_instances SET expires_at = expires_at + 3600000 WHERE id = $1",
        };
        assert_eq!(store.db().execute(clock_back, &[owner.into()]).await.unwrap(), 1, "{backend}");
        let renewed = super::HeartbeatConnection::default().renew(&store, owner, short.live, 0).await.unwrap();
        assert_eq!(renewed, None, "{backend}: the lease of an owner whose partitions were taken was renewed");
        assert!(!store.view().await.unwrap().live.contains(&owner), "{backend}: counted live");
        target(&store, [8], taker).await;
        assert_eq!(
            store.acquire(taker, DAY.heartbeat).await.unwrap().len(),
            1,
            "{backend}: its other partition not taken"
        );
    }
}

/// An instance whose lease has ended (run out, or ended at a stop) takes nothing, not even partitions
/// targeted at it: a round that began under an id the heartbeat then found declared dead took them
/// under that id, which nothing delivers, and they waited for the leader to target them elsewhere
/// and for a quiet period.
#[sqlx::test(migrations = false)]
async fn an_instance_whose_lease_ended_acquires_nothing(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let (gone, ended) = (registered(&store, GONE).await, registered(&store, DAY).await);
        end_lease(&store, ended).await;
        target(&store, [3], gone).await;
        target(&store, [4], ended).await;
        assert_eq!(
            store.acquire(gone, DAY.heartbeat).await.unwrap().len(),
            0,
            "{backend}: taken under a lease run out"
        );
        assert_eq!(store.acquire(ended, DAY.heartbeat).await.unwrap().len(), 0, "{backend}: taken under a lease ended");
    }
}

/// A MariaDB server of the test's own, with `args`, on a free loopback port, in a directory of its own;
/// stopped when dropped.
struct OwnMariaDb {
    server: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl OwnMariaDb {
    async fn start(args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data = format!("--datadir={}", dir.path().join("data").display());
        // `--user` only as root: the server then runs as root; anyone else cannot switch users (nor needs to).
        let is_root = std::process::Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"));
        let user: &[&str] = if is_root { &["--user=root"] } else { &[] };
        let installed = std::process::Command::new("mariadb-install-db")
            .args(["--no-defaults", &data, "--auth-root-authentication-method=normal", "--skip-test-db"])
            .args(user)
            .output()
            .expect("mariadb-install-db (package mariadb-server; ./scripts/test.sh installs it)");
        assert!(installed.status.success(), "mariadb-install-db: {}", String::from_utf8_lossy(&installed.stderr));
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let socket = format!("--socket={}", dir.path().join("sock").display());
        // Debian puts it in /usr/sbin, which an unprivileged PATH may lack.
        let mariadbd =
            ["/usr/sbin/mariadbd", "/usr/local/sbin/mariadbd"].into_iter().find(|p| std::path::Path::new(p).exists());
        let server = std::process::Command::new(mariadbd.unwrap_or("mariadbd"))
            .args(["--no-defaults", &data, &format!("--port={port}"), "--bind-address=127.0.0.1", &socket])
            .args(user)
            .args(["--skip-grant-tables", "--innodb-buffer-pool-size=32M"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("mariadbd");
        let own = Self { server, port, _dir: dir };
        for _ in 0..300 {
            if sqlx::MySqlConnection::connect(&own.url()).await.is_ok() {
                return own;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("MariaDB on port {port} did not answer within 15 s");
    }

    fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}", self.port)
    }

    /// A migrated outbox in a new database of this server.
    async fn store(&self) -> Store {
        let mut admin = sqlx::MySqlConnection::connect(&self.url()).await.unwrap();
        sqlx::raw_sql("CREATE DATABASE outbox_test").execute(&mut admin).await.unwrap();
        let pool = sqlx::mysql::MySqlPoolOptions::new().connect(&format!("{}/outbox_test", self.url())).await.unwrap();
        let (db, outbox) = (Db::from(pool), Outbox::new(Config::default()).unwrap());
        outbox.migrate(&db).await.unwrap();
        Store::new(db, &outbox, outbox.config().query_timeout)
    }
}

impl Drop for OwnMariaDb {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// Setting targets locks only the partitions whose target changes: a fenced write holding another
/// partition's row (`FOR SHARE`, as every completion does) is not waited for. SQLite has one writer at
/// a time, so there every write waits for the one before.
#[sqlx::test(migrations = false)]
async fn setting_targets_waits_for_no_partition_it_leaves_alone(pool: PgPool) {
    for store in stores(pool).await {
        let backend = store.db().backend();
        let hold = match store.db() {
            Db::Postgres(_) => "SELECT partition FROM outbox.partitions WHERE partition = 7 FOR SHARE",
            Db::MySql(_) => "SELECT `partition` FROM outbox_partitions WHERE `partition` = 7 LOCK IN SHARE MODE",
            _ => continue,
        };
        let (a, b) = (registered(&store, DAY).await, registered(&store, DAY).await);
        target(&store, [7, 8], a).await;
        let mut completion = store.db().begin().await.unwrap();
        completion.execute(hold, &[]).await.unwrap();
        let targets = [(7, a), (8, b)].into_iter().collect();
        let changed = tokio::time::timeout(Duration::from_secs(5), store.set_targets(&targets))
            .await
            .unwrap_or_else(|_| panic!("{backend}: setting targets waited for a partition whose target stays"))
            .unwrap();
        assert_eq!(changed, [8], "{backend}");
        completion.commit().await.unwrap();
        let rows = store.view().await.unwrap().partitions;
        assert_eq!((rows[7].target, rows[8].target), (Some(a), Some(b)), "{backend}");
    }
}

/// An instance's heartbeat age is never in the future. The status read runs in a transaction begun
/// before its statement, and a heartbeat committed in between carried a time later than the
/// transaction's `now()`: the page showed it "-1 ms" old (and a test of the page failed in CI).
#[sqlx::test(migrations = false)]
async fn a_heartbeat_committed_after_the_status_read_began_is_not_in_the_future(pool: PgPool) {
    let store = stores(pool.clone()).await.remove(0);
    let id = registered(&store, DAY).await;
    let statements = super::postgres::PgStatements::new("outbox", Duration::from_secs(10), Duration::from_secs(10));
    let mut reader = pool.acquire().await.unwrap();
    let instances = statements
        .limited(&mut reader, async |conn| {
            tokio::time::sleep(Duration::from_millis(50)).await;
            // A heartbeat commits after the read's transaction began.
            super::HeartbeatConnection::default().renew(&store, id, DAY.live, 0).await.unwrap();
            statements.instances(conn).await
        })
        .await
        .unwrap();
    let ages: Vec<i64> = instances.iter().map(|i| i.heartbeat_age_ms).collect();
    assert!(ages.iter().all(|&age| age >= 0), "heartbeat ages {ages:?}");
}
