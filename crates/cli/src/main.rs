//! The `durability` binary: the one place that knows both the object host and
//! the capabilities, and the only code of the workspace that prints to the
//! terminal.
//!
//! Each subcommand lives in its own module (`demo`, `inspect`, `recover`, `serve`,
//! `backup` (with `verify` and `restore`), `bench`, `torture`) with
//! its own clap arguments and its own error type; this file only parses the
//! command line, sets up logging and turns an error into an exit code.

mod backup;
mod bench;
mod demo;
mod fuzz;
mod inspect;
mod modes;
mod recover;
mod serve;
mod torture;

use std::error::Error as _;
use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Durable work inside objects: small actors that each own an embedded SQLite
/// database and one persistent alarm.
#[derive(Debug, Parser)]
#[command(name = "durability", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a mailbox service on an embedded data directory: fanout to an
    /// inbox and an archive with retries and dead letters, a cleanup alarm,
    /// digest operations; resumes an interrupted run.
    Demo(demo::DemoArgs),
    /// List every object of a data directory without constructing any.
    Inspect(inspect::InspectArgs),
    /// Serve the dashboard of a data directory, read-only, without
    /// constructing any object (`/` is the page, `/api/objects` the JSON).
    Serve(serve::ServeArgs),
    /// Apply what a damaged host journal can prove whole, move the damaged
    /// segments aside and report per object what could not be applied
    /// (when a start fails with "lost synced records").
    Recover(recover::RecoverArgs),
    /// Copy every object of a data directory consistently (a host may be
    /// serving it) into a new directory, with a manifest of SHA-256s.
    Backup(backup::BackupArgs),
    /// Check every object of a backup against its manifest and with
    /// `PRAGMA integrity_check`; exits non-zero naming each bad object.
    Verify(backup::VerifyArgs),
    /// Write a verified backup (or some of its objects) into an empty data
    /// directory that no host holds, with its alarm index.
    Restore(backup::RestoreArgs),
    /// Measure a scenario: progress bars, a summary table, optional JSON.
    #[command(after_help = bench::AFTER_HELP)]
    Bench(bench::BenchArgs),
    /// Kill a workload's process with SIGKILL again and again, then check
    /// that every guarantee held; exits non-zero on any violation.
    Torture(torture::TortureArgs),
    /// Random and adversarial inputs against every capability's public API
    /// and malformed rows in their tables; exits non-zero on any panic,
    /// abort, hang, write by a rejected call, or accepted work that never
    /// ends visibly.
    Fuzz(fuzz::FuzzArgs),
    /// One process of fuzz cases (started by `fuzz`).
    #[command(hide = true)]
    FuzzChild(fuzz::ChildArgs),
    /// One life of a torture workload (started and killed by `torture`).
    #[command(hide = true)]
    TortureChild(torture::ChildArgs),
}

/// Why a subcommand failed. Each variant is the error of one subcommand,
/// which names what it was doing.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Demo(#[from] demo::DemoError),
    #[error(transparent)]
    Inspect(#[from] inspect::InspectError),
    #[error(transparent)]
    Recover(#[from] recover::RecoverError),
    #[error(transparent)]
    Backup(#[from] backup::BackupCommandError),
    #[error(transparent)]
    Serve(#[from] serve::ServeError),
    #[error(transparent)]
    Bench(#[from] bench::BenchError),
    #[error(transparent)]
    Torture(#[from] torture::TortureError),
    #[error(transparent)]
    Fuzz(#[from] fuzz::FuzzError),
}

fn main() -> ExitCode {
    ignore_sigxfsz();
    // Logs go to stderr so that `--json` output on stdout stays parseable.
    // Quiet by default; RUST_LOG=info (or debug) shows the host's lifecycle.
    // Colour only on a terminal: redirected logs stay plain text.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let cli = Cli::parse();
    let outcome: Result<String, CliError> = match cli.command {
        // The summary is printed whatever it says; a loss also fails the run.
        Command::Demo(args) => {
            return match demo::run(&args) {
                Ok(demo::DemoOutput { text, lost: None }) => print(&text),
                Ok(demo::DemoOutput {
                    text,
                    lost: Some(lost),
                }) => {
                    print(&text);
                    fail(&CliError::from(lost))
                }
                Err(error) => fail(&CliError::from(error)),
            };
        }
        // The listing is printed, then any unreadable object fails the run.
        Command::Inspect(args) => {
            return match inspect::run(&args) {
                Ok(inspect::Listing {
                    text,
                    problem: None,
                }) => print(&text),
                Ok(inspect::Listing {
                    text,
                    problem: Some(problem),
                }) => {
                    print(&text);
                    fail(&CliError::from(problem))
                }
                Err(error) => fail(&CliError::from(error)),
            };
        }
        Command::Recover(args) => recover::run(&args).map_err(CliError::from),
        Command::Backup(args) => backup::run_backup(&args).map_err(CliError::from),
        Command::Verify(args) => backup::run_verify(&args).map_err(CliError::from),
        Command::Restore(args) => backup::run_restore(&args).map_err(CliError::from),
        Command::Serve(args) => serve::run(&args).map_err(CliError::from),
        Command::Bench(args) => bench::run(&args).map_err(CliError::from),
        // A torture verdict is printed whether it passed or not; the exit
        // code says which.
        Command::Torture(args) => {
            return match torture::run(&args).and_then(|v| torture::report(&v, &args)) {
                Ok((text, true)) => print(&text),
                Ok((text, false)) => {
                    print(&text);
                    ExitCode::FAILURE
                }
                Err(error) => fail(&CliError::from(error)),
            };
        }
        // Like torture: the report is printed whether it passed or not.
        Command::Fuzz(args) => {
            return match fuzz::run(&args) {
                Ok((text, true)) => print(&text),
                Ok((text, false)) => {
                    print(&text);
                    ExitCode::FAILURE
                }
                Err(error) => fail(&CliError::from(error)),
            };
        }
        Command::FuzzChild(args) => {
            return fuzz::run_child(&args).unwrap_or_else(|error| fail(&CliError::from(error)));
        }
        Command::TortureChild(args) => {
            return torture::run_child(&args).unwrap_or_else(|error| fail(&CliError::from(error)));
        }
    };
    match outcome {
        Ok(text) => print(&text),
        Err(error) => fail(&error),
    }
}

/// A write beyond the file-size limit (`ulimit -f`) raises SIGXFSZ, whose
/// default action kills the process without a word. Ignored, the write
/// fails with EFBIG instead, which SQLite and std report as errors that
/// reach the user as typed, printed failures.
fn ignore_sigxfsz() {
    // SAFETY: sets the disposition of one signal to SIG_IGN before any other
    // thread exists; no handler code runs.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Prints an error and its causes to stderr.
fn fail(error: &CliError) -> ExitCode {
    eprintln!("error: {error}");
    let mut source = error.source();
    while let Some(cause) = source {
        eprintln!("  caused by: {cause}");
        source = cause.source();
    }
    ExitCode::FAILURE
}

/// Prints a command's output. A closed pipe (`durability inspect DIR | head`)
/// is the reader's choice, not a failure; any other write error is.
fn print(text: &str) -> ExitCode {
    // A command that printed as it went (`serve`, `demo --serve`) has
    // nothing left to say.
    if text.is_empty() {
        return ExitCode::SUCCESS;
    }
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{text}").and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: cannot write to stdout: {error}");
            ExitCode::FAILURE
        }
    }
}
