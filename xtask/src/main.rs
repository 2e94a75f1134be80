//! `cargo xtask <command>`: the project's orchestration (simulation, test suite, lab, benches).
//! Plain `cargo build` and `cargo test` work without it.

mod disk;
mod sim;
mod suite;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Tyche's project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the deterministic simulator over many seeds (or replay one).
    Sim(sim::SimArgs),
    /// Run the whole test suite as CI does.
    Test(suite::TestArgs),
    /// ext4 over an NBD Unix socket (nbdfuse, loop): mkfs, write, fsck, remount, verify (root).
    FsCheck(disk::FsCheckArgs),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Sim(a) => sim::run(a),
        Command::Test(a) => suite::run(a),
        Command::FsCheck(a) => disk::fs_check(a),
    }
}
