//! Lifecycle hooks (§5.3) on a real object: every hook sees every event, a
//! failing hook is only logged, and hook futures run under `wait_until`.

mod support;

use std::cell::{Cell, RefCell};
use std::io::Write;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability::error::HandlerError;
use durability::lifecycle::{
    Emitter, Entity, EntityKind, HookRegistration, LifecycleEvent, LifecycleHook, async_hook,
    sync_hook,
};
use durability::platform::Context;
use support::{with_context, with_host};

fn started(id: &str) -> LifecycleEvent {
    LifecycleEvent::AttemptStarted {
        entity: Entity::Operation {
            operation: "charge".into(),
            id: id.into(),
            generation: "g".into(),
        },
        timestamp: 1,
        attempt: 1,
    }
}

/// A hook that appends `name` and the event's entity id to `seen`.
fn recorder(seen: &Rc<RefCell<Vec<String>>>, name: &'static str) -> LifecycleHook {
    let seen = Rc::clone(seen);
    sync_hook(move |event: &LifecycleEvent| {
        let id = event.entity().map_or("-", Entity::id).to_owned();
        seen.borrow_mut().push(format!("{name}:{id}"));
    })
}

/// Collects everything `tracing` writes on this thread while the guard lives.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let sink = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn every_attached_hook_receives_each_event_in_attachment_order() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let emitter = Emitter::new(ctx);
        assert!(!emitter.has_hooks());
        let seen = Rc::new(RefCell::new(Vec::new()));
        emitter.add(recorder(&seen, "a")).keep();
        emitter.add(recorder(&seen, "b")).keep();
        let clone = emitter.clone();
        emitter.emit(&started("c1"));
        clone.emit(&started("c2"));
        assert_eq!(*seen.borrow(), ["a:c1", "b:c1", "a:c2", "b:c2"]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_detached_hook_receives_no_further_events() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let emitter = Emitter::new(ctx);
        let seen = Rc::new(RefCell::new(Vec::new()));
        let dropped = emitter.add(recorder(&seen, "dropped"));
        let detached = emitter.add(recorder(&seen, "detached"));
        emitter.add(recorder(&seen, "kept")).keep();
        emitter.emit(&started("1"));
        drop(dropped);
        detached.detach();
        emitter.emit(&started("2"));
        assert_eq!(
            *seen.borrow(),
            ["dropped:1", "detached:1", "kept:1", "kept:2"]
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_hook_may_detach_itself_while_an_event_is_emitted() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let emitter = Emitter::new(ctx);
        let calls = Rc::new(Cell::new(0));
        let slot: Rc<RefCell<Option<HookRegistration>>> = Rc::new(RefCell::new(None));
        let (counter, own) = (Rc::clone(&calls), Rc::clone(&slot));
        let registration = emitter.add(Rc::new(move |_: &LifecycleEvent| {
            counter.set(counter.get() + 1);
            own.borrow_mut().take();
            None
        }));
        *slot.borrow_mut() = Some(registration);
        emitter.emit(&started("1"));
        emitter.emit(&started("2"));
        assert_eq!(calls.get(), 1);
        assert!(!emitter.has_hooks());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_failing_hook_is_logged_and_does_not_affect_other_hooks() {
    let captured = Captured::default();
    let _guard = captured.install();
    with_context(|ctx: Rc<dyn Context>| async move {
        let emitter = Emitter::new(Rc::clone(&ctx));
        let seen = Rc::new(RefCell::new(Vec::new()));
        emitter
            .add(async_hook(|_: &LifecycleEvent| async {
                Err(HandlerError::named("HookError", "telemetry down"))
            }))
            .keep();
        emitter.add(recorder(&seen, "after")).keep();
        emitter.emit(&started("c1"));
        emitter.emit(&LifecycleEvent::Purged {
            entity_kind: EntityKind::NamedAlarm,
            timestamp: 5,
            before: 3,
            count: 0,
        });
        assert_eq!(*seen.borrow(), ["after:c1", "after:-"]);
        // Let the background hook futures run.
        ctx.sleep(Duration::from_millis(1)).await;
    })
    .await;
    let logs = captured.text();
    let failures: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains("durability.lifecycle_hook.failed"))
        .collect();
    assert_eq!(failures.len(), 2, "{logs}");
    for expected in [
        "entityKind=\"operation\"",
        "lifecycleType=\"attempt_started\"",
        "entityId=\"c1\"",
        "error.name=HookError",
        "error.message=telemetry down",
    ] {
        assert!(
            failures[0].contains(expected),
            "{expected} missing in {}",
            failures[0]
        );
    }
    for expected in [
        "entityKind=\"named_alarm\"",
        "lifecycleType=\"purged\"",
        "entityId=\"durability\"",
    ] {
        assert!(
            failures[1].contains(expected),
            "{expected} missing in {}",
            failures[1]
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_hook_future_runs_in_the_background_and_keeps_the_object_until_it_ends() {
    let finished = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&finished);
    with_host(|host| async move {
        let done_when_emit_returned = host
            .run("object", move |ctx: Rc<dyn Context>| async move {
                let emitter = Emitter::new(Rc::clone(&ctx));
                let hook_flag = Arc::clone(&flag);
                emitter
                    .add(async_hook(move |_: &LifecycleEvent| {
                        let (flag, sleeper) = (Arc::clone(&hook_flag), Rc::clone(&ctx));
                        async move {
                            sleeper.sleep(Duration::from_secs(5)).await;
                            flag.store(true, Ordering::SeqCst);
                            Ok(())
                        }
                    }))
                    .keep();
                emitter.emit(&started("c1"));
                flag.load(Ordering::SeqCst)
            })
            .await;
        assert!(!done_when_emit_returned, "emit waited for the hook");
        // with_host shuts the host down now; shutdown waits for wait_until work.
    })
    .await;
    assert!(finished.load(Ordering::SeqCst));
}
