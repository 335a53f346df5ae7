//! The continuous archive in S3-compatible object storage, against a real
//! S3 server (moto's, started on 127.0.0.1 by the test and stopped by its
//! pid): a host that starts while nothing listens at the endpoint serves
//! anyway, shows its lag, then catches up once the store comes; restores
//! at random moments match what was acknowledged; `verify` passes; a
//! truncated or corrupted chunk and a damaged base are refused by `verify`
//! and by the restore, naming the object's `s3://` URL.
//!
//! One test in this binary: the S3 client reads its endpoint and
//! credentials from the process's environment, which the test sets before
//! it starts any thread of its own.

mod support;

use std::path::Path;
use std::time::Duration;

use durability_host::Host;
use durability_host::archive::{Archive, ArchiveConfig, ArchiveError};
use rand::Rng as _;
use support::s3::{S3Server, aws_env, free_port};
use support::{add_note, epoch_ms, notes, numbered_notes_of, runtime};

const BUCKET: &str = "durability-archive";
const PREFIX: &str = "hosts/one";
const OBJECTS: usize = 4;
const SHIP_EVERY: Duration = Duration::from_millis(50);

fn url() -> String {
    format!("s3://{BUCKET}/{PREFIX}")
}

fn name(i: usize) -> String {
    format!("object-{i}")
}

#[test]
fn an_s3_archive_survives_an_unreachable_store_restores_any_moment_and_refuses_damage() {
    let port = free_port();
    for (key, value) in aws_env(port) {
        // SAFETY: the only test of this binary sets the variables before
        // it starts a thread; the harness's own threads read none.
        unsafe { std::env::set_var(key, value) };
    }
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let mut server: Option<S3Server> = None;
    // (object, seq, begun_ms, acked_ms) of every acknowledged note.
    let mut acks: Vec<(String, u64, i64, i64)> = Vec::new();
    runtime().block_on(async {
        let host = Host::builder(&data)
            .threads(2)
            .archive(
                ArchiveConfig::new(&url())
                    .unwrap()
                    .ship_interval(SHIP_EVERY),
            )
            .build()
            .expect("a host archiving to an unreachable store still starts");
        let notes = notes(&host);
        let mut seq = 0u64;
        let mut add = async |acks: &mut Vec<_>, object: String| {
            let text = seq.to_string();
            let begun = epoch_ms();
            add_note(&notes, &object, text).await;
            acks.push((object, seq, begun, epoch_ms()));
            seq += 1;
        };
        // Nothing listens at the endpoint: the host serves, the lag grows.
        for i in 0..OBJECTS {
            add(&mut acks, name(i)).await;
        }
        while host.archive_lag().unwrap() < SHIP_EVERY * 10 {
            add(&mut acks, name(0)).await;
            tokio::time::sleep(SHIP_EVERY).await;
        }
        // The store comes: everything waiting is shipped, a base taken.
        let started = S3Server::start_on(port);
        started.create_bucket(BUCKET);
        server = Some(started);
        while host.archive_lag() != Some(Duration::ZERO)
            || Archive::open_url(&url())
                .unwrap()
                .manifest()
                .map_or(true, |m| m.lives.iter().all(|l| l.bases.is_empty()))
        {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        // Writes spread over many ship intervals, so moments differ.
        for round in 0..40 {
            for i in 0..OBJECTS {
                add(&mut acks, name((i + round) % OBJECTS)).await;
            }
            tokio::time::sleep(SHIP_EVERY / 2).await;
        }
        host.shutdown().await;
    });
    let server = server.unwrap();
    let archive = Archive::open_url(&url()).unwrap();
    let manifest = archive.manifest().unwrap();
    let life = &manifest.lives[0];
    assert!(life.closed, "{manifest:?}");
    let base = &life.bases[0];

    let checked = archive.verify().unwrap();
    assert!(checked.bases >= 1 && checked.chunks >= 2, "{checked:?}");
    assert_eq!(checked.objects, OBJECTS as u64, "{checked:?}");

    // Restores at random moments (and at the end): every note acknowledged
    // at or before the moment is there, none begun after it.
    let mut rng = rand::rng();
    let mut moments = vec![life.through_ms];
    moments.extend((0..5).map(|_| rng.random_range(base.finished_ms..=life.through_ms)));
    let mut held_checked = 0;
    for (n, at) in moments.into_iter().enumerate() {
        let restored = root.path().join(format!("restored-{n}"));
        let report = archive
            .restore_at(&restored, at)
            .unwrap_or_else(|e| panic!("restore at {at}: {e}"));
        assert_eq!(report.objects, OBJECTS as u64);
        for i in 0..OBJECTS {
            let object = name(i);
            let held = numbered_notes_of(&restored, &object);
            for (o, seq, begun, acked) in &acks {
                if *o != object {
                    continue;
                }
                if *acked <= at {
                    assert!(held.contains(seq), "at {at}: {o} lost note {seq}");
                    held_checked += 1;
                }
                if *begun > at {
                    assert!(!held.contains(seq), "at {at}: {o} holds note {seq}");
                }
            }
        }
    }
    assert!(held_checked >= 100, "only {held_checked} notes checked");
    let everything = numbered_notes_of(&root.path().join("restored-0"), &name(0));
    assert_eq!(
        everything.len(),
        acks.iter().filter(|a| a.0 == name(0)).count()
    );

    // A truncated chunk, then a corrupted one, then a damaged base: each
    // refused by verify and by the restore, naming its s3:// URL, and a
    // refused restore leaves nothing behind.
    let keys = server.keys(BUCKET, &format!("{PREFIX}/lives/{}/passes/", life.id));
    let chunk = keys.last().unwrap().clone();
    let whole = server.get(BUCKET, &chunk);
    let named = format!("s3://{BUCKET}/{chunk}");
    let refused = |what: &str, expected: &str| {
        match archive.verify() {
            Err(ArchiveError::Damaged { file, .. }) => {
                assert_eq!(file.to_str(), Some(expected), "{what}")
            }
            Err(ArchiveError::Base { base, .. }) => {
                assert!(expected.starts_with(base.to_str().unwrap()), "{what}")
            }
            other => panic!("{what}: verify gave {other:?}"),
        }
        let into = root
            .path()
            .join(format!("refused-{}", what.replace(' ', "-")));
        match archive.restore_at(&into, life.through_ms) {
            Err(ArchiveError::Damaged { file, .. }) => {
                assert_eq!(file.to_str(), Some(expected), "{what}")
            }
            Err(ArchiveError::Base { base, .. }) => {
                assert!(expected.starts_with(base.to_str().unwrap()), "{what}")
            }
            other => panic!("{what}: restore gave {other:?}"),
        }
        assert!(!into.exists(), "{what}: a refused restore left files");
    };
    server.put(BUCKET, &chunk, &whole[..whole.len() - 10]);
    refused("truncated chunk", &named);
    let mut flipped = whole.clone();
    flipped[whole.len() / 2] ^= 0x08;
    server.put(BUCKET, &chunk, &flipped);
    refused("corrupted chunk", &named);
    server.put(BUCKET, &chunk, &whole);
    archive.verify().unwrap();

    let copies = server.keys(BUCKET, &format!("{PREFIX}/{}/objects/", base.dir));
    let copy = copies.first().unwrap().clone();
    let bytes = server.get(BUCKET, &copy);
    server.put(BUCKET, &copy, &bytes[..bytes.len() / 2]);
    refused("damaged base", &format!("s3://{BUCKET}/{copy}"));
    server.put(BUCKET, &copy, &bytes);
    archive.verify().unwrap();
    // Retention in the bucket: bases past it (and the chunks before the
    // oldest kept one) are deleted from the store, not just forgotten.
    let short = format!("s3://{BUCKET}/hosts/short");
    runtime().block_on(async {
        let host = Host::builder(root.path().join("data-short"))
            .threads(2)
            .archive(
                ArchiveConfig::new(&short)
                    .unwrap()
                    .ship_interval(SHIP_EVERY)
                    .base_interval(Duration::from_millis(150))
                    .retention(Duration::from_millis(400)),
            )
            .build()
            .unwrap();
        let notes = notes(&host);
        for seq in 0..30u64 {
            let text = seq.to_string();
            add_note(&notes, &name(seq as usize % OBJECTS), text).await;
            tokio::time::sleep(SHIP_EVERY).await;
        }
        host.shutdown().await;
    });
    let kept = Archive::open_url(&short).unwrap();
    let manifest = kept.manifest().unwrap();
    let bases: Vec<&str> = manifest.lives[0]
        .bases
        .iter()
        .map(|b| b.dir.as_str())
        .collect();
    let stored: std::collections::BTreeSet<String> = server
        .keys(BUCKET, "hosts/short/lives/")
        .into_iter()
        .filter_map(|key| {
            let rest = key.strip_prefix("hosts/short/")?;
            let at = rest.find("/bases/")? + "/bases/".len();
            let end = rest[at..].find('/')? + at;
            Some(rest[..end].to_owned())
        })
        .collect();
    assert_eq!(
        stored.iter().map(String::as_str).collect::<Vec<_>>(),
        bases,
        "the bucket holds the bases the manifest names, no others"
    );
    assert!(
        manifest.earliest_ms().unwrap() > manifest.lives[0].started_ms + 300,
        "nothing was dropped: {manifest:?}"
    );
    kept.verify().unwrap();
    let restored = root.path().join("restored-short");
    kept.restore_at(&restored, manifest.through_ms().unwrap())
        .unwrap();
    let held: usize = (0..OBJECTS)
        .map(|i| numbered_notes_of(&restored, &name(i)).len())
        .sum();
    assert_eq!(held, 30);

    let pid = server.pid();
    drop(server);
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z")),
        "the S3 server {pid} still runs"
    );
}
