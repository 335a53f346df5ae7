//! [`Gate`]: a latch a test opens to let handlers go on.

use std::cell::Cell;
use std::rc::Rc;

use tokio::sync::Notify;

/// A latch handlers wait on until the test opens it: hold a consumer or a
/// handler mid-flight, then evict, restart or fire an alarm under it.
/// Cloning shares it; not `Send` (it lives on the test's thread, where an
/// inline host runs the objects).
#[derive(Clone, Default)]
pub struct Gate(Rc<(Cell<bool>, Notify)>);

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Lets every waiter, and every later one, through.
    pub fn open(&self) {
        self.0.0.set(true);
        self.0.1.notify_waiters();
    }

    /// Whether the gate is open.
    pub fn is_open(&self) -> bool {
        self.0.0.get()
    }

    /// Resolves once the gate is open.
    pub async fn wait(&self) {
        loop {
            let notified = self.0.1.notified();
            if self.0.0.get() {
                return;
            }
            notified.await;
        }
    }
}
