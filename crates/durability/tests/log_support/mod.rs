//! Fixtures of the log tests: cold stores (in memory, with fault switches;
//! and on a real directory, for the crash tests whose child and parent
//! processes share it) and a shorthand to build a log on a harness object.

#![allow(dead_code)] // each log test binary uses a different part

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::rc::Rc;

use durability::Scheduler;
use durability::log::{AppendRecord, ColdError, ColdStorage, Log, LogBuilder, Segment};
use durability::platform::LocalBoxFuture;
use serde_json::{Value, json};

/// Looks at a segment as it is written.
pub type WriteHook = Box<dyn Fn(&Segment)>;

/// A cold store in memory. Cloning shares it. Switches make writes fail or
/// return an empty locator, and `damage` and `lose` change what was stored,
/// to play the external store that the index outlives.
#[derive(Clone, Default)]
pub struct MemoryCold {
    segments: Rc<RefCell<BTreeMap<String, Segment>>>,
    pub fail_writes: Rc<Cell<bool>>,
    pub empty_locator: Rc<Cell<bool>>,
    pub writes: Rc<Cell<usize>>,
    pub reads: Rc<Cell<usize>>,
    /// Called with each segment as it is written, before it is stored.
    pub on_write: Rc<RefCell<Option<WriteHook>>>,
}

impl MemoryCold {
    pub fn handle(&self) -> Rc<dyn ColdStorage> {
        Rc::new(self.clone())
    }

    /// Locators written so far, ascending.
    pub fn locators(&self) -> Vec<String> {
        self.segments.borrow().keys().cloned().collect()
    }

    pub fn segment(&self, locator: &str) -> Option<Segment> {
        self.segments.borrow().get(locator).cloned()
    }

    /// Removes the record at `offset` from whichever segment holds it.
    pub fn damage(&self, offset: u64) {
        for segment in self.segments.borrow_mut().values_mut() {
            segment.records.retain(|r| r.offset != offset);
        }
    }

    /// Deletes a segment, as an external lifecycle rule would.
    pub fn lose(&self, locator: &str) {
        self.segments.borrow_mut().remove(locator);
    }
}

/// The locator names both ends, so a rewrite with another last offset never
/// overwrites a segment the index may point at.
pub fn locator_of(segment: &Segment) -> String {
    format!("{:020}-{:020}", segment.first_offset, segment.last_offset)
}

impl ColdStorage for MemoryCold {
    fn write<'a>(&'a self, segment: &'a Segment) -> LocalBoxFuture<'a, Result<String, ColdError>> {
        Box::pin(async move {
            // Real I/O yields; so does this, so that other tasks of the
            // object run in between, as they would.
            tokio::task::yield_now().await;
            if self.fail_writes.get() {
                return Err(ColdError::new("cold store unavailable"));
            }
            if let Some(hook) = self.on_write.borrow().as_ref() {
                hook(segment);
            }
            self.writes.set(self.writes.get() + 1);
            let locator = locator_of(segment);
            self.segments
                .borrow_mut()
                .entry(locator.clone())
                .or_insert_with(|| segment.clone());
            if self.empty_locator.get() {
                return Ok(String::new());
            }
            Ok(locator)
        })
    }

    fn read<'a>(
        &'a self,
        locator: &'a str,
    ) -> LocalBoxFuture<'a, Result<Option<Segment>, ColdError>> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            self.reads.set(self.reads.get() + 1);
            Ok(self.segments.borrow().get(locator).cloned())
        })
    }
}

/// A cold store on a directory: one file per segment, named by both
/// offsets, written to a temporary name and renamed so a reader never sees
/// half a segment, and never overwritten (at-least-once writes).
#[derive(Clone)]
pub struct DirCold {
    pub dir: PathBuf,
}

impl ColdStorage for DirCold {
    fn write<'a>(&'a self, segment: &'a Segment) -> LocalBoxFuture<'a, Result<String, ColdError>> {
        Box::pin(async move {
            let locator = locator_of(segment);
            let path = self.dir.join(&locator);
            if !path.exists() {
                let temporary = self.dir.join(format!("{locator}.tmp"));
                std::fs::write(&temporary, segment.to_json()?)?;
                std::fs::File::open(&temporary)?.sync_all()?;
                std::fs::rename(&temporary, &path)?;
            }
            Ok(locator)
        })
    }

    fn read<'a>(
        &'a self,
        locator: &'a str,
    ) -> LocalBoxFuture<'a, Result<Option<Segment>, ColdError>> {
        Box::pin(async move {
            match std::fs::read(self.dir.join(locator)) {
                Ok(bytes) => Segment::from_json(&bytes).map(Some),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(error) => Err(error.into()),
            }
        })
    }
}

/// A log builder on a fresh scheduler over `h`'s object, installed so the
/// object's alarm delegates to it.
pub fn builder(h: &crate::support::Harness) -> (Scheduler, LogBuilder<Value>) {
    let scheduler = Scheduler::new(h.context()).expect("scheduler");
    h.install(&scheduler);
    let builder = Log::<Value>::builder(&scheduler);
    (scheduler, builder)
}

/// `n` unkeyed records `{"n": i}` for i in `from..from + n`.
pub fn records(from: u64, n: u64) -> Vec<AppendRecord<Value>> {
    (from..from + n)
        .map(|i| AppendRecord::new(json!({ "n": i })))
        .collect()
}

/// Appends and returns the offsets; panics on a rejection (test input is
/// valid unless the test says otherwise).
pub async fn append(log: &Log<Value>, records: Vec<AppendRecord<Value>>) -> Vec<u64> {
    let appended = log.append(records).await.expect("append");
    appended
        .offsets()
        .unwrap_or_else(|| panic!("rejected: {:?}", appended.rejection()))
        .to_vec()
}

/// Reads every record from `from` to the end, page by page.
pub async fn read_all(log: &Log<Value>, from: u64) -> Result<Vec<u64>, durability::LogError> {
    let mut offsets = Vec::new();
    let mut at = from;
    loop {
        let page = log.read_from(at).await?;
        if page.records.is_empty() {
            return Ok(offsets);
        }
        offsets.extend(page.records.iter().map(|r| r.offset));
        at = page.next_offset;
    }
}
