//! The demo's live progress: counters the producer and the targets bump as
//! they go, and bars on stderr that show them (only when stderr is a
//! terminal).
//!
//! These counters are for the eye only. They start from the facts on disk
//! (a resumed run starts where the interrupted one stopped), but nothing the
//! summary reports about messages comes from them: that is read back from
//! the run's files at the end.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use super::facts::Facts;
use crate::bench::progress_bar;

/// How often the bars are redrawn from the counters.
const REDRAW_INTERVAL: Duration = Duration::from_millis(100);

/// What the bars show. Shared by the producer and every object thread.
#[derive(Debug, Default)]
pub struct Counters {
    accepted: AtomicU64,
    archived: AtomicU64,
    dead_lettered: AtomicU64,
    /// Messages the inbox delivered, by id: redeliveries (at least once)
    /// must not count twice. A std `Mutex`: held for a few set operations.
    inbox: Mutex<HashSet<String>>,
    /// Messages waiting for a retry of the inbox.
    retrying: Mutex<HashSet<String>>,
}

impl Counters {
    /// Counters that start from what the run's files already say.
    pub fn starting_from(facts: &Facts, batch_size: u64, messages: u64) -> Self {
        let accepted = (facts.accepted_batches.len() as u64)
            .saturating_mul(batch_size)
            .min(messages);
        Counters {
            accepted: AtomicU64::new(accepted),
            archived: AtomicU64::new(facts.archived.len() as u64),
            dead_lettered: AtomicU64::new(facts.dead_letters.len() as u64),
            inbox: Mutex::new(facts.inbox_delivered.clone()),
            retrying: Mutex::default(),
        }
    }

    pub fn accepted(&self, messages: u64) {
        self.accepted.fetch_add(messages, Ordering::Relaxed);
    }

    pub fn archived(&self) {
        self.archived.fetch_add(1, Ordering::Relaxed);
    }

    pub fn dead_lettered(&self, message_id: &str) {
        self.dead_lettered.fetch_add(1, Ordering::Relaxed);
        lock(&self.retrying).remove(message_id);
    }

    /// One inbox batch: `delivered` are in, `retried` wait for a retry.
    pub fn inbox_handled(&self, delivered: &[String], retried: &[String]) {
        let mut retrying = lock(&self.retrying);
        for id in delivered {
            retrying.remove(id);
        }
        retrying.extend(retried.iter().cloned());
        drop(retrying);
        lock(&self.inbox).extend(delivered.iter().cloned());
    }

    fn read(&self) -> [u64; 5] {
        [
            self.accepted.load(Ordering::Relaxed),
            lock(&self.inbox).len() as u64,
            self.archived.load(Ordering::Relaxed),
            lock(&self.retrying).len() as u64,
            self.dead_lettered.load(Ordering::Relaxed),
        ]
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The bars, redrawn from the counters by a background task.
pub struct Progress {
    multi: MultiProgress,
    bars: Vec<ProgressBar>,
    counters: Arc<Counters>,
    redraw: tokio::task::JoinHandle<()>,
}

impl Progress {
    /// Starts drawing: accepted and delivered per target out of `messages`,
    /// then how many wait for a retry and how many were dead-lettered.
    pub fn start(counters: Arc<Counters>, messages: u64) -> Progress {
        let multi = MultiProgress::new();
        let count_style = ProgressStyle::with_template("{prefix:>28} {pos:>7}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        let counter = |name: &str| {
            let bar = ProgressBar::new(0).with_style(count_style.clone());
            bar.set_prefix(name.to_owned());
            bar
        };
        let bars: Vec<ProgressBar> = vec![
            progress_bar("accepted", messages),
            progress_bar("delivered: inbox", messages),
            progress_bar("delivered: archive", messages),
            counter("retrying"),
            counter("dead-lettered"),
        ]
        .into_iter()
        .map(|bar| multi.add(bar))
        .collect();
        let redraw = tokio::spawn({
            let (bars, counters) = (bars.clone(), Arc::clone(&counters));
            async move {
                let mut interval = tokio::time::interval(REDRAW_INTERVAL);
                loop {
                    interval.tick().await;
                    draw(&bars, &counters);
                }
            }
        });
        Progress {
            multi,
            bars,
            counters,
            redraw,
        }
    }

    /// Prints a line on stderr: above the bars when they are drawn, plainly
    /// when they are not (stderr is not a terminal).
    pub fn note(&self, line: &str) {
        if self.multi.is_hidden() || self.multi.println(line).is_err() {
            eprintln!("{line}");
        }
    }

    /// Draws the last values and leaves the bars on screen.
    pub fn finish(&self) {
        self.redraw.abort();
        draw(&self.bars, &self.counters);
        for bar in &self.bars {
            bar.finish();
        }
    }
}

impl Drop for Progress {
    // An interrupted or failed run stops redrawing too.
    fn drop(&mut self) {
        self.redraw.abort();
    }
}

fn draw(bars: &[ProgressBar], counters: &Counters) {
    for (bar, value) in bars.iter().zip(counters.read()) {
        bar.set_position(value);
    }
}
