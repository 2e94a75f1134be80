//! Every input under `fuzz/regressions/<target>/` (each a crash the fuzzer once found) and
//! `fuzz/seeds/<target>/` replayed through its harness, plus a short pseudo-random pass of each
//! harness: `cargo test --workspace` keeps them all.

use std::path::{Path, PathBuf};

fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz").join(kind).join(target);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn regression_inputs_replay_cleanly() {
    for (target, run) in tyche_fuzz::TARGETS {
        for kind in ["regressions", "seeds"] {
            for path in inputs(kind, target) {
                eprintln!("replaying {}", path.display());
                let data = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                run(&data);
            }
        }
    }
}

#[test]
fn pseudo_random_inputs_run_cleanly() {
    for (target, run) in tyche_fuzz::TARGETS {
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ target.len() as u64;
        for len in (0..200).map(|i| 16 + i * 7) {
            let data: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            run(&data);
        }
    }
}
