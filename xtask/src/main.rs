//! `cargo xtask <command>`: the project's orchestration (test suite, simulation, fuzzing, lab, AF_XDP smoke
//! test, benchmarks, filesystem checks). Plain `cargo build` and `cargo test` work without it.

mod attack;
mod bench_e2e;
mod bench_scale;
mod bench_send_mode;
mod bpfgen;
mod charts;
mod demo;
mod disk;
mod e2e;
mod faults;
mod flood;
mod fuzz;
mod lab;
mod logwrites;
mod modcycles;
mod nbd_clients;
mod package;
mod readme;
mod sim;
mod stack;
mod suite;
mod vm;
mod vm_base;
mod vm_boot;
mod vm_crash;
mod vm_mirror;
mod vm_nbd;
mod vm_numa;
mod vm_ublk;
mod xdp;
mod xdp_share;

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "Tyche's project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Bring up a lab, serve a RAM-backed export, use it as a disk with ext4, report (root).
    Demo(demo::DemoArgs),
    /// Run the whole test suite as CI does.
    Test(suite::TestArgs),
    /// ext4 over Tyche end to end on a veth lab, clean, then with loss and a failing link (root).
    E2e(e2e::E2eArgs),
    /// Fault scenarios on a veth lab: target restarts, SIGKILL, a long outage, a second
    /// initiator and fencing, hung storage (root).
    Faults(faults::FaultsArgs),
    /// The flood test: 100,000 forged CONNECTs from 1,000 MACs while fio verifies (root).
    Flood(flood::FloodArgs),
    /// The safety rails of a shared NIC: discover and a second tyched beside a live attachment (root).
    XdpShare(xdp_share::XdpShareArgs),
    /// The README's two-host walkthrough, run as written in a veth lab (root).
    Readme(readme::ReadmeArgs),
    /// The attack test: a third host on the segment attacks a keyed session (root).
    Attack(attack::AttackArgs),
    /// Coverage-guided fuzzing of the target, the initiator and the NBD server (docs/fuzzing.md).
    Fuzz(fuzz::FuzzArgs),
    /// Run the deterministic simulator over many seeds (or replay one).
    Sim(sim::SimArgs),
    /// The veth lab: two network namespaces (target, initiator) joined by veth pairs.
    Lab {
        #[command(subcommand)]
        action: lab::LabCommand,
    },
    /// Builds everything and checks AF_XDP end to end on a 2-NIC veth lab, with IP alongside.
    XdpSmoke(xdp::SmokeArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Regenerates `bpf/tyche_wire.h` from `tyche_wire::layout`.
    GenBpfHeader {
        /// Fail if the checked-in header differs instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Fails if modules within a crate import each other in a cycle (CONTRIBUTING.md).
    ModuleCycles,
    /// ext4 over an NBD Unix socket (nbdfuse, loop): mkfs, write, fsck, remount, verify (root).
    FsCheck(disk::FsCheckArgs),
    /// qemu-img, qemu-io (qemu 10 and 7.2) and libnbd against tyche-init's NBD server: both NBD
    /// I/O paths, tyched over AF_XDP and the in-process target (root).
    NbdClients(nbd_clients::NbdClientsArgs),
    /// Builds the Debian package (cargo-deb; installed when missing) and checks its contents.
    Package,
    /// Boots a VM (Debian 6.12 kernel, 2 NUMA nodes): /dev/ublkbN with ext4, NUMA placement (root).
    VmTest(vm::VmTestArgs),
    /// Inside the VM only: runs one guest test and prints its `VMTEST` verdict line.
    #[command(hide = true)]
    VmGuest {
        #[arg(value_enum)]
        test: vm::GuestTest,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Raw Tyche frames over AF_XDP on one veth pair, against iperf3 TCP on the same pair.
    Xdp(xdp::BenchArgs),
    /// fio through NBD: Tyche over AF_XDP (1 and 2 NICs) and over TCP against nbdkit (root).
    E2e(bench_e2e::BenchE2eArgs),
    /// Inline against queue send mode: the library client, 4 KiB random reads at QD1 and QD32.
    SendMode(bench_send_mode::BenchSendModeArgs),
    /// Channel scaling: both daemons' frame handling with 1 channel on 1 pinned thread against
    /// 2 on 2, peers replayed from frames built in advance (no root).
    Scale(bench_scale::BenchScaleArgs),
}

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Demo(a) => {
            ctrlc::set_handler(|| stack::INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed))?;
            demo::demo(&root(), &a)
        }
        Command::Test(a) => suite::run(a),
        Command::E2e(a) => e2e::e2e(&root(), &a),
        Command::Flood(a) => {
            ctrlc::set_handler(|| stack::INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed))?;
            flood::flood(&root(), &a)
        }
        Command::XdpShare(a) => {
            ctrlc::set_handler(|| stack::INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed))?;
            xdp_share::xdp_share(&root(), &a)
        }
        Command::Readme(a) => {
            ctrlc::set_handler(|| stack::INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed))?;
            readme::readme(&root(), &a)
        }
        Command::Attack(a) => {
            ctrlc::set_handler(|| stack::INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed))?;
            attack::attack(&root(), &a)
        }
        Command::Fuzz(a) => fuzz::run(&root(), &a),
        Command::Faults(a) => {
            ctrlc::set_handler(|| stack::INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed))?;
            faults::faults(&root(), &a)
        }
        Command::Sim(a) => sim::run(a),
        Command::Lab { action } => lab::run(action),
        Command::XdpSmoke(args) => xdp::smoke(&root(), &args),
        Command::Bench { what: BenchCommand::Xdp(args) } => xdp::bench(&root(), &args),
        Command::Bench { what: BenchCommand::E2e(args) } => bench_e2e::bench_e2e(&root(), &args),
        Command::Bench { what: BenchCommand::SendMode(args) } => bench_send_mode::bench_send_mode(&root(), &args),
        Command::Bench { what: BenchCommand::Scale(args) } => bench_scale::bench_scale(&root(), &args),
        Command::GenBpfHeader { check } => bpfgen::run(&root(), check),
        Command::ModuleCycles => modcycles::check(&root()),
        Command::FsCheck(a) => disk::fs_check(a),
        Command::NbdClients(a) => {
            println!("{}", nbd_clients::nbd_clients(&root(), &a)?);
            Ok(())
        }
        Command::VmTest(a) => {
            ctrlc::set_handler(|| stack::INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed))?;
            vm::vm_test(&root(), &a)
        }
        Command::VmGuest { test } => vm::guest(test),
        Command::Package => package::package(&root()).map(|_| ()),
    }
}
