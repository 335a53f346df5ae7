//! Object lifecycle: construction, run-to-completion, eviction, shutdown.

mod support;

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use durability_host::{CallError, DurableObject, Host, ObjectContext};
use durability_platform::{Context, params};
use support::{Notes, local, notes};

/// An object that counts its constructions and keeps in-memory state.
struct Counted {
    ctx: ObjectContext,
    in_memory: Cell<u64>,
    /// Set while a call is between two awaits.
    in_section: Cell<bool>,
}

impl DurableObject for Counted {}

fn counted(host: &Host, constructions: Arc<AtomicUsize>) -> durability_host::Namespace<Counted> {
    host.namespace("counted", move |ctx: ObjectContext| {
        constructions.fetch_add(1, Ordering::SeqCst);
        ctx.storage()
            .execute_script("CREATE TABLE IF NOT EXISTS rows (v INTEGER NOT NULL)")?;
        Ok(Counted {
            ctx,
            in_memory: Cell::new(0),
            in_section: Cell::new(false),
        })
    })
    .unwrap()
}

fn host_with_idle(dir: &std::path::Path, idle: Duration) -> Host {
    Host::builder(dir)
        .threads(0)
        .idle_timeout(idle)
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn eviction_drops_memory_and_timers_and_keeps_rows_and_alarm() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = host_with_idle(dir.path(), Duration::from_secs(3600));
        let constructions = Arc::new(AtomicUsize::new(0));
        let stub = counted(&host, constructions.clone()).stub("e").unwrap();
        let at = host.now_ms() + 24 * 3_600_000;
        stub.call(move |o: Rc<Counted>| async move {
            o.in_memory.set(42);
            let storage = o.ctx.storage();
            storage
                .execute("INSERT INTO rows (v) VALUES (1)", &[])
                .unwrap();
            storage.set_alarm(at).await.unwrap();
            // An in-memory timer that would write a row in 10 s.
            let ctx = o.ctx.clone();
            o.ctx.spawn(Box::pin(async move {
                ctx.sleep(Duration::from_secs(10)).await;
                let _ = ctx
                    .storage()
                    .execute("INSERT INTO rows (v) VALUES (2)", &[]);
            }));
        })
        .await
        .unwrap();
        assert_eq!(host.live_objects(), 1);
        host.evict(stub.id()).await.unwrap();
        assert_eq!(host.live_objects(), 0);
        tokio::time::sleep(Duration::from_secs(60)).await;
        let (memory, rows, alarm) = stub
            .call(|o: Rc<Counted>| async move {
                let rows: Vec<i64> = o
                    .ctx
                    .storage()
                    .query("SELECT v FROM rows", &[])
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0).unwrap())
                    .collect();
                (
                    o.in_memory.get(),
                    rows,
                    o.ctx.storage().get_alarm().await.unwrap(),
                )
            })
            .await
            .unwrap();
        assert_eq!(memory, 0, "in-memory state is gone");
        assert_eq!(rows, vec![1], "the timer died with the object");
        assert_eq!(alarm, Some(at));
        assert_eq!(
            constructions.load(Ordering::SeqCst),
            2,
            "the next call constructed it again"
        );
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_idle_object_is_evicted_after_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = host_with_idle(dir.path(), Duration::from_secs(60));
        let constructions = Arc::new(AtomicUsize::new(0));
        let stub = counted(&host, constructions.clone()).stub("idle").unwrap();
        stub.call(|_o: Rc<Counted>| async move {}).await.unwrap();
        tokio::time::sleep(Duration::from_secs(59)).await;
        assert_eq!(host.live_objects(), 1);
        // A call restarts the idle period.
        stub.call(|_o: Rc<Counted>| async move {}).await.unwrap();
        tokio::time::sleep(Duration::from_secs(59)).await;
        assert_eq!(host.live_objects(), 1);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(host.live_objects(), 0);
        stub.call(|_o: Rc<Counted>| async move {}).await.unwrap();
        assert_eq!(constructions.load(Ordering::SeqCst), 2);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_long_call_or_wait_until_keeps_the_object_alive() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = host_with_idle(dir.path(), Duration::from_secs(10));
        let stub = counted(&host, Arc::default()).stub("busy").unwrap();
        stub.call(|o: Rc<Counted>| async move {
            let ctx = o.ctx.clone();
            o.ctx.wait_until(Box::pin(async move {
                ctx.sleep(Duration::from_secs(100)).await;
                let _ = ctx
                    .storage()
                    .execute("INSERT INTO rows (v) VALUES (7)", &[]);
            }));
        })
        .await
        .unwrap();
        let slow = stub.clone();
        let long_call = tokio::task::spawn_local(async move {
            slow.call(|o: Rc<Counted>| async move { o.ctx.sleep(Duration::from_secs(50)).await })
                .await
        });
        tokio::time::sleep(Duration::from_secs(99)).await;
        assert_eq!(host.live_objects(), 1);
        long_call.await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_secs(12)).await;
        assert_eq!(host.live_objects(), 0);
        let rows = stub
            .call(|o: Rc<Counted>| async move {
                o.ctx
                    .storage()
                    .query("SELECT v FROM rows", &[])
                    .unwrap()
                    .len()
            })
            .await
            .unwrap();
        assert_eq!(rows, 1, "the wait_until work finished before eviction");
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn two_calls_on_one_object_interleave_only_at_awaits() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = host_with_idle(dir.path(), Duration::from_secs(3600));
        let stub = counted(&host, Arc::default()).stub("rtc").unwrap();
        // Call A waits for call B: if calls were serialized this would hang
        // (and time out below); they interleave at the await.
        let (tx, rx) = tokio::sync::oneshot::channel::<u64>();
        let a = stub.clone();
        let first = tokio::task::spawn_local(async move {
            a.call(move |o: Rc<Counted>| async move {
                o.in_memory.set(1);
                let from_b = rx.await.unwrap();
                (o.in_memory.get(), from_b)
            })
            .await
        });
        let b = stub.clone();
        let second = tokio::task::spawn_local(async move {
            b.call(move |o: Rc<Counted>| async move {
                o.in_memory.set(o.in_memory.get() + 10);
                tx.send(o.in_memory.get()).unwrap();
            })
            .await
        });
        let joined = tokio::time::timeout(Duration::from_secs(10), async {
            (first.await.unwrap().unwrap(), second.await.unwrap())
        })
        .await
        .expect("calls interleave at awaits");
        assert_eq!(joined.0, (11, 11));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_from_many_threads_never_run_in_parallel_on_one_object() {
    let dir = tempfile::tempdir().unwrap();
    let host = Host::builder(dir.path()).threads(2).build().unwrap();
    let stub = counted(&host, Arc::default()).stub("exclusive").unwrap();
    let mut calls = Vec::new();
    for i in 0..64_i64 {
        let stub = stub.clone();
        calls.push(tokio::spawn(async move {
            stub.call(move |o: Rc<Counted>| async move {
                let mut overlaps = 0;
                for step in 0..4_i64 {
                    // Between two awaits nothing else of this object may run:
                    // a parallel call would find the section taken.
                    if o.in_section.replace(true) {
                        overlaps += 1;
                    }
                    for _ in 0..5 {
                        o.ctx
                            .storage()
                            .execute("INSERT INTO rows (v) VALUES (?1)", &params![i * 100 + step])
                            .unwrap();
                    }
                    o.in_section.set(false);
                    o.ctx.sleep(Duration::from_millis(1)).await;
                }
                (overlaps, std::thread::current().id())
            })
            .await
        }));
    }
    let mut threads = std::collections::HashSet::new();
    for call in calls {
        let (overlaps, thread) = call.await.unwrap().unwrap();
        assert_eq!(overlaps, 0);
        threads.insert(thread);
    }
    assert_eq!(threads.len(), 1, "one object runs on one thread");
    host.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_wait_until_work_up_to_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .shutdown_grace(Duration::from_secs(30))
            .build()
            .unwrap();
        let notes = notes(&host);
        let stub = notes.stub("background").unwrap();
        stub.call(|o: Rc<Notes>| async move {
            for (delay, text) in [(10, "within grace"), (100, "beyond grace")] {
                let ctx = o.ctx.clone();
                o.ctx.wait_until(Box::pin(async move {
                    ctx.sleep(Duration::from_secs(delay)).await;
                    let _ = ctx
                        .storage()
                        .execute("INSERT INTO notes (text) VALUES (?1)", &params![text]);
                }));
            }
        })
        .await
        .unwrap();
        let started = tokio::time::Instant::now();
        host.shutdown().await;
        assert_eq!(started.elapsed(), Duration::from_secs(30));
        assert_eq!(host.live_objects(), 0);
        assert!(matches!(
            stub.call(|_o: Rc<Notes>| async move {}).await,
            Err(CallError::ShuttingDown)
        ));
    })
    .await;
    // A new host reads what the background work committed before the end.
    local(async {
        let host = support::inline_host(dir.path());
        let texts = notes(&host)
            .stub("background")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.texts() })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(texts, vec!["within grace".to_owned()]);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_in_flight_calls() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = support::inline_host(dir.path());
        let stub = notes(&host).stub("in flight").unwrap();
        let caller = stub.clone();
        let call = tokio::task::spawn_local(async move {
            caller
                .call(|o: Rc<Notes>| async move {
                    o.ctx.sleep(Duration::from_secs(5)).await;
                    o.add("finished")
                })
                .await
        });
        tokio::task::yield_now().await;
        host.shutdown().await;
        assert_eq!(call.await.unwrap().unwrap(), Ok(()));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn namespaces_register_once_and_validate_their_names() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = support::inline_host(dir.path());
        let _ = notes(&host);
        assert!(matches!(
            host.namespace("notes", |ctx| Ok(Counted {
                ctx,
                in_memory: Cell::new(0),
                in_section: Cell::new(false)
            })),
            Err(durability_host::HostError::NamespaceExists { .. })
        ));
        assert!(matches!(
            host.namespace("", |ctx| Ok(Counted {
                ctx,
                in_memory: Cell::new(0),
                in_section: Cell::new(false)
            })),
            Err(durability_host::HostError::InvalidName {
                what: "namespace name",
                ..
            })
        ));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn an_inline_host_outside_a_local_set_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let result = Host::builder(dir.path()).threads(0).build();
    assert!(matches!(
        result,
        Err(durability_host::HostError::NoRuntime { .. })
    ));
}

#[tokio::test]
async fn a_second_host_on_a_served_data_directory_is_refused_until_the_first_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    let first = Host::builder(dir.path()).threads(1).build().unwrap();
    let second = Host::builder(dir.path()).threads(1).build();
    match second {
        Err(durability_host::HostError::DataDirInUse {
            path, holder_pid, ..
        }) => {
            assert_eq!(path, dir.path());
            assert_eq!(holder_pid, Some(std::process::id()), "the holder's pid");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("two hosts would run the same objects and alarms"),
    }
    first.shutdown().await;
    let after = Host::builder(dir.path()).threads(1).build().unwrap();
    after.shutdown().await;
}

#[test]
fn a_host_in_another_process_holds_the_directory_until_it_dies() {
    // The lock is the OS's: a killed process releases it, a live one keeps
    // it from every other process.
    let dir = tempfile::tempdir().unwrap();
    let lock = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.path().join(durability_host::DATA_DIR_LOCK_FILE))
        .unwrap();
    lock.lock().unwrap();
    let refused = Host::builder(dir.path()).threads(1).build();
    // This holder wrote no pid into the file: the error says so rather
    // than guess.
    assert!(matches!(
        refused,
        Err(durability_host::HostError::DataDirInUse {
            holder_pid: None,
            ..
        })
    ));
    drop(lock);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let host = Host::builder(dir.path()).threads(1).build().unwrap();
        host.shutdown().await;
    });
}
