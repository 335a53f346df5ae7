//! The backup admin action and the last backup on the page, over a real
//! server on 127.0.0.1 in front of a real threaded host.

mod support;

use std::time::Duration;

use durability_axum::{Admin, Dashboard};
use durability_host::Host;
use durability_host::archive::ArchiveConfig;
use support::{Server, World, get, post};

const TOKEN: &str = "correct horse battery staple";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_backup_writes_a_verified_backup_and_the_page_shows_it() {
    let world = World::new().await;
    let backups = tempfile::tempdir().unwrap();
    let router = Dashboard::for_host(&world.host)
        .admin(Admin::new(TOKEN).unwrap().backups_to(backups.path()))
        .build()
        .unwrap();
    let server = Server::start(router).await;

    let none = get(format!("{}/api/backup", server.base)).await;
    assert_eq!(none.status, 200);
    assert!(none.json()["last_backup"].is_null());
    let page = get(format!("{}/", server.base)).await;
    assert!(page.body.contains("no backup recorded"), "{}", page.body);

    let refused = post(format!("{}/api/backup", server.base), None, "{}").await;
    assert_eq!(refused.status, 401);
    assert_eq!(
        std::fs::read_dir(backups.path()).unwrap().count(),
        0,
        "a refused request wrote nothing"
    );

    let made = post(format!("{}/api/backup", server.base), Some(TOKEN), "{}").await;
    assert_eq!(made.status, 200, "{made:?}");
    let made = made.json();
    assert_eq!(made["objects"], 1);
    let dest = made["dest"].as_str().unwrap().to_owned();
    assert!(dest.starts_with(&backups.path().display().to_string()));
    let checked = durability_host::backup::verify(&dest).unwrap();
    assert_eq!(checked.objects, 1);

    let last = get(format!("{}/api/backup", server.base)).await.json();
    assert_eq!(last["last_backup"]["dest"], dest.as_str());
    assert_eq!(last["last_backup"]["objects"], 1);
    let page = get(format!("{}/", server.base)).await;
    assert!(page.body.contains("last backup"), "{}", page.body);
    assert!(page.body.contains(&dest), "{}", page.body);
    world.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backup_action_is_absent_without_admin_and_unwired_without_a_directory() {
    let world = World::new().await;
    let server = Server::start(Dashboard::for_host(&world.host).build().unwrap()).await;
    let refused = post(format!("{}/api/backup", server.base), Some(TOKEN), "{}").await;
    assert_eq!(refused.status, 405, "GET only without admin: {refused:?}");
    drop(server);

    let server = Server::start(
        Dashboard::for_host(&world.host)
            .admin(Admin::new(TOKEN).unwrap())
            .build()
            .unwrap(),
    )
    .await;
    let unwired = post(format!("{}/api/backup", server.base), Some(TOKEN), "{}").await;
    assert_eq!(unwired.status, 501, "{unwired:?}");
    world.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_says_whether_the_hosts_archive_is_caught_up() {
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("archive");
    let config = ArchiveConfig::new(&format!("file://{}", archive.display()))
        .unwrap()
        .ship_interval(Duration::from_millis(20));
    let host = Host::builder(dir.path().join("data"))
        .threads(1)
        .archive(config)
        .build()
        .unwrap();
    let server = Server::start(Dashboard::for_host(&host).build().unwrap()).await;
    while host.archive_lag() != Some(Duration::ZERO) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let page = get(format!("{}/", server.base)).await;
    assert!(page.body.contains("archive: caught up"), "{}", page.body);
    drop(server);
    host.shutdown().await;

    let world = World::new().await;
    let server = Server::start(Dashboard::for_host(&world.host).build().unwrap()).await;
    let page = get(format!("{}/", server.base)).await;
    assert!(!page.body.contains("archive:"), "{}", page.body);
    world.host.shutdown().await;
}
