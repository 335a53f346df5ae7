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

#[test]
fn handles_are_send_and_sync_and_a_call_is_a_send_future() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<Host>();
    send_sync::<durability_host::Namespace<Notes>>();
    send_sync::<durability_host::Stub<Notes>>();
    send_sync::<durability_host::HostError>();
    send_sync::<durability_host::CallError>();
    let _ = |stub: durability_host::Stub<Notes>| {
        let call = async move { stub.call(|o: Rc<Notes>| async move { o.texts() }).await };
        send(&call);
    };
}

struct Panicking;
impl durability_host::DurableObject for Panicking {}

#[tokio::test(start_paused = true)]
async fn a_panicking_factory_is_a_typed_error_and_the_executor_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let ns = host
            .namespace("panicking", |_ctx| -> Result<Panicking, _> {
                panic!("the factory panics on purpose")
            })
            .unwrap();
        let result = ns
            .stub("p")
            .unwrap()
            .call(|_o: Rc<Panicking>| async move {})
            .await;
        assert!(matches!(
            result,
            Err(durability_host::CallError::Construct { .. })
        ));
        let notes = notes(&host);
        let ok = notes
            .stub("n")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.add("x") })
            .await;
        assert!(matches!(ok, Ok(Ok(()))));
        host.shutdown().await;
    })
    .await;
}

/// An object that reports each alarm delivery on a channel.
struct Reporting {
    ctx: durability_host::ObjectContext,
    fired: tokio::sync::mpsc::UnboundedSender<(String, i64)>,
}

impl durability_host::DurableObject for Reporting {
    async fn alarm(
        &self,
        _info: durability_host::AlarmInfo,
    ) -> Result<(), durability_host::BoxError> {
        use durability_platform::Context;
        let _ = self.fired.send((
            self.ctx.name().unwrap_or_default().to_owned(),
            self.ctx.now_ms(),
        ));
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_mode_host_delivers_due_alarms_of_many_objects() {
    use durability_platform::Context;
    let dir = tempfile::tempdir().unwrap();
    let host = Host::builder(dir.path()).threads(3).build().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let ns = host
        .namespace("reporting", move |ctx| {
            Ok(Reporting {
                ctx,
                fired: tx.clone(),
            })
        })
        .unwrap();
    let past = host.now_ms() - 1_000;
    for i in 0..20 {
        ns.stub(&format!("r{i}"))
            .unwrap()
            .call(move |o: Rc<Reporting>| async move { o.ctx.storage().set_alarm(past).await })
            .await
            .unwrap()
            .unwrap();
    }
    let mut names = std::collections::BTreeSet::new();
    while names.len() < 20 {
        let (name, _at) = rx.recv().await.unwrap();
        assert!(names.insert(name), "each alarm is delivered once");
    }
    host.shutdown().await;
}
