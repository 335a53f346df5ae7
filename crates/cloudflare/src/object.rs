//! A Durable Object class whose alarm handler receives [`AlarmInfo`].
//!
//! workers-rs 0.8's `#[durable_object]` exports `alarm(&self)` without the
//! runtime's `alarmInfo` argument (`{ retryCount, isRetry }`), so the
//! scheduler could not tell a retried alarm from a first one. This module is
//! the workaround, compatible with upstream: [`durable_object!`](crate::durable_object)
//! exports the class with `#[wasm_bindgen]` exactly as the upstream macro does
//! (constructor, `fetch`, `alarm`), except that `alarm` takes the argument and
//! hands it on as [`AlarmInfo`]. The generated class is an ordinary
//! workers-rs Durable Object class: the same `wrangler.toml` binding, the same
//! `Env`, `Request` and `Response` types.
//!
//! The class also does what every object of this toolkit needs at start:
//! under `blockConcurrencyWhile` it loads the alarm (the contract reads it
//! synchronously) and builds the object, whose constructor runs the
//! capabilities' migrations, before any request or alarm is delivered.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;

use durability_platform::AlarmInfo;
use worker::wasm_bindgen::JsValue;
use worker::worker_sys::DurableObjectState;
use worker::{Env, Request, Response, js_sys};

use crate::CloudflareContext;

/// A Durable Object built on the durability contract.
pub trait DurableObject: Sized + 'static {
    /// Builds the object over its context (run the capabilities'
    /// constructors and migrations here). Runs once per instance, before
    /// any event. An error is answered to every request and alarm of this
    /// instance; the next instance tries again.
    fn new(ctx: Rc<CloudflareContext>, env: Env) -> worker::Result<Self>;

    /// Answers one request to the object.
    fn fetch(&self, req: Request) -> impl Future<Output = worker::Result<Response>>;

    /// Runs one delivery of the object's alarm. An error makes the runtime
    /// retry the alarm (with `info.is_retry` set).
    fn alarm(&self, info: AlarmInfo) -> impl Future<Output = worker::Result<()>>;
}

/// An object built over its context, or why building it failed.
type Started<T> = Result<(Rc<CloudflareContext>, Rc<T>), String>;

/// What the exported class holds: the object once built, or why it failed.
pub struct ObjectHost<T> {
    slot: Rc<RefCell<Option<Started<T>>>>,
}

impl<T: DurableObject> ObjectHost<T> {
    /// Starts building the object under `blockConcurrencyWhile`: the runtime
    /// delivers no event until it is done.
    pub fn start(state: DurableObjectState, env: Env) -> Self {
        let slot = Rc::new(RefCell::new(None));
        let fill = Rc::clone(&slot);
        let state = worker::durable::State::from(state);
        let raw: DurableObjectState = JsValue::from(state.as_raw()).into();
        // The gate closes on the call itself; the returned future only
        // reports completion, which the slot records instead.
        let _gate = state.block_concurrency_while(async move {
            let built = match CloudflareContext::load(&raw).await {
                Ok(ctx) => {
                    let ctx = Rc::new(ctx);
                    T::new(Rc::clone(&ctx), env)
                        .map(|object| (ctx, Rc::new(object)))
                        .map_err(|e| e.to_string())
                }
                Err(e) => Err(e.to_string()),
            };
            *fill.borrow_mut() = Some(built);
            // Errors travel in the slot: an Err here would reset the object.
            Ok(())
        });
        ObjectHost { slot }
    }

    fn object(&self) -> worker::Result<(Rc<CloudflareContext>, Rc<T>)> {
        match &*self.slot.borrow() {
            Some(Ok((ctx, object))) => Ok((Rc::clone(ctx), Rc::clone(object))),
            Some(Err(message)) => Err(worker::Error::RustError(format!(
                "the object could not start: {message}"
            ))),
            None => Err(worker::Error::RustError(
                "the object is still starting".into(),
            )),
        }
    }

    /// The exported `fetch`.
    pub async fn fetch(&self, req: Request) -> worker::Result<Response> {
        let (ctx, object) = self.object()?;
        ctx.begin_invocation();
        object.fetch(req).await
    }

    /// The exported `alarm`: reloads the alarm (the runtime cleared the one
    /// that fired) and runs the object's handler with the delivery's info.
    pub async fn alarm(&self, info: JsValue) -> worker::Result<()> {
        let (ctx, object) = self.object()?;
        ctx.begin_invocation();
        ctx.cloudflare_storage()
            .refresh_alarm()
            .await
            .map_err(|e| worker::Error::RustError(e.to_string()))?;
        object.alarm(alarm_info(&info)).await
    }
}

/// The runtime's `alarmInfo` (`{ retryCount, isRetry }`); absent fields (an
/// older runtime) read as a first delivery.
pub fn alarm_info(info: &JsValue) -> AlarmInfo {
    let field = |name: &str| js_sys::Reflect::get(info, &JsValue::from_str(name)).ok();
    let retry_count = field("retryCount")
        .and_then(|v| v.as_f64())
        .filter(|n| n.is_finite() && *n >= 0.0 && n.fract() == 0.0)
        // Checked non-negative and integral; saturates at u32::MAX.
        .map_or(0, |n| {
            if n > f64::from(u32::MAX) {
                u32::MAX
            } else {
                n as u32
            }
        });
    let is_retry = field("isRetry")
        .and_then(|v| v.as_bool())
        .unwrap_or(retry_count > 0);
    AlarmInfo {
        retry_count,
        is_retry,
    }
}

/// Exports a [`DurableObject`] as a Durable Object class named `$class`.
///
/// ```ignore
/// durability_cloudflare::durable_object!(Mailbox, MailboxObject);
/// ```
/// binds `class_name = "Mailbox"` in `wrangler.toml` to `MailboxObject`.
#[macro_export]
macro_rules! durable_object {
    ($class:ident, $object:ty) => {
        // Inside a block, with `wasm_bindgen` in scope: the code
        // wasm-bindgen's macros generate names it by that path.
        const _: () = {
            use $crate::__private::wasm_bindgen;
            use $crate::__private::wasm_bindgen::prelude::wasm_bindgen;

            #[wasm_bindgen(wasm_bindgen = $crate::__private::wasm_bindgen)]
            pub struct $class {
                host: $crate::ObjectHost<$object>,
            }

            #[wasm_bindgen(
                                wasm_bindgen = $crate::__private::wasm_bindgen,
                                wasm_bindgen_futures = $crate::__private::wasm_bindgen_futures,
                                js_sys = $crate::__private::js_sys
                            )]
            impl $class {
                #[wasm_bindgen(constructor)]
                pub fn new(
                    state: $crate::__private::worker_sys::DurableObjectState,
                    env: $crate::__private::Env,
                ) -> Self {
                    Self {
                        host: $crate::ObjectHost::start(state, env),
                    }
                }

                #[wasm_bindgen(js_name = fetch)]
                pub async fn fetch(
                    &self,
                    req: $crate::__private::web_sys::Request,
                ) -> ::std::result::Result<wasm_bindgen::JsValue, wasm_bindgen::JsValue> {
                    self.host
                        .fetch(req.into())
                        .await
                        .map($crate::__private::web_sys::Response::from)
                        .map(wasm_bindgen::JsValue::from)
                        .map_err(wasm_bindgen::JsValue::from)
                }

                #[wasm_bindgen(js_name = alarm)]
                pub async fn alarm(
                    &self,
                    info: wasm_bindgen::JsValue,
                ) -> ::std::result::Result<wasm_bindgen::JsValue, wasm_bindgen::JsValue> {
                    self.host
                        .alarm(info)
                        .await
                        .map(|()| wasm_bindgen::JsValue::UNDEFINED)
                        .map_err(wasm_bindgen::JsValue::from)
                }
            }
        };
    };
}
