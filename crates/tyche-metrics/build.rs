//! Records the compiler's version for the `*_build_info` gauge (`TYCHE_RUSTC_VERSION`, empty
//! when `rustc --version` cannot be run). Cargo rebuilds everything, this script included, when
//! the compiler changes.

fn main() {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        // "rustc 1.85.0 (4d91de4e4 2025-02-17)": the version is the second word.
        .and_then(|s| s.split_whitespace().nth(1).map(str::to_owned))
        .unwrap_or_default();
    println!("cargo:rustc-env=TYCHE_RUSTC_VERSION={version}");
    println!("cargo:rerun-if-env-changed=RUSTC");
    println!("cargo:rerun-if-changed=build.rs");
}
