//! The one check every run makes whatever its workload: each object's
//! database passes SQLite's `PRAGMA integrity_check`.
//!
//! A torn page, a WAL replayed out of order or a file a cut left half
//! written can leave a database that still answers the workload's queries
//! and yet is damaged; and a database SQLite cannot open at all would
//! otherwise only show as an error of the workload's checker. Either is a
//! `corrupt` violation naming the object and SQLite's message. Reads only,
//! like every check: the database is opened read-only.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::verdict::{Tally, Violation};
use super::workload::{Finished, ManifestEntry};

/// The messages of `integrity_check` kept per object; the first few say
/// what is wrong, the rest repeat it for other pages.
const MESSAGES_PER_OBJECT: usize = 3;

/// Checks every object of the manifest; returns the database files found
/// corrupt, so a checker's read error on one of them is not counted twice.
pub fn check(run: &Finished, tally: &mut Tally) -> BTreeSet<PathBuf> {
    let (checked, damaged) = problems(run);
    let mut corrupt = BTreeSet::new();
    for Damage {
        name,
        path,
        problem,
    } in damaged
    {
        tally.flag(
            Violation::Corrupt,
            format!(
                "the database of {name} ({}) fails integrity_check: {problem}",
                path.display()
            ),
        );
        corrupt.insert(path);
    }
    tally.detail("integrity_checked", checked);
    corrupt
}

/// An object database that fails `integrity_check` or cannot be read.
#[derive(Debug)]
pub struct Damage {
    /// The object's name.
    pub name: String,
    /// Its database file.
    pub path: PathBuf,
    /// SQLite's first messages, or why the file cannot be read.
    pub problem: String,
}

/// Runs `integrity_check` on every object of the manifest that has a
/// database in `run.databases`; returns how many were checked and the
/// damaged ones. Shared by the final check and the check of the copies
/// `--backup-during` restored.
pub fn problems(run: &Finished) -> (u64, Vec<Damage>) {
    let mut damaged = Vec::new();
    let mut checked = 0_u64;
    for (name, entry) in &run.manifest.objects {
        let problem = match integrity_check(run, entry) {
            Ok(None) => continue,
            Ok(Some(messages)) if messages == ["ok"] => None,
            Ok(Some(messages)) => Some(
                messages
                    .iter()
                    .take(MESSAGES_PER_OBJECT)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
            Err(error) => Some(format!("cannot be read: {error}")),
        };
        checked += 1;
        if let Some(problem) = problem {
            damaged.push(Damage {
                name: name.clone(),
                path: run.database(entry),
                problem,
            });
        }
    }
    (checked, damaged)
}

/// `integrity_check`'s rows for one object (`["ok"]` when sound); `None` if
/// the object has no database file.
fn integrity_check(run: &Finished, entry: &ManifestEntry) -> rusqlite::Result<Option<Vec<String>>> {
    let Some(connection) = run.open(entry)? else {
        return Ok(None);
    };
    let mut statement = connection.prepare("PRAGMA integrity_check")?;
    let messages = statement
        .query_map([], |row| row.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(messages))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torture::workload::{Files, Manifest};

    fn finished(dir: &std::path::Path, file: PathBuf) -> Finished {
        let files = Files::new(dir.to_path_buf());
        let mut manifest = Manifest::default();
        manifest.objects.insert(
            "o-0".into(),
            ManifestEntry {
                id: "id-0".into(),
                file,
            },
        );
        Finished {
            databases: files.data(),
            files,
            manifest,
            allowance: Default::default(),
        }
    }

    #[test]
    fn a_sound_database_passes_and_a_missing_one_is_not_checked() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let file = dir.path().join("data").join("o.sqlite");
        std::fs::create_dir_all(dir.path().join("data")).unwrap_or_else(|e| panic!("{e}"));
        let connection = rusqlite::Connection::open(&file).unwrap_or_else(|e| panic!("{e}"));
        connection
            .execute_batch("CREATE TABLE t (x); INSERT INTO t VALUES (1);")
            .unwrap_or_else(|e| panic!("{e}"));
        drop(connection);
        let mut tally = Tally::default();
        check(&finished(dir.path(), file), &mut tally);
        assert_eq!(tally.corrupt, 0, "{:?}", tally.examples());
        assert_eq!(tally.detail.get("integrity_checked"), Some(&1.into()));

        let mut tally = Tally::default();
        check(&finished(dir.path(), dir.path().join("none")), &mut tally);
        assert_eq!(tally.violations(), 0);
    }

    #[test]
    fn a_database_that_is_not_one_is_corrupt() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let file = dir.path().join("o.sqlite");
        std::fs::write(&file, vec![0x5a_u8; 8192]).unwrap_or_else(|e| panic!("{e}"));
        let mut tally = Tally::default();
        let corrupt = check(&finished(dir.path(), file.clone()), &mut tally);
        assert_eq!(tally.corrupt, 1);
        assert!(corrupt.contains(&file));
        assert!(
            tally.examples()[0].contains("o-0"),
            "{:?}",
            tally.examples()
        );
    }
}
