//! Names never become paths: hostile names stay inside the data directory.

mod support;

use std::path::Path;
use std::rc::Rc;

use durability_host::{HostError, MAX_NAME_BYTES};
use support::{Notes, inline_host, local, notes};

fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path.clone());
            }
            out.push(path);
        }
    }
    out
}

#[tokio::test(start_paused = true)]
async fn hostile_names_stay_inside_the_data_directory() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    local(async {
        let host = inline_host(&data);
        let notes = notes(&host);
        let hostile = [
            "../escape",
            "../../../../../../tmp/escape",
            "/etc/passwd",
            "a/b/../../..",
            "..",
            ".",
            "\\..\\windows",
            "con",
            "name with spaces and \u{1F600}",
            &"x".repeat(MAX_NAME_BYTES),
        ];
        for name in hostile {
            let stub = notes.stub(name).unwrap();
            let file = host.object_file(stub.id());
            assert!(
                file.starts_with(data.join("objects")),
                "{name:?} -> {file:?}"
            );
            let n = name.to_owned();
            stub.call(move |o: Rc<Notes>| async move { o.add(&n) })
                .await
                .unwrap()
                .unwrap();
            assert!(file.exists());
        }
        host.shutdown().await;
    })
    .await;
    // Nothing was created beside the data directory.
    let beside: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(beside, vec![data.clone()]);
    for path in files_under(&data) {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !name.contains("escape") && !name.contains("passwd"),
            "{path:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn empty_long_or_nul_names_are_typed_errors_naming_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let notes = notes(&host);
        let cases = [
            (String::new(), "must not be empty"),
            (
                "x".repeat(MAX_NAME_BYTES + 1),
                "must be at most 1024 bytes of UTF-8",
            ),
            ("a\0b".to_owned(), "must not contain NUL"),
        ];
        for (name, expected) in cases {
            match notes.stub(&name) {
                Err(HostError::InvalidName { what, rule }) => {
                    assert_eq!(what, "object name");
                    assert_eq!(rule, expected);
                }
                other => panic!(
                    "{name:?}: expected InvalidName, got {:?}",
                    other.map(|s| s.id().clone())
                ),
            }
        }
        host.shutdown().await;
    })
    .await;
}
