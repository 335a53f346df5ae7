//! Retry policy: the options a helper takes (§3.1), the backoff utilities
//! (§3.2) and the decision the engine makes after a failed attempt (§3.3).
//!
//! Everything here is pure: no storage, no clock, no randomness. The engine
//! passes the current time and a uniform sample in `[0, 1)` (drawn from
//! [`Context::random_bytes`](durability_platform::Context::random_bytes)), so
//! a decision is a function of its inputs and tests need no mocking.
//!
//! ```
//! use durability::retry::{MethodPolicy, PolicyOptions};
//!
//! let policies = PolicyOptions::new()
//!     .max_attempts(3)
//!     .method("charge", MethodPolicy::new().attempt_timeout_ms(10_000))
//!     .validate()
//!     .unwrap();
//! let charge = policies.resolve("charge");
//! assert_eq!((charge.attempt_timeout_ms, charge.max_attempts), (10_000, 3));
//! let other = policies.resolve("refund");
//! assert_eq!((other.attempt_timeout_ms, other.max_attempts), (300_000, 3));
//! // The default delay after attempt 1 is in [500, 1000) ms.
//! assert_eq!((charge.delay)(1, 0.5).unwrap(), 750.0);
//! ```

use std::fmt;
use std::rc::Rc;
use std::time::Duration;

use durability_platform::{EpochMs, MAX_SAFE_INTEGER, MAX_TIMER_MS};

use crate::error::{ConfigError, HandlerError, LibraryErrorKind};

/// Default time one attempt may run before it is cancelled: 5 minutes.
pub const DEFAULT_ATTEMPT_TIMEOUT_MS: u64 = 300_000;
/// Default number of attempts, the first one included.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default backoff after the first failed attempt, before jitter.
pub const DEFAULT_INITIAL_DELAY_MS: f64 = 1_000.0;
/// Default ceiling of the backoff, before jitter.
pub const DEFAULT_MAX_DELAY_MS: f64 = 300_000.0;

/// `min(initial_delay_ms * 2^(attempt - 1), max_delay_ms)`, where `attempt` is
/// the 1-based number of the attempt that just failed. Like JavaScript's
/// `Math.min`, a NaN anywhere gives NaN (which the engine then rejects).
///
/// ```
/// use durability::retry::exponential;
///
/// assert_eq!(exponential(1, 1_000.0, 300_000.0), 1_000.0);
/// assert_eq!(exponential(4, 1_000.0, 300_000.0), 8_000.0);
/// assert_eq!(exponential(10, 1_000.0, 300_000.0), 300_000.0);
/// assert_eq!(exponential(0, 1_000.0, 300_000.0), 500.0);
/// ```
pub fn exponential(attempt: impl Into<f64>, initial_delay_ms: f64, max_delay_ms: f64) -> f64 {
    let raw = initial_delay_ms * 2_f64.powf(attempt.into() - 1.0);
    if raw.is_nan() || max_delay_ms.is_nan() {
        f64::NAN
    } else {
        raw.min(max_delay_ms)
    }
}

/// "Equal jitter": `delay_ms / 2 + uniform * delay_ms / 2`, in
/// `[delay_ms / 2, delay_ms)` for `uniform` in `[0, 1)`.
///
/// ```
/// use durability::retry::jitter;
///
/// assert_eq!(jitter(1_000.0, 0.5), 750.0);
/// assert_eq!(jitter(1_000.0, 0.0), 500.0);
/// ```
pub fn jitter(delay_ms: f64, uniform: f64) -> f64 {
    delay_ms / 2.0 + uniform * delay_ms / 2.0
}

/// The delay before the next attempt, in milliseconds, given the 1-based
/// number of the attempt that just failed and a uniform sample in `[0, 1)`
/// supplied by the engine. An `Err`, a NaN, an infinity or a negative value
/// makes the record fail terminally with `DurableRetryPolicyError`.
pub type DelayFn = Rc<dyn Fn(u32, f64) -> Result<f64, HandlerError>>;

/// The longest retry delay a policy accepts: 365 days. A longer one would
/// push the next attempt towards the end of the safe-integer clock and fail
/// the work at its first retry instead of at build.
pub const MAX_RETRY_DELAY_MS: u64 = 365 * 24 * 3_600 * 1_000;

/// `duration` in milliseconds, refusing one that is not a whole number of
/// them (rounding would silently change the setting); saturates at
/// `u64::MAX`, which range checks then refuse.
pub(crate) fn whole_millis(field: &str, duration: Duration) -> Result<u64, ConfigError> {
    if !duration.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(ConfigError::NotWholeMilliseconds {
            field: field.to_owned(),
            value: duration,
        });
    }
    Ok(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
}

/// How long to wait between attempts.
#[derive(Clone)]
pub enum Delay {
    /// `jitter(exponential(attempt, initial_ms, max_ms), u)`. The default,
    /// with 1 s and 5 min.
    Exponential { initial_ms: f64, max_ms: f64 },
    /// The same delay after every failure, without jitter.
    Fixed { ms: f64 },
    /// A function of the caller's; its output is checked at run time.
    Custom(DelayFn),
}

impl Delay {
    /// A custom delay function.
    pub fn custom(delay: impl Fn(u32, f64) -> Result<f64, HandlerError> + 'static) -> Self {
        Delay::Custom(Rc::new(delay))
    }

    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        let check = |name: &str, value: f64| {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ConfigError::InvalidDelay {
                    field: format!("{field}.{name}"),
                    value,
                });
            }
            // Exact: the bound is far below 2^53.
            if value > MAX_RETRY_DELAY_MS as f64 {
                return Err(ConfigError::OutOfRange {
                    field: format!("{field}.{name}"),
                    min: 0,
                    max: MAX_RETRY_DELAY_MS,
                });
            }
            Ok(())
        };
        match self {
            Delay::Exponential { initial_ms, max_ms } => {
                check("initial_ms", *initial_ms)?;
                check("max_ms", *max_ms)
            }
            Delay::Fixed { ms } => check("ms", *ms),
            Delay::Custom(_) => Ok(()),
        }
    }

    /// The delay as the function the engine calls.
    pub fn to_fn(&self) -> DelayFn {
        match self {
            Delay::Exponential { initial_ms, max_ms } => {
                let (initial_ms, max_ms) = (*initial_ms, *max_ms);
                Rc::new(move |attempt, uniform| {
                    // 0 * 2^big is 0 * inf = NaN; a zero backoff stays zero.
                    if initial_ms == 0.0 {
                        return Ok(0.0);
                    }
                    Ok(jitter(exponential(attempt, initial_ms, max_ms), uniform))
                })
            }
            Delay::Fixed { ms } => {
                let ms = *ms;
                Rc::new(move |_, _| Ok(ms))
            }
            Delay::Custom(delay) => Rc::clone(delay),
        }
    }
}

impl Default for Delay {
    fn default() -> Self {
        Delay::Exponential {
            initial_ms: DEFAULT_INITIAL_DELAY_MS,
            max_ms: DEFAULT_MAX_DELAY_MS,
        }
    }
}

impl fmt::Debug for Delay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Delay::Exponential { initial_ms, max_ms } => f
                .debug_struct("Exponential")
                .field("initial_ms", initial_ms)
                .field("max_ms", max_ms)
                .finish(),
            Delay::Fixed { ms } => f.debug_struct("Fixed").field("ms", ms).finish(),
            Delay::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// Overrides for one handler (operation or named alarm). Unset fields fall
/// back to the helper's options, then to the defaults, field by field.
#[derive(Debug, Clone, Default)]
pub struct MethodPolicy {
    /// See [`PolicyOptions::attempt_timeout_ms`].
    pub attempt_timeout_ms: Option<u64>,
    /// See [`PolicyOptions::max_attempts`].
    pub max_attempts: Option<u32>,
    /// See [`PolicyOptions::delay`].
    pub delay: Option<Delay>,
    /// Named alarms only: whether a timed-out attempt is retried (default
    /// false: a timeout is terminal). Ignored by operations, whose timeouts
    /// always follow the retry policy.
    pub retry_timeouts: Option<bool>,
}

impl MethodPolicy {
    /// No overrides.
    pub fn new() -> Self {
        Self::default()
    }
    /// Overrides the attempt timeout.
    pub fn attempt_timeout_ms(mut self, ms: u64) -> Self {
        self.attempt_timeout_ms = Some(ms);
        self
    }
    /// Overrides the number of attempts.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }
    /// Overrides the delay between attempts.
    pub fn delay(mut self, delay: Delay) -> Self {
        self.delay = Some(delay);
        self
    }
    /// Sets whether timeouts are retried (named alarms).
    pub fn retry_timeouts(mut self, retry: bool) -> Self {
        self.retry_timeouts = Some(retry);
        self
    }
}

/// The retry options of a helper (`ExecutionPolicyOptions`): defaults for
/// all handlers plus per-handler overrides. Validate it into [`Policies`].
#[derive(Debug, Clone)]
pub struct PolicyOptions {
    attempt_timeout_ms: u64,
    max_attempts: u32,
    delay: Delay,
    methods: Vec<(String, MethodPolicy)>,
}

impl Default for PolicyOptions {
    fn default() -> Self {
        PolicyOptions {
            attempt_timeout_ms: DEFAULT_ATTEMPT_TIMEOUT_MS,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            delay: Delay::default(),
            methods: Vec::new(),
        }
    }
}

impl PolicyOptions {
    /// The defaults: 5 min per attempt, 5 attempts, jittered exponential
    /// backoff from 1 s up to 5 min.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long one attempt may run before its cancellation token fires and
    /// the attempt fails with a timeout error. At least 1 and at most
    /// [`MAX_TIMER_MS`] (about 24.8 days, the longest timer JavaScript
    /// platforms can arm; the reference library would expire a longer
    /// timeout at once, this port refuses it).
    pub fn attempt_timeout_ms(mut self, ms: u64) -> Self {
        self.attempt_timeout_ms = ms;
        self
    }

    /// Total attempts, the first one included. At least 1.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The delay between attempts.
    pub fn delay(mut self, delay: Delay) -> Self {
        self.delay = delay;
        self
    }

    /// Overrides for the handler called `name`. A second call for the same
    /// name replaces the first. Names without a handler are accepted.
    pub fn method(mut self, name: impl Into<String>, policy: MethodPolicy) -> Self {
        let name = name.into();
        match self
            .methods
            .iter_mut()
            .find(|(existing, _)| *existing == name)
        {
            Some((_, existing)) => *existing = policy,
            None => self.methods.push((name, policy)),
        }
        self
    }

    /// Checks the options in the reference library's order (§3.1): the
    /// attempt timeout, the attempt count, the delay, then each method in
    /// the order it was added.
    pub fn validate(self) -> Result<Policies, ConfigError> {
        // Fields are named by the builders' setters (`attempt_timeout`,
        // `max_attempts`, `retry_delay`) and, for a method override, by
        // `method("name")` and the `MethodPolicy` setter.
        self.validate_as("attempt_timeout", "retry_delay")
    }

    /// [`PolicyOptions::validate`], naming the timeout and the delay as the
    /// helper's own setters do (`attempt_timeout`, `retry_delay`).
    pub(crate) fn validate_as(
        self,
        timeout_field: &str,
        delay_field: &str,
    ) -> Result<Policies, ConfigError> {
        check_timeout(timeout_field, self.attempt_timeout_ms)?;
        check_attempts("max_attempts", self.max_attempts)?;
        self.delay.validate(delay_field)?;
        for (name, method) in &self.methods {
            if let Some(ms) = method.attempt_timeout_ms {
                check_timeout(&format!("method(\"{name}\").attempt_timeout_ms"), ms)?;
            }
            if let Some(attempts) = method.max_attempts {
                check_attempts(&format!("method(\"{name}\").max_attempts"), attempts)?;
            }
            if let Some(delay) = &method.delay {
                delay.validate(&format!("method(\"{name}\").delay"))?;
            }
        }
        let default = AttemptPolicy {
            attempt_timeout_ms: self.attempt_timeout_ms,
            max_attempts: self.max_attempts,
            delay: self.delay.to_fn(),
            retry_timeouts: false,
        };
        let methods = self
            .methods
            .into_iter()
            .map(|(name, method)| {
                let policy = AttemptPolicy {
                    attempt_timeout_ms: method
                        .attempt_timeout_ms
                        .unwrap_or(default.attempt_timeout_ms),
                    max_attempts: method.max_attempts.unwrap_or(default.max_attempts),
                    delay: method
                        .delay
                        .map_or_else(|| Rc::clone(&default.delay), |delay| delay.to_fn()),
                    retry_timeouts: method.retry_timeouts.unwrap_or(false),
                };
                (name, policy)
            })
            .collect();
        Ok(Policies { default, methods })
    }
}

fn check_timeout(field: &str, ms: u64) -> Result<(), ConfigError> {
    if ms == 0 {
        return Err(ConfigError::NotPositive {
            field: field.to_owned(),
        });
    }
    if ms > MAX_TIMER_MS {
        return Err(ConfigError::AboveTimerLimit {
            field: field.to_owned(),
            value_ms: ms,
        });
    }
    Ok(())
}

fn check_attempts(field: &str, attempts: u32) -> Result<(), ConfigError> {
    if attempts == 0 {
        return Err(ConfigError::NotPositive {
            field: field.to_owned(),
        });
    }
    Ok(())
}

/// Validated retry options, resolved per handler name. Cloning copies the
/// list of overrides (a few reference counts per method).
#[derive(Clone)]
pub struct Policies {
    default: AttemptPolicy,
    methods: Vec<(String, AttemptPolicy)>,
}

impl Policies {
    /// The policy of the handler called `name`: its overrides where set, the
    /// helper's options elsewhere.
    pub fn resolve(&self, name: &str) -> AttemptPolicy {
        self.methods
            .iter()
            .find(|(method, _)| method == name)
            .map_or_else(|| self.default.clone(), |(_, policy)| policy.clone())
    }
}

impl fmt::Debug for Policies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policies")
            .field("default", &self.default)
            .field("methods", &self.methods)
            .finish()
    }
}

/// The resolved policy of one handler. Cloning is one reference-count
/// increment for the delay function.
#[derive(Clone)]
pub struct AttemptPolicy {
    /// How long one attempt may run.
    pub attempt_timeout_ms: u64,
    /// Total attempts, the first one included.
    pub max_attempts: u32,
    /// The delay before the next attempt.
    pub delay: DelayFn,
    /// Named alarms: whether a timeout is retried rather than terminal.
    pub retry_timeouts: bool,
}

impl fmt::Debug for AttemptPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptPolicy")
            .field("attempt_timeout_ms", &self.attempt_timeout_ms)
            .field("max_attempts", &self.max_attempts)
            .field("retry_timeouts", &self.retry_timeouts)
            .finish_non_exhaustive()
    }
}

/// What to do after an attempt failed.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryDecision {
    /// The error to persist: the handler's own, or a `DurableRetryPolicyError`
    /// when the delay function misbehaved.
    pub error: HandlerError,
    /// Whether the record fails for good.
    pub terminal: bool,
    /// When the decision was made (`now_ms`).
    pub timestamp: EpochMs,
    /// When the next attempt is due; equals `timestamp` when terminal.
    pub next_attempt_at: EpochMs,
}

/// Decides what follows a failed attempt (§3.3).
///
/// Terminal, without calling the delay function, when the error is
/// non-retryable, when `attempt >= max_attempts`, or when the capability's
/// own rule says so (`kind_terminal`). Otherwise the delay function is called
/// with `(attempt, uniform)`; an `Err`, a NaN, a negative delay or a time
/// beyond 2^53 - 1 turns the decision terminal with a
/// `DurableRetryPolicyError` for `label` (the handler's error is then not
/// persisted; a `DurableRetryPolicyError` returned by the delay function is
/// used as is). The delay is rounded half up, like `Math.round`.
///
/// ```
/// use durability::error::HandlerError;
/// use durability::retry::{decide_retry, PolicyOptions};
///
/// let policy = PolicyOptions::new().validate().unwrap().resolve("charge");
/// let decision = decide_retry(&policy, "operation \"charge\"", 1, HandlerError::new("busy"), false, 10_000, 0.5);
/// assert!(!decision.terminal);
/// assert_eq!(decision.next_attempt_at, 10_750);
///
/// let decision = decide_retry(&policy, "operation \"charge\"", 5, HandlerError::new("busy"), false, 10_000, 0.5);
/// assert!(decision.terminal);
/// assert_eq!(decision.next_attempt_at, 10_000);
/// ```
pub fn decide_retry(
    policy: &AttemptPolicy,
    label: &str,
    attempt: u32,
    error: HandlerError,
    kind_terminal: bool,
    now_ms: EpochMs,
    uniform: f64,
) -> RetryDecision {
    let terminal = |error| RetryDecision {
        error,
        terminal: true,
        timestamp: now_ms,
        next_attempt_at: now_ms,
    };
    if error.is_non_retryable() || attempt >= policy.max_attempts || kind_terminal {
        return terminal(error);
    }
    let raw = match (policy.delay)(attempt, uniform) {
        Ok(raw) => raw,
        Err(thrown) if thrown.kind() == Some(LibraryErrorKind::RetryPolicy) => {
            return terminal(thrown);
        }
        Err(thrown) => return terminal(HandlerError::retry_policy(label, Some(thrown))),
    };
    match next_attempt_at(now_ms, raw) {
        Some(next_attempt_at) => RetryDecision {
            error,
            terminal: false,
            timestamp: now_ms,
            next_attempt_at,
        },
        None => terminal(HandlerError::retry_policy(label, None)),
    }
}

/// `now + round(raw)` when `raw` is a finite non-negative delay and both the
/// rounded delay and the sum are safe integers.
fn next_attempt_at(now_ms: EpochMs, raw: f64) -> Option<EpochMs> {
    if !raw.is_finite() || raw < 0.0 {
        return None;
    }
    // For non-negative input f64::round (half away from zero) equals
    // Math.round (half up).
    let rounded = raw.round();
    #[allow(clippy::cast_precision_loss)] // 2^53 - 1 is exact in an f64
    let max_safe = MAX_SAFE_INTEGER as f64;
    if rounded > max_safe {
        return None;
    }
    #[allow(clippy::cast_possible_truncation)] // checked above: an integer <= 2^53 - 1
    let delay = rounded as i64;
    let at = now_ms.checked_add(delay)?;
    (-MAX_SAFE_INTEGER..=MAX_SAFE_INTEGER)
        .contains(&at)
        .then_some(at)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    fn policy(options: PolicyOptions) -> AttemptPolicy {
        options.validate().unwrap().resolve("op")
    }

    #[test]
    fn exponential_and_jitter_follow_the_reference_formulas() {
        assert_eq!(exponential(1, 1_000.0, 300_000.0), 1_000.0);
        assert_eq!(exponential(9, 1_000.0, 300_000.0), 256_000.0);
        assert_eq!(exponential(10, 1_000.0, 300_000.0), 300_000.0);
        assert_eq!(exponential(-1, 1_000.0, 300_000.0), 250.0);
        assert_eq!(exponential(2_000, 1_000.0, 300_000.0), 300_000.0);
        assert!(exponential(1, f64::NAN, 300_000.0).is_nan());
        assert!(exponential(1, 1_000.0, f64::NAN).is_nan());
        assert_eq!(jitter(1_000.0, 0.5), 750.0);
        assert_eq!(jitter(300_000.0, 0.0), 150_000.0);
    }

    #[test]
    fn default_delays_double_within_equal_jitter_bounds() {
        let delay = policy(PolicyOptions::new()).delay;
        for (attempt, low, high) in [
            (1, 500.0, 1_000.0),
            (2, 1_000.0, 2_000.0),
            (4, 4_000.0, 8_000.0),
        ] {
            assert_eq!(delay(attempt, 0.0).unwrap(), low);
            assert!(delay(attempt, 0.999_999).unwrap() < high);
        }
        assert_eq!(delay(10, 0.0).unwrap(), 150_000.0);
    }

    #[test]
    fn options_are_validated_in_reference_order() {
        let error = PolicyOptions::new()
            .attempt_timeout_ms(0)
            .max_attempts(0)
            .validate()
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "attempt_timeout must be a positive integer"
        );
        let error = PolicyOptions::new().max_attempts(0).validate().unwrap_err();
        assert_eq!(error.to_string(), "max_attempts must be a positive integer");
        let error = PolicyOptions::new()
            .method("b", MethodPolicy::new().max_attempts(0))
            .method("a", MethodPolicy::new().attempt_timeout_ms(0))
            .validate()
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "method(\"b\").max_attempts must be a positive integer"
        );
    }

    #[test]
    fn attempt_timeouts_beyond_the_timer_range_are_rejected() {
        assert!(
            PolicyOptions::new()
                .attempt_timeout_ms(MAX_TIMER_MS)
                .validate()
                .is_ok()
        );
        let error = PolicyOptions::new()
            .attempt_timeout_ms(MAX_TIMER_MS + 1)
            .validate()
            .unwrap_err();
        assert!(
            matches!(error, ConfigError::AboveTimerLimit { ref field, .. } if field == "attempt_timeout")
        );
        let error = PolicyOptions::new()
            .method("slow", MethodPolicy::new().attempt_timeout_ms(u64::MAX))
            .validate()
            .unwrap_err();
        assert!(
            matches!(error, ConfigError::AboveTimerLimit { ref field, .. } if field == "method(\"slow\").attempt_timeout_ms")
        );
    }

    #[test]
    fn non_finite_or_negative_delay_settings_are_rejected_at_construction() {
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let error = PolicyOptions::new()
                .delay(Delay::Fixed { ms: bad })
                .validate()
                .unwrap_err();
            assert!(
                matches!(error, ConfigError::InvalidDelay { ref field, .. } if field == "retry_delay.ms")
            );
            let error = PolicyOptions::new()
                .method(
                    "m",
                    MethodPolicy::new().delay(Delay::Exponential {
                        initial_ms: 1.0,
                        max_ms: bad,
                    }),
                )
                .validate()
                .unwrap_err();
            assert!(
                matches!(error, ConfigError::InvalidDelay { ref field, .. } if field == "method(\"m\").delay.max_ms")
            );
        }
    }

    #[test]
    fn resolution_is_per_field() {
        let policies = PolicyOptions::new()
            .attempt_timeout_ms(1_000)
            .max_attempts(7)
            .delay(Delay::Fixed { ms: 42.0 })
            .method("only_attempts", MethodPolicy::new().max_attempts(2))
            .method("alarm", MethodPolicy::new().retry_timeouts(true))
            .validate()
            .unwrap();
        let only = policies.resolve("only_attempts");
        assert_eq!((only.attempt_timeout_ms, only.max_attempts), (1_000, 2));
        assert_eq!((only.delay)(1, 0.3).unwrap(), 42.0);
        assert!(!only.retry_timeouts);
        assert!(policies.resolve("alarm").retry_timeouts);
        let other = policies.resolve("unknown");
        assert_eq!((other.attempt_timeout_ms, other.max_attempts), (1_000, 7));
    }

    #[test]
    fn a_later_method_override_replaces_an_earlier_one() {
        let policies = PolicyOptions::new()
            .method("m", MethodPolicy::new().max_attempts(0))
            .method("m", MethodPolicy::new().max_attempts(3))
            .validate()
            .unwrap();
        assert_eq!(policies.resolve("m").max_attempts, 3);
    }

    #[test]
    fn terminal_decisions_do_not_call_the_delay_function() {
        let calls = Rc::new(Cell::new(0));
        let counter = Rc::clone(&calls);
        let policy = policy(PolicyOptions::new().max_attempts(3).delay(Delay::custom(
            move |_, _| {
                counter.set(counter.get() + 1);
                Ok(10.0)
            },
        )));
        for (attempt, error, kind_terminal) in [
            (1, HandlerError::non_retryable("stop"), false),
            (
                1,
                HandlerError::named("NonRetryableError", "foreign"),
                false,
            ),
            (3, HandlerError::new("last"), false),
            (1, HandlerError::alarm_timeout("a", 5), true),
        ] {
            let decision = decide_retry(
                &policy,
                "label",
                attempt,
                error.clone(),
                kind_terminal,
                100,
                0.5,
            );
            assert_eq!(
                decision,
                RetryDecision {
                    error,
                    terminal: true,
                    timestamp: 100,
                    next_attempt_at: 100
                }
            );
        }
        assert_eq!(calls.get(), 0);
        let decision = decide_retry(
            &policy,
            "label",
            2,
            HandlerError::new("busy"),
            false,
            100,
            0.5,
        );
        assert_eq!((decision.terminal, decision.next_attempt_at), (false, 110));
        assert_eq!(calls.get(), 1);
    }

    #[test]
    fn delay_function_receives_the_failed_attempt_and_the_uniform_sample() {
        let policy = policy(
            PolicyOptions::new().delay(Delay::custom(|attempt, uniform| {
                Ok(f64::from(attempt) * 1_000.0 + uniform)
            })),
        );
        let decision = decide_retry(&policy, "l", 3, HandlerError::new("x"), false, 0, 0.25);
        assert_eq!(decision.next_attempt_at, 3_000);
        let decision = decide_retry(&policy, "l", 3, HandlerError::new("x"), false, 0, 0.5);
        assert_eq!(decision.next_attempt_at, 3_001, "half rounds up");
    }

    #[test]
    fn a_misbehaving_delay_becomes_a_terminal_retry_policy_error() {
        let label = "operation \"charge\"";
        for raw in [f64::NAN, f64::INFINITY, -0.6, 9_007_199_254_740_992.0] {
            let policy = policy(PolicyOptions::new().delay(Delay::custom(move |_, _| Ok(raw))));
            let decision = decide_retry(
                &policy,
                label,
                1,
                HandlerError::new("handler"),
                false,
                5,
                0.5,
            );
            assert!(decision.terminal, "{raw} accepted");
            assert_eq!(decision.next_attempt_at, 5);
            assert_eq!(decision.error.kind(), Some(LibraryErrorKind::RetryPolicy));
            assert_eq!(
                decision.error.message(),
                "Retry policy for operation \"charge\" must produce a non-negative safe-integer timestamp"
            );
        }
        // A delay that is safe alone but not once added to now.
        let policy =
            policy(PolicyOptions::new().delay(Delay::custom(|_, _| Ok(9_007_199_254_740_000.0))));
        let decision = decide_retry(
            &policy,
            label,
            1,
            HandlerError::new("h"),
            false,
            10_000,
            0.5,
        );
        assert_eq!(decision.error.kind(), Some(LibraryErrorKind::RetryPolicy));
        // -0.4 rounds to -0 but is negative: rejected like the reference.
        let policy_negative = PolicyOptions::new()
            .delay(Delay::custom(|_, _| Ok(-0.4)))
            .validate()
            .unwrap()
            .resolve("x");
        assert!(
            decide_retry(
                &policy_negative,
                label,
                1,
                HandlerError::new("h"),
                false,
                0,
                0.0
            )
            .terminal
        );
    }

    #[test]
    fn a_delay_function_error_becomes_the_cause() {
        let policy = policy(
            PolicyOptions::new().delay(Delay::custom(|_, _| Err(HandlerError::new("broken")))),
        );
        let decision = decide_retry(
            &policy,
            "fanout",
            1,
            HandlerError::new("handler"),
            false,
            0,
            0.0,
        );
        assert!(decision.terminal);
        assert_eq!(decision.error.name(), "DurableRetryPolicyError");
        assert_eq!(
            decision.error.cause().map(HandlerError::message),
            Some("broken")
        );
    }

    #[test]
    fn a_retry_policy_error_from_the_delay_function_is_used_as_is() {
        let policy = policy(PolicyOptions::new().delay(Delay::custom(|_, _| {
            Err(HandlerError::retry_policy("custom entity", None))
        })));
        let decision = decide_retry(
            &policy,
            "fanout",
            1,
            HandlerError::new("handler"),
            false,
            0,
            0.0,
        );
        assert!(decision.error.message().contains("custom entity"));
        assert!(decision.error.cause().is_none());
    }

    #[test]
    fn a_zero_exponential_backoff_stays_zero_at_any_attempt() {
        let policy = policy(PolicyOptions::new().delay(Delay::Exponential {
            initial_ms: 0.0,
            max_ms: 10.0,
        }));
        assert_eq!((policy.delay)(u32::MAX, 0.5).unwrap(), 0.0);
    }
}
