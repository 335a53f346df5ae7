//! Where an archive's files live: a local directory (`file:///path`) or
//! S3-compatible object storage (`s3://bucket/prefix`, through the
//! `object_store` crate). The archiver and the restore see one small set
//! of verbs (put a whole file, get one, list a folder, delete a tree) and
//! never which store answers.
//!
//! What both promise: a file `put` is whole or absent. A local directory
//! gets it from a temporary name, an fsync, a rename and a sync of the
//! directory; an S3 PUT is atomic by the protocol and acknowledged only
//! once the store holds the object. That is what lets the archive write
//! its chunks and bases first and its manifest last: a manifest never
//! names a file that a crash could have lost.

use std::fs::File;
use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use object_store::aws::AmazonS3Builder;
use object_store::prefix::PrefixStore;
use object_store::{ObjectStore, ObjectStoreExt as _, RetryConfig};

use super::{ArchiveError, io};

/// How long one request to object storage may be retried before the
/// cycle gives up (the archiver tries again at its next cycle, and the
/// journal keeps what is not shipped meanwhile).
const S3_RETRY_TIMEOUT: Duration = Duration::from_secs(30);
/// Retries of one request within [`S3_RETRY_TIMEOUT`].
const S3_MAX_RETRIES: usize = 4;

/// Where an archive lives, parsed from its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArchiveLocation {
    /// A local directory (`file:///absolute/path`, or a plain path where
    /// a command takes one).
    Directory(PathBuf),
    /// S3-compatible object storage: `s3://bucket/prefix`. Credentials,
    /// region and endpoint come from the usual AWS environment variables
    /// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` or
    /// `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` or `AWS_ENDPOINT`,
    /// `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP=true` for a plain-HTTP
    /// endpoint).
    S3 {
        /// The bucket.
        bucket: String,
        /// The key prefix every file of the archive is under (may be
        /// empty: the bucket's root).
        prefix: String,
    },
}

impl ArchiveLocation {
    /// Parses an archive URL: `file:///absolute/path` or
    /// `s3://bucket[/prefix]`.
    pub fn parse(url: &str) -> Result<Self, ArchiveError> {
        let invalid = |rule: &'static str| ArchiveError::InvalidUrl {
            url: url.to_owned(),
            rule,
        };
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let prefix = prefix.trim_end_matches('/');
            // S3's bucket naming rules, so a typo fails here and not at
            // the first request.
            let bucket_ok = (3..=63).contains(&bucket.len())
                && bucket.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                })
                && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
                && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
            if !bucket_ok {
                return Err(invalid(
                    "must name a bucket of 3 to 63 lowercase letters, digits, `-` and `.` (s3://bucket/prefix)",
                ));
            }
            if prefix
                .split('/')
                .any(|part| part == "." || part == ".." || (part.is_empty() && !prefix.is_empty()))
            {
                return Err(invalid("its prefix must not hold empty, `.` or `..` parts"));
            }
            return Ok(ArchiveLocation::S3 {
                bucket: bucket.to_owned(),
                prefix: prefix.to_owned(),
            });
        }
        let path = url
            .strip_prefix("file://")
            .ok_or_else(|| invalid("must start with file:// or s3://"))?;
        if !path.starts_with('/') {
            return Err(invalid(
                "must name an absolute path (file:///dir, three slashes)",
            ));
        }
        if path.split('/').any(|part| part == "..") {
            return Err(invalid("must not contain `..`"));
        }
        Ok(ArchiveLocation::Directory(PathBuf::from(path)))
    }

    /// The location as a URL (`file:///...` or `s3://bucket/prefix`).
    pub fn url(&self) -> String {
        match self {
            ArchiveLocation::Directory(path) => format!("file://{}", path.display()),
            ArchiveLocation::S3 { bucket, prefix } if prefix.is_empty() => {
                format!("s3://{bucket}")
            }
            ArchiveLocation::S3 { bucket, prefix } => format!("s3://{bucket}/{prefix}"),
        }
    }
}

/// An open store: the verbs the archive uses.
pub(crate) enum Store {
    Directory(PathBuf),
    S3(S3Store),
}

/// An S3 bucket under a prefix, with the runtime its client needs.
pub(crate) struct S3Store {
    url: String,
    store: Arc<dyn ObjectStore>,
    /// One worker thread: the archive's requests are sequential, and the
    /// callers (the archiver's own thread, a command, a test inside
    /// another runtime) only wait on a channel, never enter this runtime.
    /// `None` only while it is dropped.
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for S3Store {
    fn drop(&mut self) {
        // Dropping a runtime blocks until its tasks end, which panics
        // inside another runtime: let its thread go in the background.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Store {
    /// Opens the store `location` names. For S3, builds the client from
    /// the environment (nothing is sent yet).
    pub(crate) fn open(location: &ArchiveLocation) -> Result<Store, ArchiveError> {
        match location {
            ArchiveLocation::Directory(path) => Ok(Store::Directory(path.clone())),
            ArchiveLocation::S3 { bucket, prefix } => {
                let url = location.url();
                let failed = |message: String| ArchiveError::Store {
                    url: url.clone(),
                    message,
                };
                let s3 = AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .with_retry(RetryConfig {
                        max_retries: S3_MAX_RETRIES,
                        retry_timeout: S3_RETRY_TIMEOUT,
                        ..RetryConfig::default()
                    })
                    .build()
                    .map_err(|e| failed(format!("cannot configure the S3 client: {e}")))?;
                let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
                    Arc::new(s3)
                } else {
                    Arc::new(PrefixStore::new(s3, prefix.as_str()))
                };
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("durability-archive-s3")
                    .enable_all()
                    .build()
                    .map_err(|e| failed(format!("cannot start the S3 client's runtime: {e}")))?;
                Ok(Store::S3(S3Store {
                    url,
                    store,
                    runtime: Some(runtime),
                }))
            }
        }
    }

    /// The store's URL.
    pub(crate) fn url(&self) -> String {
        match self {
            Store::Directory(root) => ArchiveLocation::Directory(root.clone()).url(),
            Store::S3(s3) => s3.url.clone(),
        }
    }

    /// The name of file `rel` in errors and reports: its local path, or
    /// its `s3://` URL.
    pub(crate) fn name(&self, rel: &str) -> PathBuf {
        match self {
            Store::Directory(root) => root.join(rel),
            Store::S3(s3) => PathBuf::from(format!("{}/{rel}", s3.url)),
        }
    }

    /// The local directory, for a store that is one.
    pub(crate) fn directory(&self) -> Option<&Path> {
        match self {
            Store::Directory(root) => Some(root),
            Store::S3(_) => None,
        }
    }

    /// Makes sure the store can be written (a local directory is made).
    pub(crate) fn prepare(&self) -> Result<(), ArchiveError> {
        match self {
            Store::Directory(root) => crate::directory::create_durably(root).map_err(io(root)),
            Store::S3(_) => Ok(()),
        }
    }

    /// Removes what a writer killed mid-file left in a local archive: the
    /// hidden temporary files of [`put_file`] (`.NAME.PID.tmp`) and the
    /// hidden directories of a base being copied (`.NAME.partial-*`).
    /// Nothing names them, so a restore never reads them, but a
    /// half-copied base can be as large as a whole one. Object storage
    /// has none: a PUT is whole or absent. Call only while no other host
    /// ships to the same archive (one archive per data directory).
    pub(crate) fn remove_leftovers(&self) -> Result<u64, ArchiveError> {
        let Store::Directory(root) = self else {
            return Ok(0);
        };
        let mut removed = 0;
        let mut pending = vec![root.clone()];
        while let Some(folder) = pending.pop() {
            let entries = match std::fs::read_dir(&folder) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(&folder)(e)),
            };
            for entry in entries {
                let entry = entry.map_err(io(&folder))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let path = entry.path();
                let is_dir = entry.file_type().map_err(io(&path))?.is_dir();
                let hidden = name.starts_with('.');
                if hidden && is_dir && name.contains(".partial-") {
                    std::fs::remove_dir_all(&path).map_err(io(&path))?;
                    removed += 1;
                } else if hidden && !is_dir && name.ends_with(".tmp") {
                    std::fs::remove_file(&path).map_err(io(&path))?;
                    removed += 1;
                } else if is_dir {
                    pending.push(path);
                }
            }
        }
        Ok(removed)
    }

    /// Writes `bytes` as file `rel`, whole or not at all.
    pub(crate) fn put(&self, rel: &str, bytes: Vec<u8>) -> Result<(), ArchiveError> {
        match self {
            Store::Directory(root) => put_file(root, rel, &bytes),
            Store::S3(s3) => {
                let location = object_path(rel);
                let store = Arc::clone(&s3.store);
                s3.run(async move { store.put(&location, bytes.into()).await.map(|_| ()) })
                    .map_err(|e| s3.failed(rel, e))
            }
        }
    }

    /// Reads file `rel`; `None` when there is none.
    pub(crate) fn get(&self, rel: &str) -> Result<Option<Vec<u8>>, ArchiveError> {
        match self {
            Store::Directory(root) => {
                let path = root.join(rel);
                match std::fs::read(&path) {
                    Ok(bytes) => Ok(Some(bytes)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(io(&path)(e)),
                }
            }
            Store::S3(s3) => {
                let location = object_path(rel);
                let store = Arc::clone(&s3.store);
                let got = s3.run(async move {
                    match store.get(&location).await {
                        Ok(got) => got.bytes().await.map(|b| Some(b.to_vec())),
                        Err(object_store::Error::NotFound { .. }) => Ok(None),
                        Err(e) => Err(e),
                    }
                });
                got.map_err(|e| s3.failed(rel, e))
            }
        }
    }

    /// The files under folder `rel`, as paths relative to it (`a/b`),
    /// sorted.
    pub(crate) fn list(&self, rel: &str) -> Result<Vec<String>, ArchiveError> {
        let mut names = match self {
            Store::Directory(root) => list_local(&root.join(rel))?,
            Store::S3(s3) => {
                let folder = object_path(rel);
                let store = Arc::clone(&s3.store);
                let listed = s3.run(async move {
                    store
                        .list(Some(&folder))
                        .map_ok(|meta| meta.location)
                        .try_collect::<Vec<_>>()
                        .await
                });
                let listed = listed.map_err(|e| s3.failed(rel, e))?;
                let folder = object_path(rel);
                listed
                    .iter()
                    .filter_map(|location| {
                        let parts: Vec<String> = location
                            .prefix_match(&folder)?
                            .map(|part| part.as_ref().to_owned())
                            .collect();
                        Some(parts.join("/"))
                    })
                    .filter(|name| !name.is_empty())
                    .collect()
            }
        };
        names.sort();
        Ok(names)
    }

    /// Deletes file `rel`; one that is already gone is no failure.
    pub(crate) fn delete(&self, rel: &str) -> Result<(), ArchiveError> {
        match self {
            Store::Directory(root) => {
                let path = root.join(rel);
                gone_already_ok(std::fs::remove_file(&path)).map_err(io(&path))
            }
            Store::S3(s3) => {
                let location = object_path(rel);
                let store = Arc::clone(&s3.store);
                s3.run(async move {
                    match store.delete(&location).await {
                        Err(object_store::Error::NotFound { .. }) => Ok(()),
                        other => other,
                    }
                })
                .map_err(|e| s3.failed(rel, e))
            }
        }
    }

    /// Deletes folder `rel` and everything under it.
    pub(crate) fn delete_tree(&self, rel: &str) -> Result<(), ArchiveError> {
        match self {
            Store::Directory(root) => {
                let path = root.join(rel);
                gone_already_ok(std::fs::remove_dir_all(&path)).map_err(io(&path))
            }
            // One listing, then S3's bulk delete (up to 1,000 keys a
            // request): a base of 10,000 objects goes in a few requests.
            Store::S3(s3) => {
                let folder = object_path(rel);
                let store = Arc::clone(&s3.store);
                s3.run(async move {
                    let locations = store.list(Some(&folder)).map_ok(|meta| meta.location);
                    store
                        .delete_stream(locations.boxed())
                        .try_for_each(|_| async { Ok(()) })
                        .await
                })
                .map_err(|e| s3.failed(rel, e))
            }
        }
    }

    /// Copies the local folder `from` (a backup) to folder `rel`: every
    /// file but `last` first, then `last`, so a folder whose `last` file
    /// is there is whole.
    pub(crate) fn put_tree(&self, rel: &str, from: &Path, last: &str) -> Result<(), ArchiveError> {
        let mut files = list_local(from)?;
        files.sort_by_key(|name| name == last);
        for name in files {
            let path = from.join(&name);
            let bytes = std::fs::read(&path).map_err(io(&path))?;
            self.put(&format!("{rel}/{name}"), bytes)?;
        }
        Ok(())
    }

    /// Copies folder `rel` into the local folder `into` (made if missing).
    pub(crate) fn get_tree(&self, rel: &str, into: &Path) -> Result<(), ArchiveError> {
        for name in self.list(rel)? {
            let file = format!("{rel}/{name}");
            let bytes = self.get(&file)?.ok_or_else(|| ArchiveError::Damaged {
                file: self.name(&file),
                rule: "listed, then missing when read".into(),
            })?;
            let path = into.join(&name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io(parent))?;
            }
            std::fs::write(&path, bytes).map_err(io(&path))?;
        }
        Ok(())
    }
}

impl S3Store {
    /// Runs one request on the store's runtime and waits for it.
    fn run<T: Send + 'static>(
        &self,
        request: impl Future<Output = object_store::Result<T>> + Send + 'static,
    ) -> object_store::Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        if let Some(runtime) = &self.runtime {
            runtime.spawn(async move {
                let _ = tx.send(request.await);
            });
        }
        rx.recv().unwrap_or_else(|_| {
            Err(object_store::Error::Generic {
                store: "S3",
                source: "the S3 client's runtime stopped".into(),
            })
        })
    }

    fn failed(&self, rel: &str, error: object_store::Error) -> ArchiveError {
        ArchiveError::Store {
            url: format!("{}/{rel}", self.url),
            message: error.to_string(),
        }
    }
}

/// A removal of what is already gone is no failure.
fn gone_already_ok(removed: std::io::Result<()>) -> std::io::Result<()> {
    match removed {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

fn object_path(rel: &str) -> object_store::path::Path {
    object_store::path::Path::from(rel)
}

/// Writes `bytes` at `root/rel` atomically: a temporary name, synced,
/// renamed, the directory synced.
fn put_file(root: &Path, rel: &str, bytes: &[u8]) -> Result<(), ArchiveError> {
    let path = root.join(rel);
    let dir = path
        .parent()
        .map_or_else(|| root.to_path_buf(), Path::to_path_buf);
    crate::directory::create_durably(&dir).map_err(io(&dir))?;
    let staged = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        std::process::id()
    ));
    let written = File::create(&staged)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&staged, &path))
        .and_then(|()| crate::directory::sync(&dir));
    if let Err(error) = written {
        let _ = std::fs::remove_file(&staged);
        return Err(io(&path)(error));
    }
    Ok(())
}

/// The files under local folder `dir` (none if it does not exist), as
/// relative paths; temporary files of [`put_file`] are left out. Walks
/// with a stack, not recursion: a deep tree cannot overflow it.
fn list_local(dir: &Path) -> Result<Vec<String>, ArchiveError> {
    let mut names = Vec::new();
    let mut pending = vec![(dir.to_path_buf(), String::new())];
    while let Some((folder, prefix)) = pending.pop() {
        let entries = match std::fs::read_dir(&folder) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(&folder)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(io(&folder))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            let kind = entry.file_type().map_err(io(&entry.path()))?;
            if kind.is_dir() {
                pending.push((entry.path(), rel));
            } else if !(name.starts_with('.') && name.ends_with(".tmp")) {
                names.push(rel);
            }
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_urls_parse_into_a_directory_or_a_bucket_and_prefix() {
        assert_eq!(
            ArchiveLocation::parse("file:///a/b").ok(),
            Some(ArchiveLocation::Directory(PathBuf::from("/a/b")))
        );
        assert_eq!(
            ArchiveLocation::parse("s3://my-bucket/some/prefix/").ok(),
            Some(ArchiveLocation::S3 {
                bucket: "my-bucket".into(),
                prefix: "some/prefix".into()
            })
        );
        assert_eq!(
            ArchiveLocation::parse("s3://my-bucket")
                .ok()
                .map(|l| l.url()),
            Some("s3://my-bucket".to_owned())
        );
        for bad in [
            "/a/b",
            "file://a/b",
            "file:///a/../b",
            "s3://",
            "s3://UPPER/x",
            "s3://ab/x",
            "s3://bucket/a//b",
            "s3://bucket/../b",
            "gs://bucket/x",
        ] {
            assert!(
                matches!(
                    ArchiveLocation::parse(bad),
                    Err(ArchiveError::InvalidUrl { .. })
                ),
                "{bad:?}"
            );
        }
    }
}
