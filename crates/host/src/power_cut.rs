//! Tests' power cuts: a power-cut filesystem mounted over a temporary
//! directory, so what survives a cut is decided by a filesystem and not
//! by the host's own idea of what it synced. Needs root and /dev/fuse;
//! without them the mount panics, and the test fails rather than skips.

use std::path::PathBuf;

use durability_powercut::PowerCutFs;

/// A mounted power-cut filesystem. Field order matters: the mount goes
/// before the directory it lives in.
pub(crate) struct PowerCut {
    pub(crate) fs: PowerCutFs,
    /// Where it is mounted: the directory the test writes to.
    pub(crate) dir: PathBuf,
    _root: tempfile::TempDir,
}

impl PowerCut {
    pub(crate) fn mount() -> PowerCut {
        let root = tempfile::tempdir().expect("a temporary directory");
        let (backing, dir) = (root.path().join("disk"), root.path().join("data"));
        for made in [&backing, &dir] {
            std::fs::create_dir_all(made).expect("the power-cut directories");
        }
        let fs = PowerCutFs::mount(&backing, &dir)
            .expect("mounting the power-cut filesystem (needs root and /dev/fuse)");
        PowerCut {
            fs,
            dir,
            _root: root,
        }
    }
}
