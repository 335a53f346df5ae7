//! What every test of the `durability` binary needs: the binary itself in
//! a child process, its output, and a temporary path as an argument. Each
//! test file uses some of it.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// A real S3 server (moto's) for the archive's tests: the host's tests
/// own the file.
#[path = "../../../host/tests/support/s3.rs"]
pub mod s3;

/// The built `durability` binary, ready for arguments.
pub fn durability() -> Command {
    Command::new(env!("CARGO_BIN_EXE_durability"))
}

/// Runs `command` to its end and returns what it printed.
pub fn run(command: &mut Command) -> Output {
    command
        .output()
        .unwrap_or_else(|error| panic!("cannot run the durability binary: {error}"))
}

/// Runs the binary with `args` to its end.
pub fn durability_with(args: &[&str]) -> Output {
    run(durability().args(args))
}

/// An exit status and both streams, for an assertion's message.
pub fn show(output: &Output) -> String {
    format!(
        "status: {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A temporary path as a command-line argument.
pub fn path_arg(path: &Path) -> &str {
    path.to_str()
        .unwrap_or_else(|| panic!("temporary path is not UTF-8: {}", path.display()))
}
