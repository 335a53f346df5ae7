//! The contract's [`Context`] inside a Durable Object: the object's id and
//! storage, `Date.now()`, `worker::Delay`, `crypto.getRandomValues`,
//! `spawn_local` and `ctx.waitUntil`.

use std::cell::Cell;
use std::time::Duration;

use durability_platform::{Context, EpochMs, LocalBoxFuture, ObjectId, Storage, StorageError};
use worker::wasm_bindgen::{self, JsCast, JsValue, prelude::wasm_bindgen};
use worker::wasm_bindgen_futures::{future_to_promise, spawn_local};
use worker::worker_sys::DurableObjectState;

use crate::storage::{CloudflareStorage, js_message};

#[wasm_bindgen(wasm_bindgen = wasm_bindgen)]
extern "C" {
    /// `crypto.getRandomValues(buf)`; at most 65,536 bytes a call.
    #[wasm_bindgen(js_namespace = crypto, js_name = getRandomValues, catch)]
    fn get_random_values(buf: &mut [u8]) -> Result<JsValue, JsValue>;
}

/// Cloudflare's default CPU time per request or alarm invocation. An
/// account that raises it (`limits.cpu_ms` in wrangler.toml) says so with
/// [`CloudflareContext::set_invocation_cpu_limit`].
pub const DEFAULT_INVOCATION_CPU_LIMIT: Duration = Duration::from_secs(30);

/// The most bytes one `getRandomValues` call fills (a Web Crypto limit).
const RANDOM_CHUNK_BYTES: usize = 65_536;

/// Everything the capabilities of one Durable Object see of the runtime.
///
/// One per object instance; share it as `Rc<CloudflareContext>` (cloning is
/// one reference-count increment).
pub struct CloudflareContext {
    id: ObjectId,
    state: DurableObjectState,
    storage: CloudflareStorage,
    cpu_limit: Cell<Duration>,
    /// When the latest request or alarm delivery began.
    invocation_started_at: Cell<Option<EpochMs>>,
}

impl CloudflareContext {
    /// Builds the context of the object behind `state` and loads its alarm.
    /// Call it under `blockConcurrencyWhile`; the object host does.
    pub async fn load(state: &DurableObjectState) -> Result<Self, StorageError> {
        let id = state
            .id()
            .map_err(|e| StorageError::Unavailable {
                message: format!("state.id: {}", js_message(&e)),
            })?
            .to_string()
            .map_err(|e| StorageError::Unavailable {
                message: format!("id.toString: {}", js_message(&e)),
            })?;
        let raw_storage = state.storage().map_err(|e| StorageError::Unavailable {
            message: format!("state.storage: {}", js_message(&e)),
        })?;
        let storage = CloudflareStorage::load(raw_storage).await?;
        Ok(CloudflareContext {
            id: ObjectId::new(id),
            state: JsValue::from(state).unchecked_into(),
            storage,
            cpu_limit: Cell::new(DEFAULT_INVOCATION_CPU_LIMIT),
            invocation_started_at: Cell::new(None),
        })
    }

    /// The CPU limit per invocation this Worker runs under, where it is not
    /// the default [`DEFAULT_INVOCATION_CPU_LIMIT`]. Set it before building
    /// the scheduler, which derives its alarm handoff from it.
    pub fn set_invocation_cpu_limit(&self, limit: Duration) {
        self.cpu_limit.set(limit);
    }

    /// Notes that a new event (a request, an alarm delivery) began now: the
    /// platform gave the object a fresh CPU budget, which the scheduler's
    /// in-memory runs may spend for up to its alarm handoff
    /// ([`Context::invocation_started_at`]). [`crate::ObjectHost`] calls it
    /// at every `fetch` and `alarm`; a class written by hand calls it at the
    /// start of each of its handlers.
    pub fn begin_invocation(&self) {
        self.invocation_started_at.set(Some(self.now_ms()));
    }

    /// The storage with its Cloudflare-only calls ([`CloudflareStorage::refresh_alarm`]).
    pub fn cloudflare_storage(&self) -> &CloudflareStorage {
        &self.storage
    }
}

impl Context for CloudflareContext {
    fn id(&self) -> &ObjectId {
        &self.id
    }

    fn storage(&self) -> &dyn Storage {
        &self.storage
    }

    fn now_ms(&self) -> EpochMs {
        // Date.now() is an integral number of milliseconds.
        #[allow(clippy::cast_possible_truncation)] // whole milliseconds, far below 2^53
        let now = worker::js_sys::Date::now() as EpochMs;
        now
    }

    fn sleep(&self, duration: Duration) -> LocalBoxFuture<'static, ()> {
        // Dropping a Delay clears its timer.
        Box::pin(worker::Delay::from(duration))
    }

    fn random_bytes(&self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(RANDOM_CHUNK_BYTES) {
            // Chunks are within the Web Crypto limit, the one documented way
            // this call throws; should it throw anyway, the bytes stay zero
            // and the error is logged rather than aborting the object.
            if let Err(error) = get_random_values(chunk) {
                worker::console_error!("crypto.getRandomValues failed: {}", js_message(&error));
            }
        }
    }

    fn spawn(&self, task: LocalBoxFuture<'static, ()>) {
        spawn_local(task);
    }

    fn invocation_cpu_limit(&self) -> Option<Duration> {
        Some(self.cpu_limit.get())
    }

    fn invocation_started_at(&self) -> Option<EpochMs> {
        self.invocation_started_at.get()
    }

    fn wait_until(&self, task: LocalBoxFuture<'static, ()>) {
        let promise = future_to_promise(async move {
            task.await;
            Ok(JsValue::UNDEFINED)
        });
        if let Err(error) = self.state.wait_until(&promise) {
            // The promise still runs on the event loop; only the keep-alive
            // promise to the runtime is lost.
            worker::console_error!("ctx.waitUntil failed: {}", js_message(&error));
        }
    }
}
