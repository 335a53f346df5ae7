//! The binary under the conditions an operator meets: unreadable or
//! read-only data directories, redirected logs, a file-size limit, a path
//! too long for SQLite, a rebuilt alarm index. The real executable in a
//! child process, on real files.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;

use durability_host::{DurableObject, Host, ObjectContext};
use durability_platform::Context;

mod support;
use support::{durability, path_arg, run, show};

struct Thing(ObjectContext);
impl DurableObject for Thing {}

/// Makes a data directory with `n` objects, each with a row and an alarm
/// an hour ahead, through the real host.
fn data_dir_with_objects(dir: &Path, n: usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    runtime.block_on(async {
        let host = Host::builder(dir)
            .threads(1)
            .build()
            .unwrap_or_else(|e| panic!("host: {e}"));
        let things = host
            .namespace("things", |ctx| {
                ctx.storage()
                    .execute_script("CREATE TABLE IF NOT EXISTS t (v INTEGER)")?;
                Ok(Thing(ctx))
            })
            .unwrap_or_else(|e| panic!("namespace: {e}"));
        let at = host.now_ms() + 3_600_000;
        for i in 0..n {
            things
                .stub(&format!("thing-{i}"))
                .unwrap_or_else(|e| panic!("stub: {e}"))
                .call(move |o: Rc<Thing>| async move {
                    o.0.storage().execute("INSERT INTO t (v) VALUES (1)", &[])?;
                    o.0.storage().set_alarm(at).await
                })
                .await
                .unwrap_or_else(|e| panic!("call: {e}"))
                .unwrap_or_else(|e| panic!("storage: {e}"));
        }
        host.shutdown().await;
    });
    // The host's executor thread closes the index a moment after shutdown
    // returns (its close checkpoints and removes the -wal): wait for it,
    // so no test races that close.
    let wal = dir.join("index.sqlite-wal");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while wal.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Every object file under `dir`.
fn object_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for shard in std::fs::read_dir(dir.join("objects")).unwrap_or_else(|e| panic!("{e}")) {
        let shard = shard.unwrap_or_else(|e| panic!("{e}")).path();
        for file in std::fs::read_dir(&shard).unwrap_or_else(|e| panic!("{e}")) {
            let path = file.unwrap_or_else(|e| panic!("{e}")).path();
            if path.extension().is_some_and(|e| e == "sqlite") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn inspect_exits_non_zero_when_an_object_is_unreadable_and_still_lists_the_others() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    data_dir_with_objects(dir.path(), 3);
    let files = object_files(dir.path());
    std::fs::write(&files[0], b"this is not a database").unwrap_or_else(|e| panic!("{e}"));
    let output = run(durability().args(["inspect", path_arg(dir.path()), "--json"]));
    assert!(!output.status.success(), "{}", show(&output));
    let listing: serde_json::Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&output)));
    let objects = listing["objects"].as_array().cloned().unwrap_or_default();
    assert_eq!(objects.len(), 3);
    assert_eq!(objects.iter().filter(|o| !o["error"].is_null()).count(), 1);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("1 of 3 object files"), "{stderr}");
}

/// Runs `command` as an unprivileged user when this test runs as root
/// (root ignores file permissions, so a read-only directory would not be
/// read-only to it). The binary is linked into `dir` so that the user can
/// reach it.
fn as_unprivileged(command: &mut Command, dir: &Path) -> Command {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return std::mem::replace(command, Command::new("true"));
    }
    let binary = dir.join("durability");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_durability"), &binary).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_durability"), &binary)
            .unwrap_or_else(|e| panic!("cannot copy the binary for the unprivileged user: {e}"));
    }
    let mut unprivileged = Command::new(&binary);
    unprivileged.args(command.get_args());
    unprivileged.uid(65_534).gid(65_534);
    unprivileged
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

/// Makes `path` and everything under it read-only (or writable again).
fn chmod_tree(path: &Path, writable: bool) {
    if path.is_dir() {
        chmod(path, if writable { 0o755 } else { 0o555 });
        for entry in std::fs::read_dir(path).unwrap_or_else(|e| panic!("{e}")) {
            chmod_tree(&entry.unwrap_or_else(|e| panic!("{e}")).path(), writable);
        }
    } else {
        chmod(path, if writable { 0o644 } else { 0o444 });
    }
}

#[test]
fn inspect_reads_a_read_only_data_directory() {
    let outer = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    chmod(outer.path(), 0o755);
    let data = outer.path().join("data");
    data_dir_with_objects(&data, 2);
    chmod_tree(&data, false);
    let mut inspect = durability();
    inspect.args(["inspect", path_arg(&data), "--json"]);
    let output = run(&mut as_unprivileged(&mut inspect, outer.path()));
    chmod_tree(&data, true);
    assert!(output.status.success(), "{}", show(&output));
    let listing: serde_json::Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&output)));
    let objects = listing["objects"].as_array().cloned().unwrap_or_default();
    assert_eq!(objects.len(), 2, "{listing:#}");
    for object in &objects {
        assert_eq!(object["error"], serde_json::Value::Null, "{object:#}");
        assert!(object["alarm_ms"].as_i64().is_some(), "{object:#}");
        assert_eq!(object["namespace"], "things");
    }
}

#[test]
fn logs_on_a_redirected_stderr_carry_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    // data_dir_with_objects waited for the index's close, so its
    // checkpoint cannot overwrite the garbage.
    data_dir_with_objects(dir.path(), 2);
    // Garbage in the index: the next host rebuilds it and warns.
    std::fs::write(dir.path().join("index.sqlite"), vec![7_u8; 4096])
        .unwrap_or_else(|e| panic!("{e}"));
    let output = run(durability().args([
        "demo",
        "--data-dir",
        path_arg(dir.path()),
        "--messages",
        "100",
        "--shards",
        "1",
        "--json",
    ]));
    assert!(output.status.success(), "{}", show(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("rebuilt it from the object files") && stderr.contains("alarms=2"),
        "{stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "ANSI escape in redirected logs: {stderr:?}"
    );
}

#[test]
fn a_write_beyond_the_file_size_limit_is_a_printed_error_not_a_silent_death() {
    use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let mut command = durability();
    command.args([
        "bench",
        "sqlite-floor",
        "--quick",
        "--data-dir",
        path_arg(&dir.path().join("bench")),
    ]);
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing
    // else between fork and exec.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 64 * 1024,
                rlim_max: 64 * 1024,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = run(&mut command);
    assert_eq!(
        output.status.signal(),
        None,
        "killed by a signal: {}",
        show(&output)
    );
    assert!(!output.status.success(), "{}", show(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with("error:") || stderr.contains("\nerror:"),
        "{stderr}"
    );
}

#[test]
fn a_data_dir_too_long_for_sqlite_fails_once_at_start() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let mut long = dir.path().to_path_buf();
    for _ in 0..5 {
        long.push("d".repeat(100));
    }
    let output =
        run(durability().args(["demo", "--data-dir", path_arg(&long), "--messages", "100"]));
    assert!(!output.status.success(), "{}", show(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.matches("too long for SQLite").count(),
        1,
        "one clear error: {stderr}"
    );
    assert!(!long.join("runs").exists(), "nothing of a run was written");
}
