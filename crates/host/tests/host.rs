//! The host's behaviour through its public API, on real SQLite files.

mod support;

use std::rc::Rc;

use durability_host::Host;
use support::{Notes, inline_host, local, notes};

#[tokio::test(start_paused = true)]
async fn a_call_runs_sql_on_the_objects_own_database() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let notes = notes(&host);
        let a = notes.stub("a").unwrap();
        let b = notes.stub("b").unwrap();
        a.call(|o: Rc<Notes>| async move { o.add("for a") })
            .await
            .unwrap()
            .unwrap();
        let texts = b
            .call(|o: Rc<Notes>| async move { o.texts() })
            .await
            .unwrap()
            .unwrap();
        assert!(texts.is_empty());
        let texts = a
            .call(|o: Rc<Notes>| async move { o.texts() })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(texts, vec!["for a".to_owned()]);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_mode_host_serves_calls_from_any_thread() {
    let dir = tempfile::tempdir().unwrap();
    let host = Host::builder(dir.path()).threads(2).build().unwrap();
    let notes = notes(&host);
    let mut handles = Vec::new();
    for i in 0..8 {
        let stub = notes.stub(&format!("object-{i}")).unwrap();
        handles.push(tokio::spawn(async move {
            stub.call(move |o: Rc<Notes>| async move {
                o.add(&format!("note {i}"))?;
                o.texts()
            })
            .await
        }));
    }
    for handle in handles {
        let texts = handle.await.unwrap().unwrap().unwrap();
        assert_eq!(texts.len(), 1);
    }
    assert_eq!(host.live_objects(), 8);
    host.shutdown().await;
    assert_eq!(host.live_objects(), 0);
}
