//! Object identity: names are validated, hashed into an [`ObjectId`], and the
//! id alone decides where the object's file lives. A user's name never
//! becomes part of a path, so names with `/`, `..` or any other text cannot
//! escape the data directory.

use std::path::{Path, PathBuf};

use durability_platform::ObjectId;
use sha2::{Digest, Sha256};

use crate::HostError;

/// The longest namespace or object name, in bytes of UTF-8.
pub const MAX_NAME_BYTES: usize = 1024;

/// Checks a namespace or object name. `what` names it in the error.
pub(crate) fn validate_name(what: &'static str, name: &str) -> Result<(), HostError> {
    let rule = if name.is_empty() {
        "must not be empty"
    } else if name.len() > MAX_NAME_BYTES {
        "must be at most 1024 bytes of UTF-8"
    } else if name.contains('\0') {
        "must not contain NUL"
    } else {
        return Ok(());
    };
    Err(HostError::InvalidName { what, rule })
}

/// The id of object `name` in `namespace`: lowercase hex SHA-256 of
/// `namespace NUL name`. NUL cannot occur in either, so the pair is
/// unambiguous.
pub(crate) fn object_id(namespace: &str, name: &str) -> ObjectId {
    let mut hasher = Sha256::new();
    hasher.update(namespace.as_bytes());
    hasher.update([0u8]);
    hasher.update(name.as_bytes());
    ObjectId::new(hex(&hasher.finalize()))
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `bytes` as lowercase hex: object ids, and the SHA-256 sums of backups.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    out
}

/// Whether `id` looks like an id this host made (64 lowercase hex digits);
/// anything else is refused before it can reach a path.
pub(crate) fn is_object_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| HEX.contains(&b))
}

/// The directory holding every object file of a data directory.
pub(crate) fn objects_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("objects")
}

/// `<data>/objects/<first two hex digits>/<id>.sqlite`: the fan-out keeps
/// directories small with many objects.
pub(crate) fn object_path(data_dir: &Path, id: &ObjectId) -> PathBuf {
    data_dir.join(object_file(id.as_str()))
}

/// [`object_path`] relative to the data directory (or to a backup, which
/// keeps the same layout).
pub(crate) fn object_file(id: &str) -> PathBuf {
    let shard = id.get(..2).unwrap_or("00");
    Path::new("objects")
        .join(shard)
        .join(format!("{id}.sqlite"))
}

/// Which of `executors` runs object `id`: a stable function of the id, so
/// every call and alarm of one object lands on the same thread.
pub(crate) fn executor_of(id: &ObjectId, executors: usize) -> usize {
    let prefix = id.as_str().get(..15).unwrap_or("0");
    let hash = u64::from_str_radix(prefix, 16).unwrap_or(0);
    // executors >= 1 and the remainder is < executors, so it fits usize.
    usize::try_from(hash % (executors.max(1) as u64)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_64_hex_digits_and_differ_by_namespace() {
        let a = object_id("a", "x");
        let b = object_id("b", "x");
        assert!(is_object_id(a.as_str()));
        assert_ne!(a, b);
        assert_ne!(object_id("a\u{1}", "x"), object_id("a", "\u{1}x"));
    }

    #[test]
    fn names_are_checked_against_each_rule() {
        assert!(validate_name("object name", "").is_err());
        assert!(validate_name("object name", &"x".repeat(1025)).is_err());
        assert!(validate_name("object name", &"x".repeat(1024)).is_ok());
        assert!(validate_name("object name", "a\0b").is_err());
        assert!(validate_name("object name", "../../etc/passwd").is_ok());
    }
}
