//! `inspect::list_objects`: a read-only listing that never constructs.

mod support;

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use durability_host::inspect::{TableRows, list_objects};
use durability_host::{DurableObject, ObjectContext};
use durability_platform::Context;
use support::{Notes, inline_host, local, notes};

struct Plain;
impl DurableObject for Plain {}

#[tokio::test(start_paused = true)]
async fn inspect_lists_every_object_without_constructing_any() {
    let dir = tempfile::tempdir().unwrap();
    let at = local(async {
        let host = inline_host(dir.path());
        let notes = notes(&host);
        let at = host.now_ms() + 60_000;
        let a = notes.stub("a/../../a").unwrap();
        a.call(move |o: Rc<Notes>| async move {
            o.add("one").unwrap();
            o.add("two").unwrap();
            o.ctx.storage().set_alarm(at).await.unwrap();
        })
        .await
        .unwrap();
        notes.stub("b").unwrap().call(|_o: Rc<Notes>| async move {}).await.unwrap();
        // A corrupt file next to them.
        let broken = notes.stub("broken").unwrap();
        let path = host.object_file(broken.id());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"this is not a database, not even close, not at all....................................................").unwrap();

        // Listing while the host runs, with a factory that counts.
        let constructions = Arc::new(AtomicUsize::new(0));
        let seen = constructions.clone();
        let _plain = host
            .namespace("plain", move |_ctx: ObjectContext| {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(Plain)
            })
            .unwrap();
        let listing = list_objects(dir.path()).unwrap();
        assert_eq!(listing.len(), 3);
        assert_eq!(constructions.load(Ordering::SeqCst), 0);
        host.shutdown().await;
        at
    })
    .await;

    let listing = list_objects(dir.path()).unwrap();
    let a = listing
        .iter()
        .find(|o| o.name.as_deref() == Some("a/../../a"))
        .unwrap();
    assert_eq!(a.namespace.as_deref(), Some("notes"));
    assert_eq!(a.alarm_ms, Some(at));
    assert_eq!(a.error, None);
    assert!(a.file_bytes > 0);
    assert_eq!(
        a.tables,
        vec![
            TableRows {
                table: "alarm_log".into(),
                rows: 0
            },
            TableRows {
                table: "notes".into(),
                rows: 2
            },
        ]
    );
    let b = listing
        .iter()
        .find(|o| o.name.as_deref() == Some("b"))
        .unwrap();
    assert_eq!(b.alarm_ms, None);
    let broken: Vec<_> = listing.iter().filter(|o| o.error.is_some()).collect();
    assert_eq!(broken.len(), 1);
    assert_eq!(broken[0].namespace, None);
}

#[test]
fn inspect_of_a_missing_directory_is_an_error_and_of_an_empty_one_is_empty() {
    let dir = tempfile::tempdir().unwrap();
    assert!(list_objects(&dir.path().join("missing")).is_err());
    assert_eq!(list_objects(dir.path()).unwrap(), vec![]);
}
