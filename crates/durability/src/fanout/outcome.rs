//! The plain values every layer of fanout speaks: the settlement a message
//! got and why a delivery was dead-lettered. At the bottom with `store`
//! (which stores them) and imports nothing of fanout.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The first settlement chosen for a message in one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SettlementOutcome {
    /// Delivered: the row is removed.
    Ack,
    /// Deliver again later (or dead-letter when attempts are used up).
    Retry,
    /// Stop delivering: the message goes to the DLQ (or is parked).
    DeadLetter,
}

impl SettlementOutcome {
    /// The reference library's name: `ack`, `retry` or `deadLetter`.
    pub fn as_str(self) -> &'static str {
        match self {
            SettlementOutcome::Ack => "ack",
            SettlementOutcome::Retry => "retry",
            SettlementOutcome::DeadLetter => "deadLetter",
        }
    }
}

impl fmt::Display for SettlementOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a delivery was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadLetterReason {
    /// Its attempts were used up, its retry policy gave up, or it failed
    /// with a non-retryable error.
    Exhausted,
    /// The consumer called [`FanoutMessage::dead_letter`].
    Explicit,
}

impl DeadLetterReason {
    /// The stored form: `exhausted` or `explicit`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::Exhausted => "exhausted",
            DeadLetterReason::Explicit => "explicit",
        }
    }

    pub(crate) fn parse(text: &str) -> Option<Self> {
        match text {
            "exhausted" => Some(DeadLetterReason::Exhausted),
            "explicit" => Some(DeadLetterReason::Explicit),
            _ => None,
        }
    }
}
