//! The object's one alarm: delivery, persistence across hosts, retries.

mod support;

use std::rc::Rc;
use std::time::Duration;

use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext};
use durability_platform::{Context, StorageExt};
use support::{Notes, inline_host, local, notes};

const HOUR_MS: i64 = 3_600_000;

#[tokio::test(start_paused = true)]
async fn an_alarm_fires_at_its_time_and_is_then_cleared() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("a").unwrap();
        let at = host.now_ms() + 10_000;
        stub.call(move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(9)).await;
        let log = stub
            .call(|o: Rc<Notes>| async move { o.alarm_log() })
            .await
            .unwrap()
            .unwrap();
        assert!(log.is_empty());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (log, alarm) = stub
            .call(|o: Rc<Notes>| async move { (o.alarm_log().unwrap(), o.alarm().await.unwrap()) })
            .await
            .unwrap();
        assert_eq!(log, vec![(at, 0)]);
        assert_eq!(alarm, None);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_alarm_in_the_past_fires_at_once() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("past").unwrap();
        let now = host.now_ms();
        stub.call(
            move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(now - HOUR_MS).await },
        )
        .await
        .unwrap()
        .unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        let log = stub
            .call(|o: Rc<Notes>| async move { o.alarm_log() })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(log, vec![(now, 0)]);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_alarm_survives_a_new_host_on_the_same_directory_and_fires() {
    let dir = tempfile::tempdir().unwrap();
    let at = local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("durable").unwrap();
        let at = host.now_ms() + HOUR_MS;
        stub.call(move |o: Rc<Notes>| async move { o.add_with_alarm("armed", at).await })
            .await
            .unwrap()
            .unwrap();
        host.shutdown().await;
        at
    })
    .await;
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(at - 1_000)
            .build()
            .unwrap();
        let notes = notes(&host);
        // Nothing calls the object: the index alone wakes it.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(host.live_objects(), 1, "the alarm constructed the object");
        let stub = notes.stub("durable").unwrap();
        let log = stub
            .call(|o: Rc<Notes>| async move { o.alarm_log() })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(log, vec![(at, 0)]);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_alarm_that_fell_due_while_no_host_ran_fires_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let at = local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("overdue").unwrap();
        let at = host.now_ms() + 60_000;
        stub.call(move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        host.shutdown().await;
        at
    })
    .await;
    let restart_ms = at + 24 * HOUR_MS;
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(restart_ms)
            .build()
            .unwrap();
        let notes = notes(&host);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let log = notes
            .stub("overdue")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.alarm_log() })
            .await
            .unwrap()
            .unwrap();
        // Delivered at the host's first instant, not a moment later.
        assert_eq!(log, vec![(restart_ms, 0)]);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_failing_alarm_is_retried_at_2_4_8_seconds_and_stops_after_6_retries() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .idle_timeout(Duration::from_secs(24 * 3600))
            .build()
            .unwrap();
        let stub = notes(&host).stub("failing").unwrap();
        let at = host.now_ms() + 1_000;
        stub.call(move |o: Rc<Notes>| async move {
            *o.failing_alarms.borrow_mut() = u32::MAX;
            o.ctx.storage().set_alarm(at).await
        })
        .await
        .unwrap()
        .unwrap();
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let (log, infos, alarm) = stub
            .call(|o: Rc<Notes>| async move {
                let infos = o.alarms.borrow().clone();
                (o.alarm_log().unwrap(), infos, o.alarm().await.unwrap())
            })
            .await
            .unwrap();
        let offsets: Vec<i64> = log.iter().map(|(t, _)| t - at).collect();
        assert_eq!(
            offsets,
            vec![0, 2_000, 6_000, 14_000, 30_000, 62_000, 126_000]
        );
        let expected: Vec<AlarmInfo> = (0..=6)
            .map(|retry_count| AlarmInfo {
                retry_count,
                is_retry: retry_count > 0,
            })
            .collect();
        assert_eq!(infos, expected);
        assert_eq!(alarm, None, "the alarm is dropped after its last retry");
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_retried_alarm_that_succeeds_is_cleared() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("recovers").unwrap();
        let at = host.now_ms();
        stub.call(move |o: Rc<Notes>| async move {
            *o.failing_alarms.borrow_mut() = 2;
            o.ctx.storage().set_alarm(at).await
        })
        .await
        .unwrap()
        .unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
        let (log, alarm) = stub
            .call(|o: Rc<Notes>| async move { (o.alarm_log().unwrap(), o.alarm().await.unwrap()) })
            .await
            .unwrap();
        assert_eq!(log, vec![(at, 0), (at + 2_000, 1), (at + 6_000, 2)]);
        assert_eq!(alarm, None);
        host.shutdown().await;
    })
    .await;
}

/// An object whose alarm handler looks at the alarm and re-arms it once.
struct Rearming {
    ctx: ObjectContext,
    seen: std::cell::RefCell<Vec<Option<i64>>>,
}

impl DurableObject for Rearming {
    async fn alarm(&self, _info: AlarmInfo) -> Result<(), BoxError> {
        let storage = self.ctx.storage();
        let before = storage.get_alarm().await?;
        let in_txn = storage.transaction(|txn| txn.get_alarm()).await?;
        self.seen.borrow_mut().push(before);
        self.seen.borrow_mut().push(in_txn);
        if self.seen.borrow().len() == 2 {
            storage.set_alarm(self.ctx.now_ms() + 5_000).await?;
            let after = storage.get_alarm().await?;
            self.seen.borrow_mut().push(after);
        }
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn the_firing_alarm_is_not_reported_while_its_handler_runs_and_a_new_one_stays() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(1_000_000)
            .build()
            .unwrap();
        let ns = host
            .namespace("rearming", |ctx| {
                Ok(Rearming {
                    ctx,
                    seen: Default::default(),
                })
            })
            .unwrap();
        let stub = ns.stub("r").unwrap();
        stub.call(|o: Rc<Rearming>| async move { o.ctx.storage().set_alarm(1_001_000).await })
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (seen, alarm) = stub
            .call(|o: Rc<Rearming>| async move {
                let seen = o.seen.borrow().clone();
                (seen, o.ctx.storage().get_alarm().await.unwrap())
            })
            .await
            .unwrap();
        assert_eq!(seen, vec![None, None, Some(1_006_000)]);
        assert_eq!(alarm, Some(1_006_000), "the alarm the handler set stays");
        tokio::time::sleep(Duration::from_secs(10)).await;
        let (seen, alarm) = stub
            .call(|o: Rc<Rearming>| async move {
                let seen = o.seen.borrow().clone();
                (seen, o.ctx.storage().get_alarm().await.unwrap())
            })
            .await
            .unwrap();
        assert_eq!(seen.len(), 5, "the re-armed alarm fired once more");
        assert_eq!(alarm, None);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn alarms_of_a_namespace_registered_after_start_wait_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let at = local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("late").unwrap();
        let at = host.now_ms() + 1_000;
        stub.call(move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        host.shutdown().await;
        at
    })
    .await;
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(at + 10_000)
            .build()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(host.live_objects(), 0);
        let notes = notes(&host);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let log = notes
            .stub("late")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.alarm_log() })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(log.len(), 1);
        host.shutdown().await;
    })
    .await;
}

/// An object whose alarm handler takes a while, or panics.
struct Slow {
    ctx: ObjectContext,
    panics: bool,
}

impl DurableObject for Slow {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        let storage = self.ctx.storage();
        storage.execute_script("CREATE TABLE IF NOT EXISTS runs (retry_count INTEGER)")?;
        storage.execute(
            "INSERT INTO runs (retry_count) VALUES (?1)",
            &durability_platform::params![info.retry_count],
        )?;
        if self.panics {
            panic!("the alarm handler panics on purpose");
        }
        self.ctx.sleep(Duration::from_secs(10)).await;
        Ok(())
    }
}

fn runs(ctx: &ObjectContext) -> Vec<i64> {
    ctx.storage()
        .query("SELECT retry_count FROM runs", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0).unwrap())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn an_alarm_run_cut_short_by_eviction_is_delivered_again() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let ns = host
            .namespace("slow", |ctx| Ok(Slow { ctx, panics: false }))
            .unwrap();
        let stub = ns.stub("s").unwrap();
        let at = host.now_ms() + 1_000;
        stub.call(move |o: Rc<Slow>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        // The handler is asleep in its run; evicting cuts it short.
        host.evict(stub.id()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        let (runs, alarm) = stub
            .call(|o: Rc<Slow>| async move {
                (runs(&o.ctx), o.ctx.storage().get_alarm().await.unwrap())
            })
            .await
            .unwrap();
        assert_eq!(runs, vec![0, 0], "delivered again after the cut");
        assert_eq!(alarm, None, "cleared once a run completed");
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_panicking_alarm_handler_is_retried_with_backoff_and_others_keep_serving() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .idle_timeout(Duration::from_secs(24 * 3600))
            .build()
            .unwrap();
        let ns = host
            .namespace("panicky", |ctx| Ok(Slow { ctx, panics: true }))
            .unwrap();
        let stub = ns.stub("p").unwrap();
        let at = host.now_ms();
        stub.call(move |o: Rc<Slow>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(7)).await;
        let runs = stub
            .call(|o: Rc<Slow>| async move { runs(&o.ctx) })
            .await
            .unwrap();
        assert_eq!(runs, vec![0, 1, 2], "runs at 0 s, 2 s and 6 s");
        let other = notes(&host).stub("other").unwrap();
        assert!(
            other
                .call(|o: Rc<Notes>| async move { o.add("fine") })
                .await
                .is_ok()
        );
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_object_file_is_the_truth_when_the_index_is_early_or_stale() {
    let dir = tempfile::tempdir().unwrap();
    let start_ms = 10_000_000;
    let at = start_ms + 3_600_000;
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(start_ms)
            .build()
            .unwrap();
        let notes = notes(&host);
        notes
            .stub("armed")
            .unwrap()
            .call(move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        notes
            .stub("unarmed")
            .unwrap()
            .call(|_o: Rc<Notes>| async move {})
            .await
            .unwrap();
        host.shutdown().await;
    })
    .await;
    // What a crash between the index write and the object's commit leaves:
    // an index earlier than the file, and an entry for an object without alarm.
    let index = rusqlite::Connection::open(dir.path().join("index.sqlite")).unwrap();
    index
        .execute("UPDATE alarms SET at_ms = ?1", [start_ms + 60_000])
        .unwrap();
    let unarmed_id = {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(b"notes\0unarmed");
        digest
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    index
        .execute(
            "INSERT INTO alarms (id, namespace, at_ms) VALUES (?1, 'notes', ?2)",
            rusqlite::params![unarmed_id, start_ms + 60_000],
        )
        .unwrap();
    drop(index);
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(start_ms)
            .build()
            .unwrap();
        let notes = notes(&host);
        tokio::time::sleep(Duration::from_secs(120)).await;
        let armed = notes.stub("armed").unwrap();
        let (log, alarm) = armed
            .call(|o: Rc<Notes>| async move { (o.alarm_log().unwrap(), o.alarm().await.unwrap()) })
            .await
            .unwrap();
        assert!(
            log.is_empty(),
            "the early index entry did not fire the alarm"
        );
        assert_eq!(alarm, Some(at));
        let index = rusqlite::Connection::open(dir.path().join("index.sqlite")).unwrap();
        let entries: Vec<(String, i64)> = index
            .prepare("SELECT id, at_ms FROM alarms")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            entries,
            vec![(armed.id().to_string(), at)],
            "the index is exact again"
        );
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let log = armed
            .call(|o: Rc<Notes>| async move { o.alarm_log().unwrap() })
            .await
            .unwrap();
        assert_eq!(log, vec![(at, 0)]);
        host.shutdown().await;
    })
    .await;
}

/// An object type that does not implement `alarm`.
struct Silent(ObjectContext);
impl DurableObject for Silent {}

#[tokio::test(start_paused = true)]
async fn an_alarm_of_an_object_that_does_not_handle_alarms_is_kept_not_cleared_nor_retried() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let silent = host
            .namespace("silent", |ctx| Ok(Silent(ctx)))
            .unwrap()
            .stub("s")
            .unwrap();
        let at = host.now_ms() + 1_000;
        silent
            .call(move |o: Rc<Silent>| async move { o.0.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        // Long enough for the first delivery and every retry a failure
        // would get (2 + 4 + ... + 64 s).
        tokio::time::sleep(Duration::from_secs(600)).await;
        host.shutdown().await;
        // The work behind it (a scheduler's rows) would be stranded if the
        // alarm were cleared: it stays in the file for the next host.
        let host = inline_host(dir.path());
        let silent = host
            .namespace("silent", |ctx| Ok(Silent(ctx)))
            .unwrap()
            .stub("s")
            .unwrap();
        let kept = silent
            .call(|o: Rc<Silent>| async move { o.0.storage().get_alarm().await })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(kept, Some(at));
        host.shutdown().await;
    })
    .await;
}
