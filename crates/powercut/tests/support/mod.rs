//! Fixtures shared by the power-cut tests: a real mount under a temporary
//! directory. Mounting needs root and /dev/fuse; without them the fixture
//! panics, so the tests fail rather than skip.

#![allow(dead_code)] // each test binary uses a different part of the support module

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use durability_powercut::PowerCutFs;

/// A mounted filesystem and the directory holding its backing directory
/// and mountpoint. Field order matters: the mount goes before the
/// directory it lives in.
pub struct Mounted {
    pub fs: PowerCutFs,
    pub backing: PathBuf,
    _dir: tempfile::TempDir,
}

impl Mounted {
    pub fn new() -> Mounted {
        let dir = tempfile::tempdir().expect("temporary directory");
        let backing = dir.path().join("backing");
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&backing).expect("backing directory");
        std::fs::create_dir(&mountpoint).expect("mountpoint");
        let fs = PowerCutFs::mount(&backing, &mountpoint)
            .expect("mounting the power-cut filesystem (needs root and /dev/fuse)");
        Mounted {
            fs,
            backing,
            _dir: dir,
        }
    }

    /// A path inside the mount.
    pub fn path(&self, name: &str) -> PathBuf {
        self.fs.mountpoint().join(name)
    }

    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).expect("read through the mount")
    }

    pub fn exists(&self, name: &str) -> bool {
        self.path(name).exists()
    }
}

/// Opens (creating) a file for writing at offsets.
pub fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .expect("open through the mount")
}

pub fn write_at(file: &File, offset: u64, data: &[u8]) {
    file.write_all_at(data, offset)
        .expect("write through the mount");
}

/// A file at `name` holding `content`, its data and its directory entry
/// durable.
pub fn durable_file(mounted: &Mounted, name: &str, content: &[u8]) {
    let file = open_rw(&mounted.path(name));
    write_at(&file, 0, content);
    file.sync_all().expect("fsync");
    sync_dir(mounted.path(name).parent().expect("parent"));
}

/// fsync of a directory.
pub fn sync_dir(dir: &Path) {
    File::open(dir)
        .expect("open directory")
        .sync_all()
        .expect("fsync directory");
}

/// `len` bytes of `byte`.
pub fn filled(byte: u8, len: usize) -> Vec<u8> {
    vec![byte; len]
}
