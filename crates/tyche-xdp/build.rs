//! Compiles the XDP steering program (`bpf/tyche_steer.bpf.c`) with clang through libbpf-cargo.
//! The object is embedded in the crate and loaded with libbpf-rs at run time.

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let bpf_dir = manifest.join("../../bpf");
    let src = bpf_dir.join("tyche_steer.bpf.c");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("tyche_steer.bpf.o");
    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("CARGO_CFG_TARGET_ARCH");
    let multiarch = match arch.as_str() {
        "aarch64" => "aarch64-linux-gnu",
        _ => "x86_64-linux-gnu",
    };
    SkeletonBuilder::new()
        .source(&src)
        .obj(&out)
        .clang_args([
            format!("-I/usr/include/{multiarch}"),
            format!("-I{}", bpf_dir.display()),
            "-O2".to_string(),
            "-g".to_string(),
            "-Wall".to_string(),
        ])
        .build()
        .unwrap_or_else(|e| panic!("compiling {}: {e:#}", src.display()));
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-changed={}", bpf_dir.join("tyche_wire.h").display());
}
