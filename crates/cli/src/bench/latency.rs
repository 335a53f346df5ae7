//! Latency distributions of one measurement, kept in an HDR histogram so that
//! p99 of a million operations costs a fixed few hundred KiB, not a sorted
//! vector of every sample.

use std::time::Duration;

use hdrhistogram::Histogram;

use super::BenchError;

/// The slowest latency a histogram records exactly; anything slower is
/// recorded as this value (one hour, far beyond any sane operation).
const MAX_RECORDABLE_NS: u64 = 3_600_000_000_000;

/// Three significant digits: p99 of 1,234 µs is reported as 1,234 µs, not 1,200.
const SIGNIFICANT_DIGITS: u8 = 3;

/// The recorded latencies of one measurement, in nanoseconds.
pub struct Latency {
    histogram: Histogram<u64>,
}

/// The percentiles a report shows, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencySummary {
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

impl Latency {
    /// An empty distribution.
    pub fn new() -> Result<Self, BenchError> {
        let histogram = Histogram::new_with_bounds(1, MAX_RECORDABLE_NS, SIGNIFICANT_DIGITS)
            .map_err(|error| BenchError::Histogram {
                message: error.to_string(),
            })?;
        Ok(Latency { histogram })
    }

    /// Records one operation's latency.
    pub fn record(&mut self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        // Saturating: a latency beyond the bound is still counted, as the bound.
        self.histogram.saturating_record(ns.max(1));
    }

    /// Adds every latency `other` recorded (one caller's share of a run).
    pub fn merge(&mut self, other: &Latency) -> Result<(), BenchError> {
        self.histogram
            .add(&other.histogram)
            .map_err(|error| BenchError::Histogram {
                message: format!("{error:?}"),
            })
    }

    /// How many latencies were recorded.
    pub fn len(&self) -> u64 {
        self.histogram.len()
    }

    /// The percentiles, or `None` when nothing was recorded.
    pub fn summary(&self) -> Option<LatencySummary> {
        if self.histogram.is_empty() {
            return None;
        }
        let us = ns_to_us;
        Some(LatencySummary {
            p50_us: us(self.histogram.value_at_quantile(0.50)),
            p90_us: us(self.histogram.value_at_quantile(0.90)),
            p99_us: us(self.histogram.value_at_quantile(0.99)),
            max_us: us(self.histogram.max()),
            mean_us: self.histogram.mean() / 1_000.0,
        })
    }
}

// Latencies are far below 2^52 ns, so the conversion to f64 is exact.
fn ns_to_us(ns: u64) -> f64 {
    ns as f64 / 1_000.0
}
