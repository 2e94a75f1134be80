//! Structured, coverage-guided fuzz harnesses for Tyche.
//!
//! Each harness takes the raw bytes libFuzzer hands it, decodes them with [`arbitrary`] into a
//! sequence of actions of a hostile peer, plays them against the real system under test, and
//! checks invariants after the input:
//!
//! - [`target`]: tyched's network loop ([`tyched::runtime::Harness`]) with RAM exports, one
//!   honest initiator session and one hostile one that holds a valid session and breaks every
//!   rule (forged, stale and withheld acknowledgements, reused slots, old and future sequence
//!   numbers, segments of refused requests, huge FLOOR values, any channel index, DISCONNECT,
//!   KEEPALIVE, handshakes mid-session, raw and corrupted frames, replays, time jumps).
//!   Checks: no panic, the honest session's data intact and its session still serving, every
//!   frame the target kept given back and the hostile session reclaimed once it goes quiet.
//! - [`initiator`]: tyche-channel's [`tyche_channel::Volume`] with requests outstanding, fed by
//!   a hostile target that knows the requests it was sent (completions and data for the right,
//!   wrong, stale and unknown tags and slots, data past lengths, handshake replies
//!   mid-session...). Checks: no panic, read data placed only inside its request's buffer, each
//!   request completed at most once and every request completed once the target goes quiet.
//! - [`nbd`]: tyche-init's NBD server (the fixed-newstyle handshake and the engine-mode
//!   transmission parser, [`tyche_init::nbd::fuzzing`]) fed by a hostile client over a socket,
//!   with the volume's part played by a RAM disk. Checks: no panic, every request handed to the
//!   volume in range and shaped as the volume requires, at most one reply per request, the
//!   connection's held bytes within its bound.
//!
//! The harnesses count the inputs they ran and the frames (or NBD requests and option
//! messages) they handed to the system under test in [`INPUTS`] and [`FRAMES`]; the libFuzzer
//! binaries print them at exit for `cargo xtask fuzz`.
//!
//! Panic contract: a harness panics only when the system under test panics or an invariant
//! fails; inputs it cannot decode do nothing.

pub mod initiator;
pub mod nbd;
pub mod target;

use std::sync::atomic::{AtomicU64, Ordering};

/// Inputs run (all harnesses of this process).
pub static INPUTS: AtomicU64 = AtomicU64::new(0);
/// Frames (NBD: requests and options) handed to the system under test.
pub static FRAMES: AtomicU64 = AtomicU64::new(0);

/// Counts one input.
fn count_input() {
    INPUTS.fetch_add(1, Ordering::Relaxed);
}

/// Counts `n` frames handed to the system under test.
fn count_frames(n: u64) {
    FRAMES.fetch_add(n, Ordering::Relaxed);
}

/// A fuzz target: its name and its entry point.
pub type Target = (&'static str, fn(&[u8]));

/// Every fuzz target, by name (the names of the binaries in `fuzz/` and of the folders under
/// `fuzz/regressions/`).
pub const TARGETS: &[Target] =
    &[("target", target::run), ("initiator", initiator::run), ("nbd", nbd::run), ("nbd-stream", nbd::run_stream)];

/// The line the libFuzzer binaries print at exit (parsed by `cargo xtask fuzz`).
pub fn stats_line() -> String {
    format!("tyche-fuzz-stats: inputs={} frames={}", INPUTS.load(Ordering::Relaxed), FRAMES.load(Ordering::Relaxed))
}
