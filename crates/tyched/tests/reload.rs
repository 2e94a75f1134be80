//! A running target takes a new configuration ([`tyched::TargetHandle::reload`], what SIGHUP
//! does): exports added and served at once, allow-lists, keys and `shared` changed, sessions
//! that were running keep running, everything else reported as needing a restart, and a bad
//! configuration changes nothing.

mod common;

use common::{init_mac, pattern, target_mac, Initiator, Port};
use tyche_channel::ConnectError;
use tyche_wire::RejectReason;
use tyched::config::{Config, ExportConfig, Size};

fn config(exports: Vec<ExportConfig>) -> Config {
    Config { ifaces: vec!["mem0".into()], exports, workers: 2, ..Config::default() }
}

/// An initiator on path `k` of the target alone (its own MAC).
fn on_path(port: Port, k: usize) -> Initiator {
    let mut ini = Initiator::new(vec![port]);
    ini.target_macs = vec![target_mac(k)];
    ini.init_macs = vec![init_mac(k)];
    ini
}

#[test]
fn a_reload_adds_exports_and_changes_access_while_sessions_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = ExportConfig::file("a", dir.path().join("a.img"), Some(4 << 20));
    let old = config(vec![a.clone()]);
    let (mut target, ports) = common::start(old.clone(), 3);
    let mut ports = ports.into_iter();
    let mut first = on_path(ports.next().expect("port"), 0);
    let mut second = on_path(ports.next().expect("port"), 1);
    let mut third = on_path(ports.next().expect("port"), 2);
    first.attach("a", None).expect("attach a");
    let before = pattern(0, 65536, 1);
    first.write(0, &before);

    // "a" now admits the second initiator's MAC alone; two exports are added (RAM and file).
    let added_file = dir.path().join("added.img");
    let mut new = config(vec![
        ExportConfig::ram("ram2", 1 << 20),
        ExportConfig { allow: vec![init_mac(1).to_string()], ..a.clone() },
        ExportConfig::file("file2", &added_file, Some(2 << 20)),
    ]);
    let r = target.reload(&new).expect("reload");
    assert_eq!(r.added, vec!["ram2", "file2"]);
    assert_eq!(r.updated, vec!["a"]);
    assert!(r.needs_restart.is_empty(), "{:?}", r.needs_restart);

    // The running session goes on; a new one from the MAC no longer allowed is refused.
    assert_eq!(first.read(0, before.len()), before, "the session from before the reload");
    first.write(65536, &before);
    let (_, refused) = third.handshake(0, 0, "a", None);
    assert_eq!(refused.err(), Some(ConnectError::Rejected(RejectReason::NotAllowed)));

    // The added file export is served through the storage threads, the RAM one inline.
    let data = pattern(4096, 131072, 7);
    second.attach("file2", None).expect("attach the added file export");
    second.write(4096, &data);
    assert_eq!(second.read(4096, data.len()), data);
    third.attach("ram2", None).expect("attach the added RAM export");
    third.write(0, &data);
    assert_eq!(third.read(0, data.len()), data);

    let s = target.stats();
    let names: Vec<&str> = s.exports.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["a", "ram2", "file2"], "added after the exports served before");
    assert_eq!(s.exports[2].bytes_written, data.len() as u64, "{:?}", s.exports[2]);
    assert_eq!(s.exports[0].denied, 1);
    assert_eq!((s.reload.applied, s.reload.failed, s.reload.last_error.as_deref()), (1, 0, None));

    // What cannot change now is named, and the running values stay.
    new.workers = 3;
    new.exports[1].size = Some(Size(8 << 20));
    new.exports.remove(0);
    let r = target.reload(&new).expect("reload");
    assert!(r.added.is_empty() && r.updated.is_empty(), "{r:?}");
    assert_eq!(r.needs_restart, vec!["workers", "export \"a\": size", "export \"ram2\" removed"]);
    assert_eq!(first.read(0, before.len()), before);
    assert_eq!(third.read(0, data.len()), data, "a removed export is served until the restart");
    let s = target.stats();
    assert_eq!(s.reload.needs_restart, r.needs_restart);
    assert!(s.human().contains("needs a restart: export \"ram2\" removed"), "{}", s.human());

    // A configuration that does not validate changes nothing.
    let mut bad = new.clone();
    bad.exports.push(ExportConfig { allow: vec!["not a mac".into()], ..ExportConfig::ram("late", 1 << 20) });
    let e = target.reload(&bad).expect_err("an invalid allow-list");
    assert!(e.to_string().contains("export[2].allow[0]"), "{e}");
    let s = target.stats();
    assert_eq!((s.reload.applied, s.reload.failed), (2, 1));
    assert!(s.reload.last_error.as_deref().is_some_and(|m| m.contains("allow")), "{:?}", s.reload);
    assert_eq!(s.exports.len(), 3, "nothing added");

    // Shutdown flushes the added export too.
    drop((first, second, third));
    target.shutdown();
    let on_disk = std::fs::read(&added_file).expect("read the added export's file");
    assert_eq!(&on_disk[4096..4096 + data.len()], &data[..]);
}

#[test]
fn a_reload_rotates_a_key_and_may_share_an_export() {
    let old_key = "the first key of the export";
    let new_key = "the second key of the export";
    let e = ExportConfig { key: Some(old_key.into()), ..ExportConfig::ram("k", 1 << 20) };
    let (mut target, ports) = common::start(config(vec![e.clone()]), 3);
    let mut ports = ports.into_iter();
    let mut first = on_path(ports.next().expect("port"), 0);
    let mut second = on_path(ports.next().expect("port"), 1);
    let mut third = on_path(ports.next().expect("port"), 2);
    first.attach("k", Some(old_key.as_bytes())).expect("the first key");
    let (_, busy) = second.handshake(0, 0, "k", Some(old_key.as_bytes()));
    assert!(matches!(busy, Err(ConnectError::InUse(_))), "one initiator at a time: {busy:?}");

    let r = target
        .reload(&config(vec![ExportConfig { key: Some(new_key.into()), shared: true, ..e.clone() }]))
        .expect("reload");
    assert_eq!(r.updated, vec!["k"]);
    let (_, stale) = second.handshake(0, 0, "k", Some(old_key.as_bytes()));
    assert_eq!(stale.err(), Some(ConnectError::Rejected(RejectReason::AuthFailed)), "the old key");
    second.attach("k", Some(new_key.as_bytes())).expect("the new key, beside the first holder (shared)");
    let data = pattern(0, 8192, 4);
    second.write(0, &data);
    assert_eq!(first.read(0, 8192), data, "the session keyed before the reload runs on");

    // Taking the key away is not a reload's to do.
    let r = target.reload(&config(vec![ExportConfig { key: None, ..e }])).expect("reload");
    assert_eq!(r.needs_restart, vec!["export \"k\": its key removed"]);
    let (_, r) = third.handshake(0, 0, "k", None);
    assert_eq!(r.err(), Some(ConnectError::ChallengeUnsupported), "still keyed: the target challenges");
}
