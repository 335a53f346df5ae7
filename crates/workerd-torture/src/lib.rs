//! The kill torture inside workerd: the worker.
//!
//! A Durable Object (`TortureObject`, [`worker`]) runs operations, named and
//! recurring alarms, a fanout and a log over one scheduler, and logs every
//! handler run in its own SQLite; a front Worker forwards
//! `POST /object/<name>` with a JSON [`protocol::Command`] to the object
//! named `<name>`. `src/main.rs` is the runner that kills workerd under it
//! and judges the result.
//!
//! Only the wasm32 build has the worker; [`protocol`] is shared with the
//! runner.

pub mod protocol;

#[cfg(target_arch = "wasm32")]
mod worker;
