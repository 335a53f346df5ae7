//! The embedded object host of `durability`.
