//! `cargo xtask test`: everything CI checks, in order, stopping at the first failure.

use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::sim::{self, SimArgs};

#[derive(Args, Debug)]
pub struct TestArgs {
    /// Skip the formatting and lint checks.
    #[arg(long)]
    no_lint: bool,
    /// Seeds for the simulator contract runs.
    #[arg(long, default_value_t = 500)]
    sim_seeds: u64,
}

pub use tyche_testkit::is_root;

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Names each step as it begins, with how long the one before took and the time so far, so a
/// run's log shows where its time goes (the suite is held under 45 minutes).
struct Steps {
    start: Instant,
    current: Option<(String, Instant)>,
}

static STEPS: Mutex<Option<Steps>> = Mutex::new(None);

/// Announces a step (and closes the one before).
fn begin(name: &str) {
    let mut steps = STEPS.lock().expect("steps lock");
    let now = Instant::now();
    let s = steps.get_or_insert_with(|| Steps { start: now, current: None });
    if let Some((last, since)) = s.current.take() {
        eprintln!("xtask test: ({last}: {:.0} s)", (now - since).as_secs_f64());
    }
    eprintln!("xtask test: {name} [{:.1} min in]", (now - s.start).as_secs_f64() / 60.0);
    s.current = Some((name.to_string(), now));
}

fn step(name: &str, cmd: &mut Command) -> Result<()> {
    begin(name);
    let status = cmd.status().with_context(|| format!("running {name}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

pub fn run(args: TestArgs) -> Result<()> {
    // Every test runs, or the suite fails: the privileged ones need root, and a test that
    // cannot run fails instead of skipping (`tyche_testkit::cannot_run`).
    if !is_root() {
        bail!(
            "cargo xtask test runs every test, and many need root (network namespaces, AF_XDP, loop \
             devices, the VM): run it as root, or run `cargo test --workspace` for the unprivileged ones"
        );
    }
    std::env::set_var(tyche_testkit::REQUIRE_ALL, "1");
    if !args.no_lint {
        step("cargo fmt --check", cargo().args(["fmt", "--all", "--", "--check"]))?;
        step("cargo clippy", cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
        begin("module cycles (none within a crate)");
        crate::modcycles::check(&crate::root())?;
    }
    step("cargo test", cargo().args(["test", "--workspace"]))?;
    begin("bpf/tyche_wire.h matches tyche_wire::layout");
    crate::bpfgen::run(&crate::root(), true)?;
    begin("package (cargo-deb: binaries, units, udev rule, man pages, completions, licences)");
    crate::package::package(&crate::root())?;
    begin("xdp-smoke");
    crate::xdp::smoke(&crate::root(), &crate::xdp::SmokeArgs::standard())?;
    // ext4 over nbdfuse over tyche-init's NBD server; AF_XDP over veth with a failing link.
    // `--workspace`, not `-p tyche-init`: the same feature set as `cargo test` above, so its test
    // binary is reused (with `-p`, cargo built tyche-init and its dependencies again: 4.5 min).
    step("tyche-init root tests", cargo().args(["test", "--workspace", "--test", "nbd", "--", "--ignored"]))?;
    begin("nbd-clients (qemu-img, qemu-io and libnbd on both NBD I/O paths and both targets)");
    let clients = crate::nbd_clients::nbd_clients(&crate::root(), &crate::nbd_clients::NbdClientsArgs::standard())?;
    eprintln!("xtask test: {clients}");
    begin("xdp-share (discover and a second tyched beside a live attachment, fio verify)");
    crate::xdp_share::xdp_share(&crate::root(), &crate::xdp_share::XdpShareArgs::standard())?;
    begin("readme (the README's two-host walkthrough, as written, in a veth lab)");
    crate::readme::readme(&crate::root(), &crate::readme::ReadmeArgs::standard())?;
    // The README's quick start, the command exactly as written.
    step("cargo xtask demo (the README's quick start, as written)", cargo().args(["xtask", "demo"]))?;
    begin("e2e (ext4 over tyche; 3% loss; a link down mid-copy)");
    crate::e2e::e2e(&crate::root(), &crate::e2e::E2eArgs::standard())?;
    begin("faults (target restarts, SIGKILL, a 20 s outage, fencing, hung storage)");
    crate::faults::faults(&crate::root(), &crate::faults::FaultsArgs::suite())?;
    begin("flood (100,000 CONNECTs from 1,000 MACs while fio verifies)");
    crate::flood::flood(&crate::root(), &crate::flood::FloodArgs::standard())?;
    begin("attack (a third namespace on the segment attacks a keyed session)");
    crate::attack::attack(&crate::root(), &crate::attack::AttackArgs::standard())?;
    // The fuzz targets build (3.5 min of both cores alone) at the lowest priority while the VM
    // guests run: their vCPUs leave about a quarter of the machine idle.
    let fuzz_build = std::thread::spawn(|| {
        let root = crate::root();
        crate::fuzz::prebuild(&root, &crate::xdp::target_dir(&root).join("fuzz-build.log"))
    });
    begin(
        "vm-test (ext4 on ublk and the faults' ublk recovery: kill -9 of tyche-init mid-write; NUMA \
         placement in a VM with two NUMA nodes; the kernel's and qemu's NBD clients; md mirrors across targets; \
         crash consistency at the target's disk with dm-log-writes; the .deb on a systemd guest across a reboot)",
    );
    // Every initramfs test in one boot (the faults' ublk-recovery scenario is the ublk test's
    // second half), then the systemd guest's.
    let vm = crate::vm::vm_test(
        &crate::root(),
        &crate::vm::VmTestArgs::only(&[
            crate::vm::GuestTest::Ublk,
            crate::vm::GuestTest::Numa,
            crate::vm::GuestTest::Nbd,
            crate::vm::GuestTest::Mirror,
            crate::vm::GuestTest::Crash,
            crate::vm::GuestTest::Boot,
        ]),
    );
    if vm.is_err() {
        // Leave no build running behind the failure.
        let _ = fuzz_build.join();
        return vm;
    }
    // Every NBD client people run, in one line: the host's (nbd-clients, the tyche-init root
    // tests' nbdfuse and nbdsh) and the VM's (the kernel's, and qemu as a VM's disk).
    eprintln!(
        "xtask test: {}; libnbd's nbdfuse and nbdsh ok (tyche-init root tests); qemu vm ok, kernel nbd ok (vm-test nbd)",
        clients.clients
    );
    begin("fuzz (every regression input, then a few seconds per target)");
    fuzz_build.join().expect("the fuzz build's thread panicked")?;
    crate::fuzz::run(&crate::root(), &crate::fuzz::FuzzArgs::short())?;
    begin("simulator contract (loss 5%)");
    sim::run(SimArgs::contract(args.sim_seeds, 0.05))?;
    begin("simulator contract (loss 30%)");
    sim::run(SimArgs::contract(args.sim_seeds, 0.3))?;
    begin("simulator contract (loss 5%, target restarts, partitions, engine restarts; sessions in 2 parts)");
    sim::run(SimArgs::restarts_contract(args.sim_seeds))?;
    begin("simulator contract (the same on an encrypted keyed export)");
    sim::run(SimArgs::keyed_contract(args.sim_seeds))?;
    begin("done");
    Ok(())
}
