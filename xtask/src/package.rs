//! `cargo xtask package`: the Debian package, built by cargo-deb from the release binaries, the
//! man pages and shell completions the binaries generate from their own clap definitions, and
//! `dist/` (systemd units, the udev rule, example configuration), then checked file by file.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};

use crate::disk::run;
use crate::stack;

/// The files the package must hold (paths inside it), whatever else it has.
pub const REQUIRED: &[&str] = &[
    "./usr/bin/tyched",
    "./usr/bin/tyche-init",
    "./usr/lib/systemd/system/tyched.service",
    "./usr/lib/systemd/system/tyche-attach@.service",
    "./usr/lib/udev/rules.d/60-tyche.rules",
    "./usr/lib/modules-load.d/tyche.conf",
    "./etc/tyche/tyched.toml",
    "./usr/share/doc/tyche/examples/attachment.toml",
    "./usr/share/doc/tyche/LICENSE-MIT",
    "./usr/share/doc/tyche/LICENSE-APACHE",
    "./usr/share/doc/tyche/copyright",
    "./usr/share/man/man1/tyched.1.gz",
    "./usr/share/man/man1/tyched-serve.1.gz",
    "./usr/share/man/man1/tyche-init.1.gz",
    "./usr/share/man/man1/tyche-init-attach.1.gz",
    "./usr/share/bash-completion/completions/tyched.bash",
    "./usr/share/bash-completion/completions/tyche-init.bash",
    "./usr/share/zsh/vendor-completions/_tyched",
    "./usr/share/zsh/vendor-completions/_tyche-init",
    "./usr/share/fish/vendor_completions.d/tyched.fish",
    "./usr/share/fish/vendor_completions.d/tyche-init.fish",
];

/// The largest a packaged binary may be: stripped, they are a few MB (unstripped, tens).
pub const MAX_BINARY: u64 = 16 << 20;

/// What `cargo xtask package` made.
#[derive(Debug)]
pub struct Package {
    /// The `.deb`.
    pub deb: PathBuf,
    /// Files in it.
    pub files: usize,
    /// Its Depends field.
    pub depends: String,
    /// Sizes of the two binaries in it.
    pub binaries: Vec<(String, u64)>,
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Installs cargo-deb with `cargo install` when this machine lacks it.
fn ensure_cargo_deb() -> Result<()> {
    if cargo().args(["deb", "--version"]).output().is_ok_and(|o| o.status.success()) {
        return Ok(());
    }
    eprintln!("package: installing cargo-deb (cargo install cargo-deb --locked)");
    let status = cargo().args(["install", "cargo-deb", "--locked"]).status().context("cargo install cargo-deb")?;
    ensure!(status.success(), "cargo install cargo-deb failed");
    Ok(())
}

/// Builds the release binaries, their docs and the `.deb`; returns its path.
pub fn build(root: &Path) -> Result<PathBuf> {
    // The workspace's release build, as every later step of the suite uses it: building the two
    // packages alone unified their dependencies' features differently, and the next step
    // rebuilt everything (about three minutes).
    crate::xdp::build(root)?;
    let docs = crate::xdp::target_dir(root).join("release/tyche-docs");
    let _ = std::fs::remove_dir_all(&docs);
    for bin in ["tyched", "tyche-init"] {
        let out = run(Command::new(stack::bin(root, bin)).arg("generate-docs").arg("--out").arg(&docs));
        out.with_context(|| format!("{bin} generate-docs"))?;
    }
    // Debian's man pages are compressed, reproducibly (-n: no name or time stamp).
    let pages: Vec<PathBuf> = std::fs::read_dir(docs.join("man"))?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    ensure!(!pages.is_empty(), "no man pages generated");
    run(Command::new("gzip").arg("-9nf").args(&pages)).context("gzip of the man pages")?;
    ensure_cargo_deb()?;
    let out_dir = crate::xdp::target_dir(root).join("debian");
    let out = cargo()
        .args(["deb", "-p", "tyche", "--no-build", "--strip", "--output"])
        .arg(&out_dir)
        .current_dir(root)
        .output()
        .context("cargo deb")?;
    if !out.status.success() {
        bail!("cargo deb failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let deb = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_owned();
    ensure!(deb.ends_with(".deb") && Path::new(&deb).exists(), "cargo deb printed no package path: {deb:?}");
    Ok(PathBuf::from(deb))
}

/// Checks a package's contents: every file of [`REQUIRED`], binaries stripped and runnable,
/// the configuration a conffile, dependencies computed.
pub fn check(deb: &Path) -> Result<Package> {
    let list = run(Command::new("dpkg-deb").arg("--contents").arg(deb))?;
    let paths: Vec<&str> = list.lines().filter_map(|l| l.split_whitespace().nth(5)).collect();
    let missing: Vec<&&str> = REQUIRED.iter().filter(|r| !paths.contains(r)).collect();
    ensure!(missing.is_empty(), "{} lacks {missing:?}", deb.display());
    let depends = run(Command::new("dpkg-deb").arg("--field").arg(deb).arg("Depends"))?.trim().to_owned();
    ensure!(depends.contains("libc6"), "Depends was not computed from the binaries: {depends:?}");
    let tmp = tempdir()?;
    run(Command::new("dpkg-deb").arg("--extract").arg(deb).arg(&tmp))?;
    run(Command::new("dpkg-deb").arg("--control").arg(deb).arg(tmp.join("DEBIAN")))?;
    let conffiles = std::fs::read_to_string(tmp.join("DEBIAN/conffiles")).unwrap_or_default();
    ensure!(conffiles.contains("/etc/tyche/tyched.toml"), "tyched.toml is not a conffile: {conffiles:?}");
    let mut binaries = Vec::new();
    for bin in ["tyched", "tyche-init"] {
        let p = tmp.join("usr/bin").join(bin);
        let size = std::fs::metadata(&p)?.len();
        ensure!(size <= MAX_BINARY, "{bin}: {size} bytes, not stripped? (at most {MAX_BINARY})");
        let sections = run(Command::new("readelf").arg("--section-headers").arg(&p))?;
        ensure!(!sections.contains(".debug_info"), "{bin} has debug information");
        let v = run(Command::new(&p).arg("--version"))?;
        ensure!(v.starts_with(bin), "{bin} --version: {v:?}");
        binaries.push((bin.to_owned(), size));
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(Package { deb: deb.to_owned(), files: paths.len(), depends, binaries })
}

fn tempdir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("tyche-package-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// `cargo xtask package`.
pub fn package(root: &Path) -> Result<Package> {
    let deb = build(root)?;
    let p = check(&deb)?;
    let sizes: Vec<String> = p.binaries.iter().map(|(b, s)| format!("{b} {:.1} MB", *s as f64 / 1e6)).collect();
    println!(
        "package: {} ({} files, the {} required ones present; stripped binaries: {}; Depends: {})",
        p.deb.display(),
        p.files,
        REQUIRED.len(),
        sizes.join(", "),
        p.depends
    );
    Ok(p)
}
