//! `durability backup DATA_DIR DEST`, `durability verify BACKUP_OR_ARCHIVE`
//! and `durability restore BACKUP_OR_ARCHIVE DATA_DIR [--at TIME]
//! [--object ID]...`: the commands of `durability_host::backup` (a
//! consistent copy of every object with SQLite's online backup API while
//! a host may serve the directory, a manifest with a SHA-256 per copy,
//! complete-or-absent directories) and of `durability_host::archive` (a
//! host's continuous archive, in a directory or at an `s3://` URL). Those
//! do the work; this module only checks the arguments and words the
//! reports.
//!
//! Exit codes: 0 when the backup was written, verified or restored;
//! non-zero with the typed error otherwise: `verify` and `restore` name
//! every bad object and why, `restore` names the holder of a data
//! directory a host serves.

use std::path::{Path, PathBuf};

use durability_host::archive::{self, Archive, ArchiveError};
use durability_host::backup::{self, BackupError, Restore};
use serde_json::json;

/// Arguments of `durability backup`.
#[derive(Debug, clap::Args)]
pub struct BackupArgs {
    /// The data directory to back up; a host may be serving it.
    #[arg(value_name = "DATA_DIR")]
    dir: PathBuf,
    /// Where to write the backup: a path that does not exist yet (or an
    /// empty directory), outside DATA_DIR.
    #[arg(value_name = "DEST")]
    dest: PathBuf,
    /// Print one JSON object: `objects`, `bytes`, `seconds`, `manifest`
    /// (the manifest's path).
    #[arg(long)]
    json: bool,
}

/// Arguments of `durability verify`.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// The backup to check (a directory `durability backup` wrote), or an
    /// archive: a directory holding `archive.json`, `file:///DIR` or
    /// `s3://bucket/prefix` (credentials and endpoint from the AWS
    /// environment variables).
    #[arg(value_name = "BACKUP_OR_ARCHIVE")]
    backup: PathBuf,
    /// Print one JSON object: `objects`, `bytes`, `manifest` (of an
    /// archive: `lives`, `bases`, `objects`, `chunks`, `bytes`).
    #[arg(long)]
    json: bool,
}

/// Arguments of `durability restore`.
#[derive(Debug, clap::Args)]
pub struct RestoreArgs {
    /// The backup to restore from (verified before anything is written),
    /// or an archive to restore at a moment: a directory holding
    /// `archive.json` (as `demo --archive file:///DIR` writes),
    /// `file:///DIR` or `s3://bucket/prefix` (credentials and endpoint
    /// from the AWS environment variables).
    #[arg(value_name = "BACKUP_OR_ARCHIVE")]
    backup: PathBuf,
    /// The data directory to write: it must not exist or be empty, and no
    /// host may hold it.
    #[arg(value_name = "DATA_DIR")]
    dir: PathBuf,
    /// Restore only this object (its 64-digit id, as `durability inspect
    /// --wide` and the manifest show it); repeat for several.
    #[arg(long = "object", value_name = "ID")]
    objects: Vec<String>,
    /// With an archive: restore every object as it stood at TIME (RFC
    /// 3339, `2026-12-04T23:10:00.250Z`, or epoch milliseconds): every
    /// change whose journal sync returned at or before it, none after.
    /// Without it, an archive is restored at the last moment it holds.
    #[arg(long, value_name = "TIME")]
    at: Option<String>,
    /// Print one JSON object: `objects`, `bytes`, `alarms`, `seconds`
    /// (from an archive: `objects`, `at_ms`, `passes`, `transactions`,
    /// `chunks`, `seconds`).
    #[arg(long)]
    json: bool,
}

/// Why a backup, a verification or a restore failed. The library's error
/// is boxed: it carries every bad object of a damaged backup.
#[derive(Debug, thiserror::Error)]
pub enum BackupCommandError {
    #[error(
        "{} is not a durability data directory: it holds none of objects/, journal/, index.sqlite, host.lock",
        dir.display()
    )]
    NotADataDir { dir: PathBuf },
    #[error("cannot back up {}", dir.display())]
    Backup {
        dir: PathBuf,
        #[source]
        source: Box<BackupError>,
    },
    #[error("the backup {} did not verify", backup.display())]
    Verify {
        backup: PathBuf,
        #[source]
        source: Box<BackupError>,
    },
    #[error("invalid --at {value:?}")]
    BadAt {
        value: String,
        #[source]
        source: ArchiveError,
    },
    #[error(
        "--at needs an archive (a directory with archive.json); {} is a backup, restorable only as it was taken",
        backup.display()
    )]
    AtNeedsArchive { backup: PathBuf },
    #[error("--object is not supported with an archive ({}): restore it whole", archive.display())]
    ObjectWithArchive { archive: PathBuf },
    #[error("the archive {} did not verify", archive.display())]
    VerifyArchive {
        archive: PathBuf,
        #[source]
        source: Box<ArchiveError>,
    },
    #[error("cannot restore the archive {} into {}", archive.display(), dir.display())]
    Archive {
        archive: PathBuf,
        dir: PathBuf,
        #[source]
        source: Box<ArchiveError>,
    },
    #[error("cannot restore {} into {}", backup.display(), dir.display())]
    Restore {
        backup: PathBuf,
        dir: PathBuf,
        #[source]
        source: Box<BackupError>,
    },
}

/// Runs `durability backup` and returns what to print.
pub fn run_backup(args: &BackupArgs) -> Result<String, BackupCommandError> {
    if !durability_host::is_data_dir(&args.dir) {
        return Err(BackupCommandError::NotADataDir {
            dir: args.dir.clone(),
        });
    }
    let report = durability_host::backup_dir(&args.dir, &args.dest).map_err(|source| {
        BackupCommandError::Backup {
            dir: args.dir.clone(),
            source: Box::new(source),
        }
    })?;
    let seconds = report.elapsed.as_secs_f64();
    if args.json {
        return Ok(json!({
            "objects": report.objects,
            "bytes": report.bytes,
            "seconds": seconds,
            "manifest": report.manifest_path.display().to_string(),
        })
        .to_string());
    }
    Ok(format!(
        "backed up {} objects ({}) of {} into {} in {seconds:.2} s; manifest: {}",
        report.objects,
        human_bytes(report.bytes),
        args.dir.display(),
        report.dest.display(),
        report.manifest_path.display()
    ))
}

/// The archive `arg` names, if it names one: an `s3://` or `file://` URL,
/// or a directory holding an archive's manifest.
fn archive_of(arg: &Path) -> Option<Result<Archive, ArchiveError>> {
    let text = arg.to_str().unwrap_or_default();
    if text.starts_with("s3://") || text.starts_with("file://") {
        return Some(Archive::open_url(text));
    }
    archive::is_archive(arg).then(|| {
        let absolute = std::path::absolute(arg).map_err(|source| ArchiveError::Io {
            path: arg.to_path_buf(),
            source,
        })?;
        Archive::open(&archive::ArchiveLocation::Directory(absolute))
    })
}

/// Runs `durability verify` and returns what to print.
pub fn run_verify(args: &VerifyArgs) -> Result<String, BackupCommandError> {
    if let Some(opened) = archive_of(&args.backup) {
        return run_verify_archive(args, opened);
    }
    let report = backup::verify(&args.backup).map_err(|source| BackupCommandError::Verify {
        backup: args.backup.clone(),
        source: Box::new(source),
    })?;
    let manifest = args.backup.join(backup::MANIFEST_FILE);
    if args.json {
        return Ok(json!({
            "objects": report.objects,
            "bytes": report.bytes,
            "manifest": manifest.display().to_string(),
        })
        .to_string());
    }
    Ok(format!(
        "{}: {} objects ({}) match their SHA-256 and pass PRAGMA integrity_check",
        args.backup.display(),
        report.objects,
        human_bytes(report.bytes)
    ))
}

/// `durability verify ARCHIVE`.
fn run_verify_archive(
    args: &VerifyArgs,
    opened: Result<Archive, ArchiveError>,
) -> Result<String, BackupCommandError> {
    let report = opened
        .and_then(|archive| archive.verify())
        .map_err(|source| BackupCommandError::VerifyArchive {
            archive: args.backup.clone(),
            source: Box::new(source),
        })?;
    if args.json {
        return Ok(json!({
            "lives": report.lives,
            "bases": report.bases,
            "objects": report.objects,
            "chunks": report.chunks,
            "bytes": report.bytes,
        })
        .to_string());
    }
    Ok(format!(
        "{}: {} bases ({} objects) match their SHA-256 and pass PRAGMA integrity_check; {} chunks ({}) of {} lives match their SHA-256 and follow one another",
        args.backup.display(),
        report.bases,
        report.objects,
        report.chunks,
        human_bytes(report.bytes),
        report.lives
    ))
}

/// Runs `durability restore` and returns what to print.
pub fn run_restore(args: &RestoreArgs) -> Result<String, BackupCommandError> {
    if let Some(opened) = archive_of(&args.backup) {
        return run_restore_at(args, opened);
    }
    if args.at.is_some() {
        return Err(BackupCommandError::AtNeedsArchive {
            backup: args.backup.clone(),
        });
    }
    let which = if args.objects.is_empty() {
        Restore::all()
    } else {
        Restore::only(args.objects.iter().cloned())
    };
    let report = backup::restore(&args.backup, &args.dir, &which).map_err(|source| {
        BackupCommandError::Restore {
            backup: args.backup.clone(),
            dir: args.dir.clone(),
            source: Box::new(source),
        }
    })?;
    let seconds = report.elapsed.as_secs_f64();
    if args.json {
        return Ok(json!({
            "objects": report.objects,
            "bytes": report.bytes,
            "alarms": report.alarms,
            "seconds": seconds,
        })
        .to_string());
    }
    Ok(format!(
        "restored {} objects ({}, {} alarms indexed) from {} into {} in {seconds:.2} s",
        report.objects,
        human_bytes(report.bytes),
        report.alarms,
        args.backup.display(),
        report.data_dir.display()
    ))
}

fn human_bytes(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

/// `durability restore ARCHIVE DATA_DIR [--at TIME]`.
fn run_restore_at(
    args: &RestoreArgs,
    opened: Result<Archive, ArchiveError>,
) -> Result<String, BackupCommandError> {
    if !args.objects.is_empty() {
        return Err(BackupCommandError::ObjectWithArchive {
            archive: args.backup.clone(),
        });
    }
    let failed = |source: ArchiveError| BackupCommandError::Archive {
        archive: args.backup.clone(),
        dir: args.dir.clone(),
        source: Box::new(source),
    };
    let at_ms = match &args.at {
        Some(value) => {
            Some(
                archive::parse_time(value).map_err(|source| BackupCommandError::BadAt {
                    value: value.clone(),
                    source,
                })?,
            )
        }
        None => None,
    };
    let archive = opened.map_err(failed)?;
    let at_ms = match at_ms {
        Some(at_ms) => at_ms,
        None => archive
            .manifest()
            .map_err(failed)?
            .through_ms()
            .unwrap_or(0),
    };
    let report = archive.restore_at(&args.dir, at_ms).map_err(failed)?;
    let seconds = report.elapsed.as_secs_f64();
    if args.json {
        return Ok(json!({
            "objects": report.objects,
            "at_ms": report.at_ms,
            "passes": report.passes,
            "transactions": report.transactions,
            "chunks": report.chunks,
            "seconds": seconds,
        })
        .to_string());
    }
    Ok(format!(
        "restored {} objects as of {} ms ({} journal passes, {} transactions from {} chunks over the base {}) into {} in {seconds:.2} s",
        report.objects,
        report.at_ms,
        report.passes,
        report.transactions,
        report.chunks,
        report.base.display(),
        report.data_dir.display()
    ))
}
