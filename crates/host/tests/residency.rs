//! The live-object cap: least-recently-used eviction of idle objects, calls
//! that wait for room, and the deadlock a wait could cause.

mod support;

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability_host::{DurableObject, Host, HostError, Namespace, ObjectContext};
use durability_platform::{Context, params};
use support::{Notes, local, notes};

/// An object that remembers, in memory only, whether it was touched, and
/// counts its constructions by name.
struct Marked {
    ctx: ObjectContext,
    touched: Cell<bool>,
}

impl DurableObject for Marked {}

type Constructions = Arc<Mutex<HashMap<String, usize>>>;

fn marked(host: &Host, constructions: Constructions) -> Namespace<Marked> {
    host.namespace("marked", move |ctx: ObjectContext| {
        let name = ctx.name().unwrap_or_default().to_owned();
        *constructions.lock().unwrap().entry(name).or_default() += 1;
        ctx.storage()
            .execute_script("CREATE TABLE IF NOT EXISTS rows (v INTEGER NOT NULL)")?;
        Ok(Marked {
            ctx,
            touched: Cell::new(false),
        })
    })
    .unwrap()
}

fn capped_host(dir: &std::path::Path, max_live: usize) -> Host {
    Host::builder(dir)
        .threads(0)
        .idle_timeout(Duration::from_secs(24 * 3600))
        .max_live_objects(max_live)
        .build()
        .unwrap()
}

/// Touches the object; returns whether it was touched before (still in
/// memory since an earlier call).
async fn touch(ns: &Namespace<Marked>, name: &str) -> bool {
    ns.stub(name)
        .unwrap()
        .call(|o: Rc<Marked>| async move { o.touched.replace(true) })
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn with_a_cap_of_3_calling_10_objects_in_turn_keeps_3_live_and_every_row_and_alarm_survives()
{
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 3);
        let notes = notes(&host);
        let alarm_base = host.now_ms() + 24 * 3_600_000;
        for round in 0..3 {
            for i in 0..10_i64 {
                let text = format!("round {round}");
                notes
                    .stub(&format!("n{i}"))
                    .unwrap()
                    .call(move |o: Rc<Notes>| async move {
                        if round == 0 {
                            o.add_with_alarm(&text, alarm_base + i).await
                        } else {
                            o.add(&text)
                        }
                    })
                    .await
                    .unwrap()
                    .unwrap();
                assert!(host.live_objects() <= 3, "{} live", host.live_objects());
            }
        }
        for i in 0..10_i64 {
            let (texts, alarm) = notes
                .stub(&format!("n{i}"))
                .unwrap()
                .call(|o: Rc<Notes>| async move { (o.texts().unwrap(), o.alarm().await.unwrap()) })
                .await
                .unwrap();
            assert_eq!(texts, vec!["round 0", "round 1", "round 2"]);
            assert_eq!(alarm, Some(alarm_base + i));
            assert!(host.live_objects() <= 3);
        }
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_least_recently_used_idle_object_is_evicted_first() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 3);
        let constructions = Constructions::default();
        let ns = marked(&host, Arc::clone(&constructions));
        for name in ["a", "b", "c"] {
            assert!(!touch(&ns, name).await);
        }
        // `a` is used again, so `b` is now the least recently used.
        assert!(touch(&ns, "a").await);
        assert!(!touch(&ns, "d").await);
        assert_eq!(host.live_objects(), 3);
        assert!(touch(&ns, "a").await, "a kept its memory");
        assert!(touch(&ns, "c").await, "c kept its memory");
        assert!(touch(&ns, "d").await, "d kept its memory");
        assert!(!touch(&ns, "b").await, "b was evicted");
        assert_eq!(constructions.lock().unwrap().get("b"), Some(&2));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_object_with_a_call_in_flight_is_never_evicted() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 2);
        let constructions = Constructions::default();
        let ns = marked(&host, Arc::clone(&constructions));
        let busy = ns.stub("busy").unwrap();
        let long_call = tokio::task::spawn_local(async move {
            busy.call(|o: Rc<Marked>| async move {
                o.touched.set(true);
                o.ctx.sleep(Duration::from_secs(100)).await;
                o.touched.get()
            })
            .await
        });
        tokio::task::yield_now().await;
        // The other objects take turns in the one remaining slot.
        for round in 0..3 {
            for i in 0..5 {
                let first = touch(&ns, &format!("other-{i}")).await;
                assert!(!first, "round {round}: only one slot is left");
                assert!(host.live_objects() <= 2);
            }
        }
        assert!(long_call.await.unwrap().unwrap(), "busy kept its memory");
        assert!(touch(&ns, "busy").await);
        assert_eq!(constructions.lock().unwrap().get("busy"), Some(&1));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_wait_until_keeps_its_object_from_being_evicted_for_room() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 2);
        let constructions = Constructions::default();
        let ns = marked(&host, Arc::clone(&constructions));
        ns.stub("background")
            .unwrap()
            .call(|o: Rc<Marked>| async move {
                o.touched.set(true);
                let ctx = o.ctx.clone();
                o.ctx.wait_until(Box::pin(async move {
                    ctx.sleep(Duration::from_secs(100)).await;
                    let _ = ctx
                        .storage()
                        .execute("INSERT INTO rows (v) VALUES (1)", &[]);
                }));
            })
            .await
            .unwrap();
        for i in 0..4 {
            assert!(!touch(&ns, &format!("other-{i}")).await);
        }
        assert!(touch(&ns, "background").await, "still in memory");
        tokio::time::sleep(Duration::from_secs(101)).await;
        let rows = ns
            .stub("background")
            .unwrap()
            .call(|o: Rc<Marked>| async move {
                o.ctx
                    .storage()
                    .query("SELECT v FROM rows", &[])
                    .unwrap()
                    .len()
            })
            .await
            .unwrap();
        assert_eq!(rows, 1, "the wait_until work ran to its end");
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_call_waits_for_room_when_every_live_object_is_busy() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 1);
        let ns = marked(&host, Constructions::default());
        let busy = ns.stub("busy").unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let busy_log = Arc::clone(&log);
        let first = tokio::task::spawn_local(async move {
            busy.call(move |o: Rc<Marked>| async move {
                o.ctx.sleep(Duration::from_secs(50)).await;
                busy_log.lock().unwrap().push("busy ends");
            })
            .await
        });
        tokio::task::yield_now().await;
        let waiting_log = Arc::clone(&log);
        let waiting = ns.stub("waiting").unwrap();
        let second = tokio::task::spawn_local(async move {
            waiting
                .call(move |_o: Rc<Marked>| async move {
                    waiting_log.lock().unwrap().push("waiting starts");
                })
                .await
        });
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            host.live_objects(),
            1,
            "the waiting object is not built yet"
        );
        assert!(log.lock().unwrap().is_empty());
        second.await.unwrap().unwrap();
        first.await.unwrap().unwrap();
        assert_eq!(*log.lock().unwrap(), vec!["busy ends", "waiting starts"]);
        assert_eq!(host.live_objects(), 1);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn alarms_of_objects_evicted_for_room_still_fire() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 2);
        let notes = notes(&host);
        let due = host.now_ms() + 10_000;
        for i in 0..6_i64 {
            notes
                .stub(&format!("sleeper-{i}"))
                .unwrap()
                .call(move |o: Rc<Notes>| async move { o.add_with_alarm("armed", due + i).await })
                .await
                .unwrap()
                .unwrap();
            assert!(host.live_objects() <= 2);
        }
        // All six fall due together; each waits for room to be woken.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(host.live_objects() <= 2);
        for i in 0..6_i64 {
            let (fired, alarm) =
                notes
                    .stub(&format!("sleeper-{i}"))
                    .unwrap()
                    .call(|o: Rc<Notes>| async move {
                        (o.alarm_log().unwrap(), o.alarm().await.unwrap())
                    })
                    .await
                    .unwrap();
            assert_eq!(fired.len(), 1, "sleeper-{i} fired once");
            assert!(fired[0].0 >= due + i);
            assert_eq!(alarm, None, "a delivered alarm is cleared");
        }
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_nested_call_that_would_deadlock_is_admitted_over_the_cap_and_the_excess_is_evicted() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 1);
        let ns = marked(&host, Constructions::default());
        let inner = ns.stub("inner").unwrap();
        let outer = ns.stub("outer").unwrap();
        // `outer` is the one live object and waits on `inner`, which is not
        // live: waiting for room would never end.
        let result = tokio::time::timeout(
            Duration::from_secs(3600),
            outer.call(move |o: Rc<Marked>| async move {
                o.touched.set(true);
                let inner_result = inner
                    .call(|i: Rc<Marked>| async move {
                        i.ctx
                            .storage()
                            .execute("INSERT INTO rows (v) VALUES (?1)", &params![7])
                            .map(|_| ())
                    })
                    .await;
                (o.touched.get(), inner_result.map(|r| r.is_ok()))
            }),
        )
        .await
        .expect("the nested call does not deadlock")
        .unwrap();
        assert!(result.0, "outer kept its memory");
        assert!(matches!(result.1, Ok(true)));
        // Both are idle now: the object over the cap was evicted.
        assert_eq!(host.live_objects(), 1);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_nested_call_that_joins_a_waiting_construction_does_not_deadlock() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = capped_host(dir.path(), 1);
        let ns = marked(&host, Constructions::default());
        let inner = ns.stub("inner").unwrap();
        let outer = ns.stub("outer").unwrap();
        let nested = inner.clone();
        let outer_call = tokio::task::spawn_local(async move {
            outer
                .call(move |o: Rc<Marked>| async move {
                    o.ctx.sleep(Duration::from_secs(1)).await;
                    nested.call(|_i: Rc<Marked>| async move { "nested" }).await
                })
                .await
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        // An outside call to `inner` waits for `outer`, which is busy but
        // not stuck yet; a second later `outer` queues behind it.
        let outside = tokio::time::timeout(
            Duration::from_secs(3600),
            inner.call(|_i: Rc<Marked>| async move { "outside" }),
        )
        .await
        .expect("the outside call does not deadlock")
        .unwrap();
        assert_eq!(outside, "outside");
        let nested = tokio::time::timeout(Duration::from_secs(3600), outer_call)
            .await
            .expect("the nested call does not deadlock")
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(nested, "nested");
        assert_eq!(host.live_objects(), 1);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thread_mode_host_keeps_the_cap_across_executors() {
    let dir = tempfile::tempdir().unwrap();
    let host = Host::builder(dir.path())
        .threads(2)
        .idle_timeout(Duration::from_secs(24 * 3600))
        .max_live_objects(3)
        .build()
        .unwrap();
    let notes = notes(&host);
    let mut calls = Vec::new();
    for caller in 0..8 {
        let notes = notes.clone();
        let host = host.clone();
        calls.push(tokio::spawn(async move {
            for i in 0..10 {
                let text = format!("caller {caller}");
                notes
                    .stub(&format!("n{i}"))
                    .unwrap()
                    .call(move |o: Rc<Notes>| async move { o.add(&text) })
                    .await
                    .unwrap()
                    .unwrap();
                assert!(host.live_objects() <= 3, "{} live", host.live_objects());
            }
        }));
    }
    for call in calls {
        call.await.unwrap();
    }
    for i in 0..10 {
        let mut texts = notes
            .stub(&format!("n{i}"))
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.texts().unwrap() })
            .await
            .unwrap();
        texts.sort();
        let expected: Vec<String> = (0..8).map(|c| format!("caller {c}")).collect();
        assert_eq!(texts, expected);
    }
    assert!(host.live_objects() <= 3);
    host.shutdown().await;
    assert_eq!(host.live_objects(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_cap_of_zero_is_a_typed_error_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let result = Host::builder(dir.path())
            .threads(0)
            .max_live_objects(0)
            .build();
        assert!(matches!(
            result,
            Err(HostError::InvalidSetting {
                setting: "max_live_objects",
                ..
            })
        ));
    })
    .await;
}
