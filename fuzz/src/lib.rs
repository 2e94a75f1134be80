//! What the libFuzzer binaries share: the counters printed at exit.

use std::sync::Once;

extern "C" fn print_stats() {
    eprintln!("{}", tyche_fuzz::stats_line());
}

/// Arranges (once per process) for the harness counters to be printed when libFuzzer exits.
pub fn once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `print_stats` is a plain `extern "C" fn()` that only reads atomics and writes
        // to stderr; registering it has no other precondition.
        unsafe {
            libc::atexit(print_stats);
        }
    });
}
