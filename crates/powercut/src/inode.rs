//! The inode table: which backing path each inode number the kernel holds
//! stands for.
//!
//! It owns the mapping only; it never touches the backing directory. Inode
//! numbers are never reused (a counter), so a number the kernel still holds
//! after a cut can only name the file it named before, or nothing. A node
//! follows its file through renames, unlinks (into the stash) and undone
//! namespace changes, because the data undo state is keyed by it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The kernel's number for the root directory.
pub(crate) const ROOT_INO: u64 = 1;

/// One inode the kernel knows, or that has undo state to follow.
#[derive(Debug)]
struct Node {
    /// Relative to the backing root; `None` once the file is gone (its
    /// creation undone, or its stashed copy deleted).
    path: Option<PathBuf>,
    /// Lookups the kernel has not forgotten yet.
    lookups: u64,
}

/// Inode numbers to backing paths and back.
#[derive(Debug)]
pub(crate) struct InodeTable {
    nodes: HashMap<u64, Node>,
    by_path: HashMap<PathBuf, u64>,
    next: u64,
}

impl InodeTable {
    pub(crate) fn new() -> InodeTable {
        let mut table = InodeTable {
            nodes: HashMap::new(),
            by_path: HashMap::new(),
            next: ROOT_INO + 1,
        };
        // The kernel never forgets the root, so neither does the table.
        table.nodes.insert(
            ROOT_INO,
            Node {
                path: Some(PathBuf::new()),
                lookups: 1,
            },
        );
        table.by_path.insert(PathBuf::new(), ROOT_INO);
        table
    }

    /// The path `ino` stands for now, if it is still known and not gone.
    pub(crate) fn path(&self, ino: u64) -> Option<&Path> {
        self.nodes.get(&ino)?.path.as_deref()
    }

    /// The inode already standing for `path`, without counting a lookup.
    pub(crate) fn ino_of(&self, path: &Path) -> Option<u64> {
        self.by_path.get(path).copied()
    }

    /// The inode for `path`, made if new, with one more kernel lookup
    /// counted (every entry reply is one).
    pub(crate) fn look_up(&mut self, path: &Path) -> u64 {
        if let Some(&ino) = self.by_path.get(path)
            && let Some(node) = self.nodes.get_mut(&ino)
        {
            node.lookups += 1;
            return ino;
        }
        let ino = self.next;
        self.next += 1;
        self.nodes.insert(
            ino,
            Node {
                path: Some(path.to_path_buf()),
                lookups: 1,
            },
        );
        self.by_path.insert(path.to_path_buf(), ino);
        ino
    }

    /// Counts `n` lookups forgotten; removes the node once the kernel holds
    /// none, unless `keep` says something else (undo state, an open handle)
    /// still needs it.
    pub(crate) fn forget(&mut self, ino: u64, n: u64, keep: bool) {
        if ino == ROOT_INO {
            return;
        }
        let Some(node) = self.nodes.get_mut(&ino) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups == 0 && !keep {
            self.remove(ino);
        }
    }

    fn remove(&mut self, ino: u64) {
        if let Some(Node {
            path: Some(path), ..
        }) = self.nodes.remove(&ino)
            && self.by_path.get(&path) == Some(&ino)
        {
            self.by_path.remove(&path);
        }
    }

    /// Records that whatever was at `from` (and below it, for a directory)
    /// is now at `to`. A stale node still claiming `to` is marked gone:
    /// its file was moved away or deleted before, and a data undo must
    /// never be applied to the file that now lives there.
    pub(crate) fn move_path(&mut self, from: &Path, to: &Path) {
        self.mark_gone(to);
        let moved: Vec<(u64, PathBuf)> = self
            .nodes
            .iter()
            .filter_map(|(&ino, node)| {
                let path = node.path.as_deref()?;
                let rest = path.strip_prefix(from).ok()?;
                // `join("")` would add a trailing separator, and a file
                // named `a/` is "not a directory".
                let moved = if rest.as_os_str().is_empty() {
                    to.to_path_buf()
                } else {
                    to.join(rest)
                };
                Some((ino, moved))
            })
            .collect();
        for (ino, new_path) in moved {
            if let Some(node) = self.nodes.get_mut(&ino) {
                if let Some(old) = node.path.take()
                    && self.by_path.get(&old) == Some(&ino)
                {
                    self.by_path.remove(&old);
                }
                self.by_path.insert(new_path.clone(), ino);
                node.path = Some(new_path);
            }
        }
    }

    /// Marks every node at or below `path` gone: the file no longer exists.
    pub(crate) fn mark_gone(&mut self, path: &Path) {
        for (ino, node) in &mut self.nodes {
            if *ino == ROOT_INO {
                continue;
            }
            if node.path.as_deref().is_some_and(|p| p.starts_with(path))
                && let Some(old) = node.path.take()
            {
                self.by_path.remove(&old);
            }
        }
    }

    /// Every node with a path, for cache invalidation after a cut.
    pub(crate) fn known(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|(_, node)| node.path.is_some())
            .map(|(&ino, _)| ino)
            .collect()
    }

    /// Drops the nodes the kernel no longer holds, once `keep` no longer
    /// needs them (after a cut, when the undo state is gone).
    pub(crate) fn prune(&mut self, keep: impl Fn(u64) -> bool) {
        let dead: Vec<u64> = self
            .nodes
            .iter()
            .filter(|(ino, node)| **ino != ROOT_INO && node.lookups == 0 && !keep(**ino))
            .map(|(ino, _)| *ino)
            .collect();
        for ino in dead {
            self.remove(ino);
        }
    }
}
