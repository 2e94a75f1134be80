//! What a configuration reload (`SIGHUP`, `systemctl reload tyched`) may change in a running
//! target, and what needs a restart.
//!
//! [`plan`] compares the running configuration with the one just read and sorts every
//! difference:
//! - **applied at once, no session dropped**: exports that are new (by name), and of an export
//!   that stays, its MAC allow-list (`allow`), its key (`key_file`, or the file's contents: a key
//!   rotation), and `shared`. The handshake checks these for every CONNECT, so new sessions and
//!   new channels of running sessions get the new rules; channels already open keep running.
//! - **needs a restart** (logged, the running value kept): everything else, such as interfaces,
//!   transport, limits, timers, an export's path, size, `read_only`, `direct` or `encrypt`, a
//!   key added to or removed from an export, and an export removed (sessions may hold it).
//!
//! A configuration that does not parse or validate changes nothing.

use crate::config::{Config, ExportConfig};

/// How a new configuration differs from the running one (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Indices (in the new configuration) of exports to open and serve.
    pub added: Vec<usize>,
    /// Exports that stay: (index in the running export list, index in the new configuration).
    /// Their access rules (allow-list, key, `shared`) are taken from the new configuration.
    pub kept: Vec<(usize, usize)>,
    /// Differences that take effect only at the next start, each naming its field.
    pub needs_restart: Vec<String>,
}

/// Sorts the differences between `running` and `new` (both validated).
pub fn plan(running: &Config, new: &Config) -> Plan {
    let mut p = Plan { needs_restart: daemon_fields(running, new), ..Plan::default() };
    for (i, old) in running.exports.iter().enumerate() {
        match new.exports.iter().position(|e| e.name == old.name) {
            Some(j) => {
                p.kept.push((i, j));
                for f in export_fields(old, &new.exports[j]) {
                    p.needs_restart.push(format!("export {:?}: {f}", old.name));
                }
            }
            None => p.needs_restart.push(format!("export {:?} removed", old.name)),
        }
    }
    p.added =
        (0..new.exports.len()).filter(|&j| !running.exports.iter().any(|e| e.name == new.exports[j].name)).collect();
    p
}

/// The names of `fields` whose values differ between `a` and `b` (two `$ty`s), every other
/// field of `$ty` named in `ignored`: the struct pattern names them all, so a field added to
/// `$ty` does not compile here until it is sorted.
macro_rules! differing {
    ($ty:ident, $a:expr, $b:expr, [$($f:ident),* $(,)?], ignored [$($g:ident),* $(,)?]) => {{
        let $ty { $($f,)* $($g: _,)* } = $a;
        let mut d: Vec<String> = Vec::new();
        $(
            if *$f != $b.$f {
                d.push(stringify!($f).to_owned());
            }
        )*
        d
    }};
}

/// The daemon-wide fields that differ (none of them can change while running).
fn daemon_fields(a: &Config, b: &Config) -> Vec<String> {
    differing!(
        Config,
        a,
        b,
        [
            ifaces,
            channels_per_nic,
            transport,
            tcp_listen,
            ethertype,
            workers,
            network_threads,
            xdp_copy,
            io_uring,
            poll,
            poll_budget_us,
            stats_socket,
            prometheus_listen,
            prometheus_allow_remote,
            limits,
            dead_after_ms,
            reclaim_after_ms,
            storage_deadline_ms,
            irq_affinity,
            channel_memory_node,
            network_thread_node,
            model_cache,
            consumer_cpus,
            steer,
            queue_macs,
        ],
        ignored[exports]
    )
}

/// The fields of an export that stays whose change needs a restart.
fn export_fields(a: &ExportConfig, b: &ExportConfig) -> Vec<String> {
    let mut d = differing!(
        ExportConfig,
        a,
        b,
        [path, size, read_only, direct, encrypt],
        ignored[name, allow, key, key_file, shared]
    );
    if a.keyed() != b.keyed() {
        d.push(if b.keyed() { "a key added".to_owned() } else { "its key removed".to_owned() });
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        Config::from_toml(&format!("ifaces = [\"t0\"]\n{text}")).expect("valid")
    }

    const TWO: &str = "[[export]]\nname = \"a\"\nsize = \"1M\"\n[[export]]\nname = \"b\"\nsize = \"2M\"\n";

    #[test]
    fn the_same_configuration_changes_nothing() {
        let c = config(TWO);
        assert_eq!(plan(&c, &c), Plan { kept: vec![(0, 0), (1, 1)], ..Plan::default() });
    }

    #[test]
    fn new_exports_are_added_wherever_they_are_listed() {
        let old = config(TWO);
        let new =
            config(&format!("[[export]]\nname = \"z\"\nsize = \"1M\"\n{TWO}[[export]]\nname = \"c\"\nsize = \"1M\"\n"));
        let p = plan(&old, &new);
        assert_eq!(p.added, vec![0, 3]);
        assert_eq!(p.kept, vec![(0, 1), (1, 2)]);
        assert!(p.needs_restart.is_empty(), "{:?}", p.needs_restart);
    }

    #[test]
    fn access_rules_apply_and_the_rest_needs_a_restart() {
        let old = config(TWO);
        let new = config(
            "workers = 3\n[[export]]\nname = \"a\"\nsize = \"1M\"\nallow = [\"02:00:00:00:00:01\"]\nshared = true\n\
             [[export]]\nname = \"b\"\nsize = \"4M\"\nread_only = true\n",
        );
        let p = plan(&old, &new);
        assert_eq!(p.kept, vec![(0, 0), (1, 1)]);
        assert_eq!(p.needs_restart, vec!["workers", "export \"b\": size", "export \"b\": read_only"]);
    }

    #[test]
    fn a_removed_export_needs_a_restart() {
        let old = config(TWO);
        let new = config("[[export]]\nname = \"b\"\nsize = \"2M\"\n");
        let p = plan(&old, &new);
        assert_eq!(p.kept, vec![(1, 0)]);
        assert_eq!(p.needs_restart, vec!["export \"a\" removed"]);
    }
}
