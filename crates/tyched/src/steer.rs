//! Channels on NIC queues of their own: a destination MAC per target queue.
//!
//! Real NICs spread received frames over their queues by an RSS hash of the IP and L4 headers,
//! which a Tyche frame (its own EtherType) does not have: every Tyche frame would land on one
//! queue. With `steer = "queue-mac"` the target gives queue *q* of an interface an address of
//! its own, `MAC_q`, adds it to the NIC's unicast filter (`bridge fdb replace MAC dev IF self
//! permanent`), installs one flow rule per queue (`ethtool -N IF flow-type ether dst MAC_q
//! action q`) and names `MAC_q` in the ACCEPT of every channel it serves on that queue
//! (`CHANNEL_MAC`, docs/protocol.md). The initiator then addresses that channel's frames to
//! `MAC_q`, so the NIC delivers them to queue *q*, whose AF_XDP socket and thread own the
//! channel. Rules and addresses are removed when the target stops ([`Installed`]'s `Drop`).
//!
//! `steer = "queue-mac-no-rules"` names the queue addresses without touching the NIC: for links
//! that keep a frame on the queue it was sent from (veth), where the channel's queue is the
//! one its CONNECT came in on.

use std::fmt;
use std::process::Command;

use serde::Deserialize;
use tyche_wire::MacAddr;

/// How the target gives channels NIC queues of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, clap::ValueEnum)]
pub enum Steer {
    /// No steering: every channel uses the interface's own address (the NIC picks the queue).
    #[default]
    #[serde(rename = "none")]
    None,
    /// An address per queue, added to the NIC's unicast filter, and an ntuple rule per queue
    /// steering it there; the target spreads channels over the queues. A NIC without ntuple
    /// support fails the start.
    #[serde(rename = "queue-mac")]
    QueueMac,
    /// An address per queue, named in ACCEPT, and nothing installed on the NIC: for links that
    /// deliver a frame on the queue it was sent from (veth). A channel stays on the queue its
    /// CONNECT came in on.
    #[serde(rename = "queue-mac-no-rules")]
    QueueMacNoRules,
}

impl Steer {
    /// Whether channels get queue addresses.
    pub fn addresses(self) -> bool {
        self != Steer::None
    }
}

impl fmt::Display for Steer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Steer::None => "none",
            Steer::QueueMac => "queue-mac",
            Steer::QueueMacNoRules => "queue-mac-no-rules",
        })
    }
}

/// Queues a derived address can name: queue *q* flips bits 2..7 of the first byte by `q + 1`.
pub const MAX_DERIVED_QUEUES: u16 = 63;

/// The address of queue `q` derived from the interface's address `nic`: the first byte's upper
/// six bits XOR `q + 1`, marked locally administered and unicast; the other five bytes are the
/// NIC's. Distinct from `nic` and from every other queue's. `None` beyond
/// [`MAX_DERIVED_QUEUES`] queues.
pub fn derive_queue_mac(nic: MacAddr, q: u16) -> Option<MacAddr> {
    if q >= MAX_DERIVED_QUEUES {
        return None;
    }
    let mut b = nic.octets();
    let upper = ((b[0] >> 2) ^ (q as u8 + 1)) & 0x3f;
    b[0] = (upper << 2) | 0x02;
    Some(MacAddr(b))
}

/// Why an address cannot be a queue address ([`check_queue_mac`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadQueueMac {
    /// 00:00:00:00:00:00.
    #[error("the all-zero address is no address")]
    Zero,
    /// A group address.
    #[error("{0} is a group (multicast) address")]
    Group(MacAddr),
    /// A vendor's (universally administered) address.
    #[error("{0} is not locally administered (second bit of the first byte)")]
    Universal(MacAddr),
}

/// Whether `m` may be a queue address: unicast, not zero, locally administered (so that it
/// cannot be another vendor's NIC).
pub fn check_queue_mac(m: MacAddr) -> Result<(), BadQueueMac> {
    if m == MacAddr::ZERO {
        return Err(BadQueueMac::Zero);
    }
    if m.is_multicast() {
        return Err(BadQueueMac::Group(m));
    }
    if m.octets()[0] & 0x02 == 0 {
        return Err(BadQueueMac::Universal(m));
    }
    Ok(())
}

/// Runs the system tools (`bridge`, `ethtool`); a test gives its own.
pub trait Tools {
    /// Runs `program args`: its standard output, or what went wrong (its standard error).
    fn run(&mut self, program: &str, args: &[String]) -> Result<String, String>;
}

/// The system's `bridge` and `ethtool`.
#[derive(Debug, Default)]
pub struct SystemTools;

impl Tools for SystemTools {
    fn run(&mut self, program: &str, args: &[String]) -> Result<String, String> {
        let out = Command::new(program).args(args).output().map_err(|e| format!("cannot run {program}: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            let mut msg = String::from_utf8_lossy(&out.stderr).trim().replace('\n', "; ");
            if msg.is_empty() {
                msg = String::from_utf8_lossy(&out.stdout).trim().replace('\n', "; ");
            }
            Err(format!("{msg} ({})", out.status))
        }
    }
}

/// `bridge` arguments adding `mac` to `iface`'s unicast filter (`replace`: an address a killed
/// target left behind is taken over, not an error).
pub fn fdb_add(iface: &str, mac: MacAddr) -> Vec<String> {
    ["fdb", "replace", &mac.to_string(), "dev", iface, "self", "permanent"].map(str::to_owned).to_vec()
}

/// `bridge` arguments removing `mac` from `iface`'s unicast filter.
pub fn fdb_del(iface: &str, mac: MacAddr) -> Vec<String> {
    ["fdb", "del", &mac.to_string(), "dev", iface, "self"].map(str::to_owned).to_vec()
}

/// `ethtool` arguments installing the rule that steers frames to `mac` to queue `q`.
pub fn ntuple_add(iface: &str, mac: MacAddr, q: u16) -> Vec<String> {
    ["-N", iface, "flow-type", "ether", "dst", &mac.to_string(), "action", &q.to_string()].map(str::to_owned).to_vec()
}

/// `ethtool` arguments listing the flow rules.
pub fn ntuple_list(iface: &str) -> Vec<String> {
    ["-n", iface].map(str::to_owned).to_vec()
}

/// The ids of the rules in an `ethtool -n` listing whose destination MAC is one of `macs`:
/// rules a killed target left behind.
pub fn stale_rules(listing: &str, macs: &[MacAddr]) -> Vec<u32> {
    let mut id = None;
    let mut stale = Vec::new();
    for line in listing.lines().map(str::trim) {
        if let Some(n) = line.strip_prefix("Filter:") {
            id = n.trim().parse::<u32>().ok();
        } else if let Some(rest) = line.strip_prefix("Dest MAC addr:") {
            let mac = rest.split_whitespace().next().and_then(|m| m.parse::<MacAddr>().ok());
            if let (Some(id), Some(mac)) = (id, mac) {
                if macs.contains(&mac) && !stale.contains(&id) {
                    stale.push(id);
                }
            }
        }
    }
    stale
}

/// `ethtool` arguments removing rule `id`.
pub fn ntuple_del(iface: &str, id: u32) -> Vec<String> {
    ["-N", iface, "delete", &id.to_string()].map(str::to_owned).to_vec()
}

/// The rule id in ethtool's answer to an insertion (`Added rule with ID 1023`).
pub fn rule_id(stdout: &str) -> Option<u32> {
    stdout.lines().find_map(|l| l.trim().strip_prefix("Added rule with ID ")?.trim().parse().ok())
}

/// Setting up steering on an interface failed: what was being done, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{iface}: steer = \"queue-mac\": {what} failed: {why}{hint}")]
pub struct SteerError {
    /// The interface.
    pub iface: String,
    /// The step, as the command that ran.
    pub what: String,
    /// The tool's message.
    pub why: String,
    /// What to do about it.
    pub hint: String,
}

/// The queue addresses and flow rules installed on one interface; removed when dropped.
pub struct Installed {
    iface: String,
    tools: Box<dyn Tools + Send>,
    addresses: Vec<MacAddr>,
    rules: Vec<u32>,
}

impl fmt::Debug for Installed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Installed")
            .field("iface", &self.iface)
            .field("addresses", &self.addresses)
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

impl Installed {
    /// The ids of the flow rules installed, in queue order.
    pub fn rules(&self) -> &[u32] {
        &self.rules
    }

    /// The queue addresses added to the NIC's unicast filter.
    pub fn addresses(&self) -> &[MacAddr] {
        &self.addresses
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        for id in std::mem::take(&mut self.rules) {
            if let Err(e) = self.tools.run("ethtool", &ntuple_del(&self.iface, id)) {
                tracing::warn!(iface = %self.iface, rule = id, "removing the flow rule failed: {e}");
            }
        }
        for mac in std::mem::take(&mut self.addresses) {
            if let Err(e) = self.tools.run("bridge", &fdb_del(&self.iface, mac)) {
                tracing::warn!(iface = %self.iface, %mac, "removing the queue address failed: {e}");
            }
        }
    }
}

/// Installs steering for `iface` with `macs[q]` the address of queue `q`: first the NIC's flow
/// rules are listed (a NIC without ntuple support, such as veth, fails here, before anything is
/// changed) and rules for these addresses that a killed target left are removed; then each
/// address goes into the NIC's unicast filter and one ntuple rule per queue is added. On any
/// failure what was installed is removed again and the error names the step; a NIC without
/// ntuple support is told to use `queue-mac-no-rules` only where the link keeps frames on their
/// sender's queue.
pub fn install(iface: &str, macs: &[MacAddr], mut tools: Box<dyn Tools + Send>) -> Result<Installed, SteerError> {
    let fail = |args: &[String], program: &str, why: String, hint: &str| SteerError {
        iface: iface.to_owned(),
        what: format!("`{program} {}`", args.join(" ")),
        why,
        hint: hint.to_owned(),
    };
    let hint = "; the NIC needs ntuple filters (`ethtool -k IF | grep ntuple`, `ethtool -K IF ntuple on`); \
                on a link that keeps each frame on its sender's queue (veth) use steer = \"queue-mac-no-rules\"";
    let args = ntuple_list(iface);
    let listing = tools.run("ethtool", &args).map_err(|why| fail(&args, "ethtool", why, hint))?;
    for id in stale_rules(&listing, macs) {
        match tools.run("ethtool", &ntuple_del(iface, id)) {
            Ok(_) => tracing::warn!(iface, rule = id, "removed a flow rule for a queue address left by an earlier run"),
            Err(e) => tracing::warn!(
                iface,
                rule = id,
                "a flow rule for a queue address is left from an earlier run and could not be removed: {e}"
            ),
        }
    }
    // Tools run one at a time; the guard below removes what was installed if a later step fails.
    let mut done =
        Installed { iface: iface.to_owned(), tools: Box::new(NoTools), addresses: Vec::new(), rules: Vec::new() };
    for &mac in macs {
        let args = fdb_add(iface, mac);
        if let Err(why) = tools.run("bridge", &args) {
            done.tools = tools;
            return Err(fail(&args, "bridge", why, ""));
        }
        done.addresses.push(mac);
    }
    for (q, &mac) in macs.iter().enumerate() {
        let args = ntuple_add(iface, mac, q as u16);
        match tools.run("ethtool", &args) {
            Ok(out) => match rule_id(&out) {
                Some(id) => done.rules.push(id),
                None => {
                    done.tools = tools;
                    return Err(fail(&args, "ethtool", format!("no rule id in its answer {:?}", out.trim()), ""));
                }
            },
            Err(why) => {
                done.tools = tools;
                return Err(fail(&args, "ethtool", why, hint));
            }
        }
    }
    done.tools = tools;
    Ok(done)
}

/// Stands in while [`install`] holds the real tools.
struct NoTools;

impl Tools for NoTools {
    fn run(&mut self, program: &str, _: &[String]) -> Result<String, String> {
        Err(format!("{program}: no tools"))
    }
}

/// How the target assigns channels to queues, per transport (NIC index).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueAddresses {
    /// Each transport's queue address; `None`: its channels use the interface's address.
    pub of_nic: Vec<Option<MacAddr>>,
    /// Each transport's interface (transports of the same interface share a number).
    pub iface_of: Vec<usize>,
    /// The target picks the queue (the interface's transport with the fewest channels), as the
    /// NIC steers each queue address to its queue; else a channel stays where its CONNECT came in.
    pub spread: bool,
}

impl QueueAddresses {
    /// The transport (NIC index) that serves a new channel whose CONNECT came in on `k`, and the
    /// address it is named by; `channels(j)` counts the channels on transport `j`.
    pub fn assign(&self, k: usize, channels: impl Fn(usize) -> usize) -> (usize, Option<MacAddr>) {
        let Some(Some(own)) = self.of_nic.get(k) else { return (k, None) };
        if !self.spread {
            return (k, Some(*own));
        }
        let iface = self.iface_of[k];
        let best = (0..self.of_nic.len())
            .filter(|&j| self.iface_of[j] == iface && self.of_nic[j].is_some())
            .min_by_key(|&j| (channels(j), j != k, j))
            .unwrap_or(k);
        (best, self.of_nic[best])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_addresses_are_distinct_local_unicast() {
        for nic in [MacAddr([0x3c, 0xec, 0xef, 1, 2, 3]), MacAddr([0x02, 0x54, 0, 0, 0x74, 0]), MacAddr([0xff; 6])] {
            let macs: Vec<_> = (0..MAX_DERIVED_QUEUES).map(|q| derive_queue_mac(nic, q).unwrap()).collect();
            for (q, m) in macs.iter().enumerate() {
                assert!(check_queue_mac(*m).is_ok(), "{m}");
                assert_ne!(*m, nic, "queue {q}");
                assert_eq!(m.octets()[1..], nic.octets()[1..]);
                assert!(!macs[..q].contains(m), "{m} twice");
            }
            assert_eq!(derive_queue_mac(nic, MAX_DERIVED_QUEUES), None);
        }
        assert_eq!(
            derive_queue_mac(MacAddr([0x02, 0x54, 0, 0, 0x74, 0]), 0),
            Some(MacAddr([0x06, 0x54, 0, 0, 0x74, 0]))
        );
        assert_eq!(
            derive_queue_mac(MacAddr([0x02, 0x54, 0, 0, 0x74, 0]), 1),
            Some(MacAddr([0x0a, 0x54, 0, 0, 0x74, 0]))
        );
    }

    #[test]
    fn queue_addresses_must_be_local_unicast() {
        assert!(check_queue_mac("06:54:00:00:00:01".parse().unwrap()).is_ok());
        for bad in ["00:00:00:00:00:00", "ff:ff:ff:ff:ff:ff", "07:54:00:00:00:01", "3c:ec:ef:00:00:01"] {
            assert!(check_queue_mac(bad.parse().unwrap()).is_err(), "{bad}");
        }
    }

    #[test]
    fn commands_are_built_as_the_tools_expect() {
        let m: MacAddr = "06:54:00:00:74:00".parse().unwrap();
        assert_eq!(fdb_add("eth1", m).join(" "), "fdb replace 06:54:00:00:74:00 dev eth1 self permanent");
        assert_eq!(ntuple_list("eth1").join(" "), "-n eth1");
        assert_eq!(fdb_del("eth1", m).join(" "), "fdb del 06:54:00:00:74:00 dev eth1 self");
        assert_eq!(ntuple_add("eth1", m, 3).join(" "), "-N eth1 flow-type ether dst 06:54:00:00:74:00 action 3");
        assert_eq!(ntuple_del("eth1", 1022).join(" "), "-N eth1 delete 1022");
        assert_eq!(rule_id("Added rule with ID 1023\n"), Some(1023));
        assert_eq!(rule_id("something else"), None);
    }

    /// Records every command; answers ethtool listings and insertions from `ntuple`.
    struct Fake {
        log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
        ntuple: Result<(), &'static str>,
        next_id: u32,
        listing: &'static str,
    }

    impl Tools for Fake {
        fn run(&mut self, program: &str, args: &[String]) -> Result<String, String> {
            self.log.lock().unwrap().push(format!("{program} {}", args.join(" ")));
            if program == "ethtool" && args[0] == "-n" {
                self.ntuple.map_err(str::to_owned)?;
                return Ok(self.listing.to_owned());
            }
            if program == "ethtool" && args.get(2).map(String::as_str) == Some("flow-type") {
                self.ntuple.map_err(str::to_owned)?;
                self.next_id -= 1;
                return Ok(format!("Added rule with ID {}\n", self.next_id));
            }
            Ok(String::new())
        }
    }

    /// An `ethtool -n` listing with one rule for queue 0's address left by an earlier run and
    /// one of someone else's.
    const LISTING: &str = "4 RX rings available\nTotal 2 rules\n\nFilter: 7\n\tFlow Type: Raw Ethernet\n\
        \tSrc MAC addr: 00:00:00:00:00:00 mask: FF:FF:FF:FF:FF:FF\n\
        \tDest MAC addr: 06:54:00:00:00:07 mask: 00:00:00:00:00:00\n\
        \tEthertype: 0x0 mask: 0xFFFF\n\tAction: Direct to queue 0\n\n\
        Filter: 9\n\tFlow Type: Raw Ethernet\n\
        \tDest MAC addr: 3C:EC:EF:00:00:01 mask: 00:00:00:00:00:00\n\tAction: Direct to queue 3\n";

    #[test]
    fn rules_left_by_an_earlier_run_are_found() {
        assert_eq!(stale_rules(LISTING, &macs()), [7]);
        assert_eq!(stale_rules(LISTING, &[]), Vec::<u32>::new());
        assert_eq!(stale_rules("Total 0 rules\n", &macs()), Vec::<u32>::new());
    }

    fn macs() -> Vec<MacAddr> {
        (0..2).map(|q| derive_queue_mac(MacAddr::local(7), q).unwrap()).collect()
    }

    #[test]
    fn installs_addresses_and_rules_and_removes_them_when_dropped() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let fake = Fake { log: log.clone(), ntuple: Ok(()), next_id: 1024, listing: LISTING };
        let done = install("eth1", &macs(), Box::new(fake)).expect("installed");
        assert_eq!(done.rules(), [1023, 1022]);
        drop(done);
        let log = log.lock().unwrap().clone();
        assert_eq!(
            log,
            [
                "ethtool -n eth1",
                "ethtool -N eth1 delete 7",
                "bridge fdb replace 06:54:00:00:00:07 dev eth1 self permanent",
                "bridge fdb replace 0a:54:00:00:00:07 dev eth1 self permanent",
                "ethtool -N eth1 flow-type ether dst 06:54:00:00:00:07 action 0",
                "ethtool -N eth1 flow-type ether dst 0a:54:00:00:00:07 action 1",
                "ethtool -N eth1 delete 1023",
                "ethtool -N eth1 delete 1022",
                "bridge fdb del 06:54:00:00:00:07 dev eth1 self",
                "bridge fdb del 0a:54:00:00:00:07 dev eth1 self",
            ]
        );
    }

    #[test]
    fn a_nic_without_ntuple_fails_clearly_and_keeps_nothing() {
        // What ethtool says on veth.
        let veth = "Cannot get RX rings: Operation not supported; rxclass: Cannot get RX class rule count: Operation not supported; RX classification rule retrieval failed (exit status: 1)";
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let fake = Fake { log: log.clone(), ntuple: Err(veth), next_id: 1024, listing: "" };
        let err = install("tyt0", &macs(), Box::new(fake)).expect_err("no ntuple on veth");
        let text = err.to_string();
        assert!(
            text.starts_with("tyt0: steer = \"queue-mac\": `ethtool -n tyt0` failed: Cannot get RX rings"),
            "{text}"
        );
        assert!(text.contains("Operation not supported") && text.contains("queue-mac-no-rules"), "{text}");
        // Nothing was changed on the NIC.
        assert_eq!(*log.lock().unwrap(), ["ethtool -n tyt0"]);
    }

    #[test]
    fn a_refused_rule_removes_what_was_added() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let full = "rmgr: Cannot insert RX class rule: No space left on device (exit status: 1)";
        // The listing works, the insertion does not.
        let fake = Fake { log: log.clone(), ntuple: Ok(()), next_id: 1024, listing: "Total 0 rules\n" };
        struct Refuse(Fake, &'static str);
        impl Tools for Refuse {
            fn run(&mut self, program: &str, args: &[String]) -> Result<String, String> {
                if args.get(2).map(String::as_str) == Some("flow-type") {
                    self.0.log.lock().unwrap().push(format!("{program} {}", args.join(" ")));
                    return Err(self.1.to_owned());
                }
                self.0.run(program, args)
            }
        }
        let err = install("eth1", &macs(), Box::new(Refuse(fake, full))).expect_err("no room");
        assert!(
            err.to_string().contains("`ethtool -N eth1 flow-type ether dst 06:54:00:00:00:07 action 0` failed: rmgr"),
            "{err}"
        );
        let log = log.lock().unwrap().clone();
        assert_eq!(log.iter().filter(|l| l.starts_with("bridge fdb del")).count(), 2, "{log:?}");
    }

    #[test]
    fn channels_are_spread_over_the_queues_of_their_interface_or_stay() {
        let a = |q| derive_queue_mac(MacAddr::local(1), q);
        let b = |q| derive_queue_mac(MacAddr::local(2), q);
        // Two interfaces of two queues each.
        let mut qa = QueueAddresses { of_nic: vec![a(0), a(1), b(0), b(1)], iface_of: vec![0, 0, 1, 1], spread: true };
        let load = [3, 1, 0, 0];
        assert_eq!(qa.assign(0, |j| load[j]), (1, a(1)));
        assert_eq!(qa.assign(3, |j| load[j]), (3, b(1)), "a tie stays where it came in");
        assert_eq!(qa.assign(2, |j| [0, 0, 5, 0][j]), (3, b(1)));
        qa.spread = false;
        assert_eq!(qa.assign(0, |j| load[j]), (0, a(0)));
        // No addresses: the channel stays and is named by the interface's address.
        assert_eq!(QueueAddresses::default().assign(2, |_| 0), (2, None));
    }
}
