//! Caller layers (the reference's caller-side transforms) as tower
//! [`Layer`]s around a push [`Service`]: context contributions that
//! shallow-merge, and a timeout that stops waiting.
//!
//! Layers run in the order they are added to a `ServiceBuilder` (the first
//! is outermost and runs first), as transforms run in attachment order. A
//! contribution wins over the context the caller passed and over the
//! contributions of layers that ran before it: the effective context is
//! `{...caller, ...first layer, ...second layer}`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use durability_platform::MAX_TIMER_MS;
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use super::{CallContext, TimedOut};
use crate::error::ConfigError;

/// One push as a request to a layered routing service: the input and its
/// context.
#[derive(Debug, Clone, PartialEq)]
pub struct Push<I> {
    /// What the object receives.
    pub input: I,
    /// Caller-local metadata for sharding (and the object, if the caller
    /// passes it on).
    pub context: CallContext,
}

impl<I> Push<I> {
    /// A push with an empty context.
    pub fn new(input: I) -> Self {
        Push {
            input,
            context: CallContext::new(),
        }
    }

    /// This push with `context` as the caller's context.
    pub fn context(mut self, context: CallContext) -> Self {
        self.context = context;
        self
    }
}

/// Adds fields to the context of every push (a lane, a tenant), by shallow
/// merge: each field replaces the caller's field of the same name.
///
/// Context is untrusted caller metadata: never use it for identity or
/// authorization.
#[derive(Debug, Clone)]
pub struct ContextLayer {
    contribution: Arc<CallContext>,
}

impl ContextLayer {
    /// A layer that merges `contribution` into every push.
    pub fn new(contribution: CallContext) -> Self {
        ContextLayer {
            contribution: Arc::new(contribution),
        }
    }
}

impl<S> Layer<S> for ContextLayer {
    type Service = WithContext<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WithContext {
            inner,
            contribution: Arc::clone(&self.contribution),
        }
    }
}

/// The service of a [`ContextLayer`].
#[derive(Debug, Clone)]
pub struct WithContext<S> {
    inner: S,
    contribution: Arc<CallContext>,
}

impl<S, I> Service<Push<I>> for WithContext<S>
where
    S: Service<Push<I>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut push: Push<I>) -> Self::Future {
        push.context.merge(&self.contribution);
        self.inner.call(push)
    }
}

/// Stops waiting for a push after a fixed time and fails it with
/// [`TimedOut`].
///
/// **This is not a cancellation.** The object keeps running the call it
/// received and may still accept the input after the caller saw the
/// timeout; a retry after a timeout may therefore deliver twice unless the
/// input carries an idempotency key (fanout ids, log keys). The reply, if
/// it comes, is dropped: the client records nothing from it.
///
/// The sleep comes from the caller (`tokio::time::sleep` on the embedded
/// host), because the capabilities crate has no timer of its own:
///
/// ```
/// use std::time::Duration;
/// use durability::routing::TimeoutLayer;
///
/// let layer = TimeoutLayer::new(Duration::from_secs(5), |d| async move {
///     # let _ = d; // a runtime's sleep, e.g. tokio::time::sleep(d)
/// })?;
/// # Ok::<_, durability::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct TimeoutLayer<F> {
    timeout: Duration,
    sleep: F,
}

impl<F, T> TimeoutLayer<F>
where
    F: Fn(Duration) -> T + Clone,
    T: Future<Output = ()>,
{
    /// A layer that waits at most `timeout` (at least 1 ms, at most the
    /// longest timer, 2^31 - 1 ms), using `sleep` to wait.
    pub fn new(timeout: Duration, sleep: F) -> Result<Self, ConfigError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        if timeout_ms == 0 {
            return Err(ConfigError::NotPositive {
                field: "timeout".into(),
            });
        }
        if timeout_ms > MAX_TIMER_MS {
            return Err(ConfigError::AboveTimerLimit {
                field: "timeout".into(),
                value_ms: timeout_ms,
            });
        }
        Ok(TimeoutLayer { timeout, sleep })
    }
}

impl<S, F: Clone> Layer<S> for TimeoutLayer<F> {
    type Service = Timeout<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        Timeout {
            inner,
            timeout: self.timeout,
            sleep: self.sleep.clone(),
        }
    }
}

/// The service of a [`TimeoutLayer`].
#[derive(Debug, Clone)]
pub struct Timeout<S, F> {
    inner: S,
    timeout: Duration,
    sleep: F,
}

impl<S, F, T, R> Service<R> for Timeout<S, F>
where
    S: Service<R>,
    S::Error: From<TimedOut>,
    F: Fn(Duration) -> T,
    T: Future<Output = ()>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = TimeoutFuture<S::Future, T>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        // The timer starts with the call, not at the first poll.
        TimeoutFuture {
            inner: self.inner.call(request),
            sleep: (self.sleep)(self.timeout),
            timeout: self.timeout,
        }
    }
}

pin_project! {
    /// The future of a [`Timeout`] call: the push, raced against the sleep.
    pub struct TimeoutFuture<F, T> {
        #[pin]
        inner: F,
        #[pin]
        sleep: T,
        timeout: Duration,
    }
}

impl<F, T, R, E> Future for TimeoutFuture<F, T>
where
    F: Future<Output = Result<R, E>>,
    T: Future<Output = ()>,
    E: From<TimedOut>,
{
    type Output = Result<R, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.project();
        // The push is polled first: a reply that is ready when the timer
        // fires wins.
        if let Poll::Ready(output) = this.inner.poll(cx) {
            return Poll::Ready(output);
        }
        match this.sleep.poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(TimedOut {
                after: *this.timeout,
            }
            .into())),
            Poll::Pending => Poll::Pending,
        }
    }
}
