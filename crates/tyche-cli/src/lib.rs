//! What `tyched` and `tyche-init` share on their command lines: how a configuration error ends
//! the process (one line, exit status 78, never a backtrace) and the man pages and shell
//! completions generated from their clap definitions for the package.

use std::path::Path;
use std::process::ExitCode;

/// Exit status of a configuration that cannot work (sysexits' EX_CONFIG), so that a unit stops
/// restarting on it (`RestartPreventExitStatus=78`).
pub const EX_CONFIG: u8 = 78;

/// A configuration error: the configuration (a file, flags, or what they name on this host) is
/// wrong, and starting again will not help.
#[derive(Debug)]
pub struct BadConfig(pub anyhow::Error);

impl std::fmt::Display for BadConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for BadConfig {}

/// Marks an error as a configuration error.
pub fn bad_config(e: impl Into<anyhow::Error>) -> anyhow::Error {
    anyhow::Error::new(BadConfig(e.into()))
}

/// Whether `e` is (or wraps) a configuration error.
pub fn is_bad_config(e: &anyhow::Error) -> bool {
    e.downcast_ref::<BadConfig>().is_some()
}

/// Ends `main`: prints an error as one line, the causes joined, with `prefix` (no backtrace
/// whatever RUST_BACKTRACE says: an operator's error, not a program's), and gives 78 for
/// configuration errors, 1 for the others.
pub fn exit(prefix: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{prefix}{e:#}");
            if is_bad_config(&e) {
                ExitCode::from(EX_CONFIG)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Writes the man pages of `cmd` and each of its visible subcommands to `out/man` (section 1,
/// `tyched.1`, `tyched-serve.1`, ...) and bash, zsh and fish completions to `out/completions`.
pub fn generate_docs(cmd: clap::Command, out: &Path) -> std::io::Result<()> {
    let man = out.join("man");
    let completions = out.join("completions");
    std::fs::create_dir_all(&man)?;
    std::fs::create_dir_all(&completions)?;
    clap_mangen::generate_to(cmd.clone(), &man)?;
    let name = cmd.get_name().to_owned();
    for shell in [clap_complete::Shell::Bash, clap_complete::Shell::Zsh, clap_complete::Shell::Fish] {
        clap_complete::generate_to(shell, &mut cmd.clone(), &name, &completions)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_errors_are_told_apart_through_context() {
        use anyhow::Context;
        let e = Err::<(), _>(bad_config(anyhow::anyhow!("no such interface"))).context("starting").unwrap_err();
        assert!(is_bad_config(&e));
        assert!(!is_bad_config(&anyhow::anyhow!("connection refused")));
        assert_eq!(format!("{e:#}"), "starting: no such interface");
    }

    #[test]
    fn docs_name_every_visible_subcommand() {
        let cmd = clap::Command::new("demo")
            .about("A demo")
            .subcommand(clap::Command::new("serve").about("Serve").arg(clap::Arg::new("iface").long("iface")))
            .subcommand(clap::Command::new("secret").hide(true));
        let d = tempfile::tempdir().unwrap();
        generate_docs(cmd, d.path()).unwrap();
        let man = std::fs::read_to_string(d.path().join("man/demo-serve.1")).unwrap();
        assert!(man.contains("iface"), "{man}");
        assert!(!d.path().join("man/demo-secret.1").exists(), "hidden subcommands have no page");
        for f in ["demo.bash", "_demo", "demo.fish"] {
            assert!(d.path().join("completions").join(f).exists(), "{f}");
        }
    }
}
