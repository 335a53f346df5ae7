//! Group commit (`Synchronous::Batched`, the default): no reply is released
//! before the writes it follows are durable, through a SIGKILL and through
//! a power cut.
//!
//! A power cut is modelled with the host's sync images: after each flush
//! the host copies the database and WAL files exactly as that flush made
//! them durable, before any reply it covers is released. Restoring the
//! newest image drops every write not yet synced, which is the worst a
//! power cut may do. The child half of the crash test runs when
//! `DURABILITY_HOST_GATES_CHILD_DIR` is set.

mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::time::Duration;

use durability_host::{CallError, FlushMethod, Host, HostError, ObjectId, Stub, Synchronous};
use durability_platform::Context;
use support::{Notes, notes};

const CHILD_DIR_ENV: &str = "DURABILITY_HOST_GATES_CHILD_DIR";
const CHILD_TEST: &str = "child_writes_on_four_objects_until_killed";
const RELEASED_MARK: &str = "gates-child released ";
/// The parent kills the child after this many released replies.
const RELEASED_BEFORE_KILL: usize = 300;
const WRITERS: usize = 4;

/// Copies a directory tree.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// The disk as a power cut now would leave it: the newest sync image,
/// restored into a fresh directory (empty before the first flush), with
/// its journal replayed as the next start would.
fn power_cut(images: &Path) -> tempfile::TempDir {
    let restored = power_cut_unreplayed(images);
    durability_host::replay_journal(restored.path()).unwrap();
    restored
}

/// The newest sync image as the disk holds it, journal and all.
fn power_cut_unreplayed(images: &Path) -> tempfile::TempDir {
    loop {
        let restored = tempfile::tempdir().unwrap();
        let Ok(latest) = std::fs::read_to_string(images.join("latest")) else {
            return restored;
        };
        // A newer image may replace this one while it is copied: take that.
        if copy_tree(&images.join(latest.trim()), restored.path()).is_ok() {
            return restored;
        }
    }
}

/// A host started on a power-cut disk replays the journal first, in
/// whatever mode it runs: here `Full`, which keeps no journal of its own.
#[tokio::test]
async fn a_host_in_any_mode_replays_a_journal_it_finds() {
    let dir = tempfile::tempdir().unwrap();
    let images = tempfile::tempdir().unwrap();
    let host = batched_host(dir.path(), images.path(), FlushMethod::Journal);
    let stub = notes(&host).stub("replayed").unwrap();
    for i in 0..5 {
        let text = format!("row {i}");
        stub.call(move |o: Rc<Notes>| async move { o.add(&text) })
            .await
            .unwrap()
            .unwrap();
    }
    let cut = power_cut_unreplayed(images.path());
    host.shutdown().await;
    let file = file_under(&host, stub.id(), cut.path());
    let mut wal = file.clone().into_os_string();
    wal.push("-wal");
    assert!(
        !Path::new(&wal).exists(),
        "an image with the journal holds no WAL"
    );
    let after = Host::builder(cut.path())
        .threads(1)
        .synchronous(Synchronous::Full)
        .build()
        .unwrap();
    let texts = texts_of(&after, "replayed").await;
    assert_eq!(
        texts,
        (0..5).map(|i| format!("row {i}")).collect::<Vec<_>>()
    );
    after.shutdown().await;
    let segments = std::fs::read_dir(cut.path().join("journal"))
        .unwrap()
        .count();
    assert_eq!(segments, 0, "the replayed segments are gone");
}

/// The notes of object `name` on `host`.
async fn texts_of(host: &Host, name: &str) -> Vec<String> {
    notes(host)
        .stub(name)
        .unwrap()
        .call(|o: Rc<Notes>| async move { o.texts().unwrap() })
        .await
        .unwrap()
}

/// Where object `id`'s file lies under another data directory.
fn file_under(host: &Host, id: &ObjectId, data_dir: &Path) -> PathBuf {
    let file = host.object_file(id);
    let relative = file.strip_prefix(host.data_dir()).unwrap();
    data_dir.join(relative)
}

/// The notes of the object file at `path` (recovering its WAL), or none
/// if the file does not exist there.
fn notes_in(path: &Path) -> Vec<String> {
    if !path.exists() {
        return Vec::new();
    }
    let conn = rusqlite::Connection::open(path).unwrap();
    let exists: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE name = 'notes'",
            [],
            |row| row.get(0),
        )
        .unwrap();
    if exists == 0 {
        return Vec::new();
    }
    let mut stmt = conn.prepare("SELECT text FROM notes").unwrap();
    stmt.query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// (the alarm in the object file, the alarm in the host's index).
fn alarms_in(data_dir: &Path, file: &Path, id: &ObjectId) -> (Option<i64>, Option<i64>) {
    if !file.exists() {
        return (None, None);
    }
    let object = rusqlite::Connection::open(file).unwrap();
    let in_file = object
        .query_row("SELECT at_ms FROM _durability_host_alarm", [], |row| {
            row.get(0)
        })
        .ok();
    let index = rusqlite::Connection::open(data_dir.join("index.sqlite")).unwrap();
    let in_index = index
        .query_row(
            "SELECT at_ms FROM alarms WHERE id = ?1",
            [id.as_str()],
            |row| row.get(0),
        )
        .ok();
    (in_file, in_index)
}

fn batched_host(dir: &Path, images: &Path, method: FlushMethod) -> Host {
    Host::builder(dir)
        .threads(2)
        .flush_method(method)
        .sync_images(images)
        .build()
        .unwrap()
}

/// With the journal an image holds no WAL file at all: every write to a
/// WAL comes back from the journal's replay.
#[tokio::test]
async fn every_released_reply_is_in_the_newest_sync_image() {
    for method in [FlushMethod::Journal, FlushMethod::WalFiles] {
        every_released_reply_is_in_the_image(method).await;
    }
}

async fn every_released_reply_is_in_the_image(method: FlushMethod) {
    let dir = tempfile::tempdir().unwrap();
    let images = tempfile::tempdir().unwrap();
    let host = batched_host(dir.path(), images.path(), method);
    let namespace = notes(&host);
    let stubs: Vec<_> = (0..3)
        .map(|n| namespace.stub(&format!("object-{n}")).unwrap())
        .collect();
    // One by one, then many at once on shared objects.
    for i in 0..30 {
        let stub = &stubs[i % stubs.len()];
        let text = format!("row {i}");
        let written = text.clone();
        stub.call(move |o: Rc<Notes>| async move { o.add(&written) })
            .await
            .unwrap()
            .unwrap();
        let cut = power_cut(images.path());
        let rows = notes_in(&file_under(&host, stub.id(), cut.path()));
        assert!(
            rows.contains(&text),
            "{method:?}: {text} released but not durable"
        );
    }
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..32 {
        let stub = stubs[i % stubs.len()].clone();
        let host = host.clone();
        let images = images.path().to_path_buf();
        calls.spawn(async move {
            let text = format!("together {i}");
            let written = text.clone();
            stub.call(move |o: Rc<Notes>| async move { o.add(&written) })
                .await
                .unwrap()
                .unwrap();
            let cut = power_cut(&images);
            let rows = notes_in(&file_under(&host, stub.id(), cut.path()));
            assert!(
                rows.contains(&text),
                "{method:?}: {text} released but not durable"
            );
        });
    }
    while let Some(done) = calls.join_next().await {
        done.unwrap();
    }
    host.shutdown().await;
}

#[tokio::test]
async fn the_index_in_every_sync_image_is_never_later_than_the_object_file() {
    let dir = tempfile::tempdir().unwrap();
    let images = tempfile::tempdir().unwrap();
    let host = batched_host(dir.path(), images.path(), FlushMethod::default());
    let stub = notes(&host).stub("alarmed").unwrap();
    let far = host.now_ms() + 86_400_000;
    // Raise, lower and clear in turn: the index may be early or stale in
    // an image, never later than the file (an alarm would be missed).
    for i in 0..40_i64 {
        let step = match i % 4 {
            0 => Some(far + i * 1_000),
            1 => Some(far - i * 1_000),
            2 => None,
            _ => Some(far + 100_000 + i),
        };
        stub.call(move |o: Rc<Notes>| async move {
            match step {
                Some(at) => o.ctx.storage().set_alarm(at).await,
                None => o.ctx.storage().delete_alarm().await,
            }
        })
        .await
        .unwrap()
        .unwrap();
        let cut = power_cut(images.path());
        let file = file_under(&host, stub.id(), cut.path());
        let (in_file, in_index) = alarms_in(cut.path(), &file, stub.id());
        assert_eq!(in_file, step, "the released alarm change is durable");
        if let Some(at) = in_file {
            assert!(
                in_index.is_some_and(|indexed| indexed <= at),
                "step {i}: file {at}, index {in_index:?}"
            );
        }
    }
    // Cleared for good: the index follows once the clearing commit is
    // durable (a later flush syncs the index itself).
    stub.call(|o: Rc<Notes>| async move { o.ctx.storage().delete_alarm().await })
        .await
        .unwrap()
        .unwrap();
    let id = stub.id().clone();
    let file = host.object_file(&id);
    host.shutdown().await;
    let (in_file, in_index) = alarms_in(dir.path(), &file, &id);
    assert_eq!((in_file, in_index), (None, None));
}

/// The flush methods that sync files by their paths, where the platform
/// has them. The journal syncs a file it holds open: a move of the data
/// directory does not reach it (see
/// `a_moved_data_directory_does_not_hold_the_journal_s_replies`).
fn flush_methods() -> Vec<FlushMethod> {
    let mut methods = vec![FlushMethod::WalFiles];
    if cfg!(target_os = "linux") {
        methods.push(FlushMethod::Syncfs);
    }
    methods
}

#[tokio::test]
async fn a_failed_sync_withholds_the_reply_and_every_later_one() {
    for method in flush_methods() {
        a_failed_sync_withholds_replies(method).await;
    }
}

/// A host on `<temp>/data` with one object that committed and replied
/// (its WAL exists), so the directory can be moved away under it: the
/// flusher opens the data directory (syncfs) or the object's WAL by its
/// path, and neither opens then, while SQLite keeps its open files and
/// commits on. Returns the temporary parent, the data directory, the host
/// and the object's stub.
async fn host_whose_directory_can_move(
    method: FlushMethod,
    open_retry_window: Duration,
) -> (tempfile::TempDir, PathBuf, Host, Stub<Notes>) {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("data");
    let host = Host::builder(&dir)
        .threads(1)
        .flush_method(method)
        .open_retry_window(open_retry_window)
        .build()
        .unwrap();
    let stub = notes(&host).stub("moved").unwrap();
    stub.call(|o: Rc<Notes>| async move { o.add("before") })
        .await
        .unwrap()
        .unwrap();
    (parent, dir, host, stub)
}

async fn a_failed_sync_withholds_replies(method: FlushMethod) {
    // A file that cannot be opened fails the sync at once.
    let (parent, dir, host, stub) = host_whose_directory_can_move(method, Duration::ZERO).await;
    std::fs::rename(&dir, parent.path().join("moved")).unwrap();
    for text in ["after", "later"] {
        let error = stub
            .call(move |o: Rc<Notes>| async move { o.add(text) })
            .await
            .unwrap_err();
        assert!(
            matches!(&error, CallError::NotDurable { message, .. } if message.contains("sync")),
            "{method:?}: {error}"
        );
    }
    host.shutdown().await;
}

/// With `WalFiles` the WAL is missing from its path: not a WAL a close
/// removed (its directory is gone too), so it is not counted as synced.
#[tokio::test]
async fn a_data_directory_that_cannot_be_opened_for_a_while_holds_replies_until_it_can() {
    for method in flush_methods() {
        replies_wait_for_the_directory(method).await;
    }
}

async fn replies_wait_for_the_directory(method: FlushMethod) {
    // The default window: long past this test's wait.
    let (parent, dir, host, stub) =
        host_whose_directory_can_move(method, Duration::from_secs(30)).await;
    let moved = parent.path().join("moved");
    std::fs::rename(&dir, &moved).unwrap();
    let call = {
        let stub = stub.clone();
        tokio::spawn(async move {
            stub.call(|o: Rc<Notes>| async move { o.add("during") })
                .await
        })
    };
    // Retries fail meanwhile; the reply waits and is not failed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!call.is_finished(), "{method:?}: the reply was not held");
    std::fs::rename(&moved, &dir).unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(60), call)
        .await
        .expect("the reply was never released")
        .unwrap();
    assert!(matches!(reply, Ok(Ok(()))), "{method:?}: {reply:?}");
    // The gates stayed open.
    stub.call(|o: Rc<Notes>| async move { o.add("after") })
        .await
        .unwrap()
        .unwrap();
    host.shutdown().await;
}

/// The journal is an open file that moves with its directory: replies
/// are released, and the next host on the moved directory has them.
#[tokio::test]
async fn a_moved_data_directory_does_not_hold_the_journal_s_replies() {
    let (parent, dir, host, stub) =
        host_whose_directory_can_move(FlushMethod::Journal, Duration::ZERO).await;
    let moved = parent.path().join("moved");
    std::fs::rename(&dir, &moved).unwrap();
    stub.call(|o: Rc<Notes>| async move { o.add("after") })
        .await
        .unwrap()
        .unwrap();
    host.shutdown().await;
    assert!(!dir.exists());
    let host = Host::builder(&moved).threads(1).build().unwrap();
    assert_eq!(texts_of(&host, "moved").await, ["before", "after"]);
    host.shutdown().await;
}

#[test]
fn sync_images_need_the_batched_mode_and_syncfs_is_linux_only() {
    let dir = tempfile::tempdir().unwrap();
    let refused = Host::builder(dir.path())
        .threads(1)
        .synchronous(Synchronous::Full)
        .sync_images(dir.path().join("images"))
        .build();
    assert!(matches!(
        refused,
        Err(HostError::InvalidSetting {
            setting: "sync_images",
            ..
        })
    ));
    if !cfg!(target_os = "linux") {
        let refused = Host::builder(dir.path())
            .threads(1)
            .flush_method(FlushMethod::Syncfs)
            .build();
        assert!(matches!(
            refused,
            Err(HostError::InvalidSetting {
                setting: "flush_method",
                ..
            })
        ));
    }
}

#[test]
fn a_killed_process_and_a_power_cut_keep_every_released_reply() {
    let dir = tempfile::tempdir().unwrap();
    let images = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            CHILD_TEST,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR_ENV, dir.path())
        .env("DURABILITY_HOST_GATES_IMAGES", images.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut released: Vec<(String, String)> = Vec::new();
    for line in stdout.lines() {
        let line = line.unwrap();
        if let Some((_, rest)) = line.split_once(RELEASED_MARK) {
            let (object, text) = rest.split_once(' ').unwrap();
            released.push((object.to_owned(), text.to_owned()));
            if released.len() == RELEASED_BEFORE_KILL {
                break;
            }
        }
    }
    // SIGKILL while four writers keep committing.
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(released.len(), RELEASED_BEFORE_KILL);
    let cut = power_cut(images.path());

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let host = Host::builder(dir.path()).threads(1).build().unwrap();
        let namespace = notes(&host);
        for n in 0..WRITERS {
            let object = format!("writer-{n}");
            let stub = namespace.stub(&object).unwrap();
            let expected: Vec<&String> = released
                .iter()
                .filter(|(o, _)| *o == object)
                .map(|(_, text)| text)
                .collect();
            // Process crash: the files as the killed process left them.
            let after_kill = stub
                .call(|o: Rc<Notes>| async move { o.texts().unwrap() })
                .await
                .unwrap();
            // Power cut: only what the flusher had synced.
            let after_cut = notes_in(&file_under(&host, stub.id(), cut.path()));
            for text in &expected {
                assert!(
                    after_kill.contains(text),
                    "{object}: {text} lost by SIGKILL"
                );
                assert!(
                    after_cut.contains(text),
                    "{object}: {text} lost by power cut"
                );
            }
        }
        host.shutdown().await;
    });
}

#[tokio::test]
#[ignore = "the child half of a_killed_process_and_a_power_cut_keep_every_released_reply"]
async fn child_writes_on_four_objects_until_killed() {
    let (Some(dir), Some(images)) = (
        std::env::var_os(CHILD_DIR_ENV),
        std::env::var_os("DURABILITY_HOST_GATES_IMAGES"),
    ) else {
        return;
    };
    let host = batched_host(Path::new(&dir), Path::new(&images), FlushMethod::default());
    let namespace = notes(&host);
    let mut writers = tokio::task::JoinSet::new();
    for n in 0..WRITERS {
        let stub = namespace.stub(&format!("writer-{n}")).unwrap();
        writers.spawn(async move {
            for i in 0.. {
                let text = format!("{n}-{i}");
                let written = text.clone();
                stub.call(move |o: Rc<Notes>| async move { o.add(&written) })
                    .await
                    .unwrap()
                    .unwrap();
                // Printed only once the reply was released.
                println!("{RELEASED_MARK}writer-{n} {text}");
            }
        });
    }
    while writers.join_next().await.is_some() {}
}

#[tokio::test]
async fn full_and_normal_stay_available_and_keep_what_they_committed() {
    for mode in [Synchronous::Full, Synchronous::Normal] {
        let dir = tempfile::tempdir().unwrap();
        let host = Host::builder(dir.path())
            .threads(1)
            .synchronous(mode)
            .build()
            .unwrap();
        let stub = notes(&host).stub("plain").unwrap();
        stub.call(|o: Rc<Notes>| async move { o.add("kept") })
            .await
            .unwrap()
            .unwrap();
        host.shutdown().await;
        let again = Host::builder(dir.path()).threads(1).build().unwrap();
        let texts = notes(&again)
            .stub("plain")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.texts().unwrap() })
            .await
            .unwrap();
        assert_eq!(texts, ["kept"], "{mode:?}");
        again.shutdown().await;
    }
}
