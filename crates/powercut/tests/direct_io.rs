//! O_DIRECT on the mount: the host's journal turns it on with fcntl and
//! writes whole aligned blocks; those writes are no more durable than any
//! other until synced.

mod support;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

use durability_powercut::Fault;
use support::{Mounted, durable_file, filled};

/// A block-aligned buffer, as O_DIRECT wants.
#[repr(C, align(4096))]
struct Aligned([u8; 4096]);

fn set_direct(file: &File) {
    // SAFETY: F_GETFL/F_SETFL on a descriptor `file` keeps open.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    assert!(flags >= 0, "F_GETFL: {}", std::io::Error::last_os_error());
    // SAFETY: as above.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags | libc::O_DIRECT) };
    assert_eq!(
        rc,
        0,
        "F_SETFL O_DIRECT: {}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn o_direct_through_fcntl_works_and_is_not_durable_until_synced() {
    let m = Mounted::new();
    durable_file(&m, "journal", &filled(b'a', 8192));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("journal"))
        .expect("open");
    set_direct(&file);

    let block = Aligned([b's'; 4096]);
    file.write_all_at(&block.0, 0)
        .expect("direct write, synced");
    file.sync_data().expect("fdatasync");
    let block = Aligned([b'u'; 4096]);
    file.write_all_at(&block.0, 4096)
        .expect("direct write, unsynced");
    let mut read = Aligned([0; 4096]);
    file.read_exact_at(&mut read.0, 4096).expect("direct read");
    assert_eq!(read.0, [b'u'; 4096]);
    drop(file);

    m.fs.cut(Fault::Drop, 1).expect("cut");

    let mut expected = filled(b's', 4096);
    expected.extend(filled(b'a', 4096));
    assert_eq!(m.read("journal"), expected);
}

#[test]
fn o_direct_at_open_works() {
    let m = Mounted::new();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("direct"))
        .expect("open with O_DIRECT");
    let block = Aligned([b'd'; 4096]);
    file.write_all_at(&block.0, 0).expect("direct write");
    drop(file);
    assert_eq!(m.read("direct"), filled(b'd', 4096));
}
