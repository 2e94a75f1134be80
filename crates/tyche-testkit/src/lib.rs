//! What Tyche's tests share about the machine they run on.
//!
//! Some tests need what a developer's machine may lack: root, network namespaces, AF_XDP, loop
//! devices. Under plain `cargo test` such a test says why it cannot run and passes, so the
//! workspace's tests work anywhere. `cargo xtask test` (what CI runs) sets [`REQUIRE_ALL`],
//! under which the same test fails instead: a green suite never hides a test that did not run.

/// The environment variable under which a test that cannot run fails instead of skipping
/// (`cargo xtask test` sets it to `1`).
pub const REQUIRE_ALL: &str = "TYCHE_REQUIRE_ALL_TESTS";

/// Whether every test must run ([`REQUIRE_ALL`] is set to anything but `0` or empty).
pub fn required() -> bool {
    std::env::var(REQUIRE_ALL).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The test `test` cannot run on this machine, because `why`. Returns (the caller then returns
/// without testing) after saying so on stderr; panics, failing the test, where [`required`].
#[track_caller]
pub fn cannot_run(test: &str, why: &str) {
    if required() {
        panic!("{test} cannot run here ({why}), and {REQUIRE_ALL} requires every test to run");
    }
    eprintln!("SKIPPED: {test}: {why} (set {REQUIRE_ALL}=1 to make this a failure)");
}

/// Whether this process runs as root (effective uid 0), read from `/proc/self/status`.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").ok().is_some_and(|s| {
        s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2)).is_some_and(|u| u == "0")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_variable_means() {
        // The only test here that touches the variable (tests of one binary share it).
        std::env::remove_var(REQUIRE_ALL);
        assert!(!required());
        cannot_run("a test", "no reason");
        std::env::set_var(REQUIRE_ALL, "0");
        assert!(!required());
        std::env::set_var(REQUIRE_ALL, "1");
        assert!(required());
        let r = std::panic::catch_unwind(|| cannot_run("a test", "not root"));
        std::env::remove_var(REQUIRE_ALL);
        let msg = r.expect_err("fails when required").downcast::<String>().expect("a message");
        assert!(msg.contains("a test cannot run here (not root)"), "{msg}");
    }
}
