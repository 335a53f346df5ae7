//! Directories whose entries survive a power cut.
//!
//! A new directory is an entry in its parent, and the parent's entry in
//! its own parent was made when that one was new: until the parent is
//! synced, a power cut may take the new directory back, with every file
//! made in it (whose own syncs cover their data and their entry in the new
//! directory, not the new directory's entry). So a directory the host
//! creates has its parent synced, and so does every ancestor it creates
//! on the way. Only creation pays: an existing directory costs one
//! `stat`.

use std::fs::File;
use std::io;
use std::path::Path;

/// Creates `dir` and any missing ancestor, and syncs the parent of each
/// one created, deepest first.
pub(crate) fn create_durably(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    // The ancestors to create, deepest first; a path a user's input can
    // make deep is walked in a loop, not by recursion.
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(path) = at.filter(|path| !path.as_os_str().is_empty() && !path.is_dir()) {
        missing.push(path);
        at = path.parent();
    }
    std::fs::create_dir_all(dir)?;
    for created in missing {
        if let Some(parent) = created.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync(parent)?;
        }
    }
    Ok(())
}

/// Syncs the directory `dir` (its entries).
pub(crate) fn sync(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_and_its_missing_ancestors_are_made() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("a/b/c");
        create_durably(&deep).unwrap();
        assert!(deep.is_dir());
        // Existing: nothing to do, no error.
        create_durably(&deep).unwrap();
    }

    #[test]
    fn a_made_directory_and_a_file_synced_in_it_survive_a_power_cut() {
        // The power-cut filesystem decides what is durable; its metadata
        // cut undoes a seeded number of undurable namespace changes.
        let cut = crate::power_cut::PowerCut::mount();
        for seed in 0..8 {
            let deep = cut.dir.join(format!("{seed}/objects/ab"));
            create_durably(&deep).unwrap();
            let file = deep.join("object.sqlite");
            std::fs::write(&file, b"synced").unwrap();
            File::open(&file).unwrap().sync_all().unwrap();
            sync(&deep).unwrap();
            cut.fs
                .cut(durability_powercut::Fault::Metadata, seed)
                .unwrap();
            assert_eq!(
                std::fs::read(&file).unwrap_or_default(),
                b"synced",
                "seed {seed}"
            );
        }
        cut.fs.unmount().unwrap();
    }
}
