//! Discovery: which targets serve which exports on a set of links.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tyche_wire::{Discover, Envelope, Frame, MacAddr, Message};

use crate::config::Link;
use tyche_transport::FrameTransportExt;

/// One export as a target listed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredExport {
    /// Name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Logical block size.
    pub block_size: u32,
    /// `flags::EXPORT_*`.
    pub flags: u16,
}

/// A target seen on a link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredTarget {
    /// Index of the link it answered on (in the slice given to [`discover`]).
    pub link_index: usize,
    /// Name of that link.
    pub link: String,
    /// Its MAC on that link.
    pub target: MacAddr,
    /// Its exports, in its order.
    pub exports: Vec<DiscoveredExport>,
}

/// Broadcasts DISCOVER on every link (resending every `retry`), collects every target's
/// complete export list (asking for further pages as needed) and returns after `wait`.
pub fn discover(links: &mut [Link], ethertype: u16, wait: Duration) -> Vec<DiscoveredTarget> {
    discover_with_nonce(links, ethertype, wait, new_nonce())
}

/// A fresh DISCOVER nonce.
pub fn new_nonce() -> u32 {
    tyche_channel::auth::random_u64() as u32
}

/// As [`discover`], with the nonce given: known before the first DISCOVER leaves, so that a
/// `tyche_xdp::DiscoveryTap` can let its replies through to an AF_PACKET link.
pub fn discover_with_nonce(links: &mut [Link], ethertype: u16, wait: Duration, nonce: u32) -> Vec<DiscoveredTarget> {
    let retry = Duration::from_millis(200);
    // (link, target) → (total, exports by index)
    let mut seen: BTreeMap<(usize, MacAddr), (u16, BTreeMap<u16, DiscoveredExport>)> = BTreeMap::new();
    let start = Instant::now();
    let mut next_send = start;
    let mut buf = vec![0u8; 256];
    // Read once: a transport's capabilities may look its memory up in the system.
    let macs: Vec<MacAddr> = links.iter().map(|l| l.transport.capabilities().local_mac).collect();
    while start.elapsed() < wait {
        if Instant::now() >= next_send {
            next_send = Instant::now() + retry;
            for (k, link) in links.iter_mut().enumerate() {
                let src = macs[k];
                // Broadcast the first page; ask each target that has more for the rest.
                let mut asks = vec![(MacAddr::BROADCAST, 0u16)];
                for ((l, mac), (total, got)) in &seen {
                    let have = got.len() as u16;
                    if *l == k && have < *total {
                        asks.push((*mac, have));
                    }
                }
                for (dst, from) in asks {
                    let env = Envelope { dst, src, ethertype, channel: 0, session: 0 };
                    let len = Message::Discover(Discover { nonce, start: from }).emit(&env, &mut buf);
                    let _ = link.transport.send(1, &mut |b| {
                        b[..len].copy_from_slice(&buf[..len]);
                        Some(len)
                    });
                }
                let _ = link.transport.flush();
            }
        }
        let mut any = false;
        for (k, link) in links.iter_mut().enumerate() {
            let _ = link.transport.recv(64, &mut |bytes| {
                let Ok(frame) = Frame::new_checked(bytes, ethertype) else { return };
                let Ok(Message::DiscoverReply(r)) = frame.parse() else { return };
                if r.nonce != nonce {
                    return;
                }
                any = true;
                let entry = seen.entry((k, frame.src())).or_insert_with(|| (r.total, BTreeMap::new()));
                entry.0 = r.total;
                for (i, e) in r.exports.iter().enumerate() {
                    let export = DiscoveredExport {
                        name: e.name.to_owned(),
                        size: e.size,
                        block_size: e.block_size,
                        flags: e.flags,
                    };
                    entry.1.insert(r.start + i as u16, export);
                }
            });
        }
        if !any {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    seen.into_iter()
        .map(|((k, target), (_, exports))| DiscoveredTarget {
            link_index: k,
            link: links[k].name.clone(),
            target,
            exports: exports.into_values().collect(),
        })
        .collect()
}
