//! `cargo xtask attack`: the attack test (root): a hostile host on the segment against keyed exports.
//!
//! A bridged lab ([`Lab::create_bridged`]): the target's and the initiator's veths are ports of a
//! bridge that floods every frame to every port, and a third namespace, the attacker's, has the
//! third port, so it sees every frame of the session. `tyched` serves a keyed file export (a
//! `key_file` of mode 0600); `tyche-attack` (crate `tyche-tools`) captures from the
//! attacker's namespace and runs the attacks one at a time, as this test asks it on its stdin:
//!
//! 1. a short keyed session (`tyche-init serve-nbd --key`, started and stopped): the attacker
//!    keeps its CONNECT + PROOF; once `tyched stats` shows the session reclaimed, the CONNECT +
//!    PROOF is replayed byte for byte from the initiator's MAC (no initiator runs then);
//! 2. the live session (`tyche-init serve-nbd --key`); the same CONNECT + PROOF re-addressed to
//!    its session id and channel 9;
//! 3. fio with `verify=crc32c` through the live session's NBD socket (random 4 KiB writes, each
//!    read back and checked), and meanwhile: forged COMPLETIONs OK for requests in flight,
//!    injected WRITEs (with their DATA), forged DISCONNECTs to the initiator, replayed DATA,
//!    forged DISCONNECTs to the target, FLUSHes with a huge FLOOR.
//!
//! Each attack sends up to `--tries` frames (stopping early once accepted); what counts as
//! accepted is what the wire shows (`tyche-attack`'s docs), plus what `tyched stats --json`
//! shows (a session after the replay while no initiator runs, channel 9 in the live session, the
//! live channel dead after the DISCONNECTs to the target) and the export's file (the injected
//! writes' marker in it). Then: fio's verify clean, both daemons running, a live channel of the
//! honest initiator in `tyched stats`, and a fresh write and read-back through the same NBD
//! socket. It prints a table and, last, `attack: <N> tried, <K> accepted`; it fails if K > 0 or a
//! check failed. `--decoy` sends every attack frame from a MAC no channel has, which the daemons
//! drop as they will drop forgeries once frames are authenticated: a self-check that the
//! detector reports nothing when nothing is accepted.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde_json::Value;

use crate::lab::Lab;
use crate::stack::{
    bin, fio_nbd, fio_result, interrupted, prepare, start_initiator, start_tyched_with, Guard, Link, Running,
};

/// The export the honest initiator attaches and the attacker attacks.
const EXPORT: &str = "attack";
/// Size of its backing file.
const EXPORT_MIB: u64 = 64;
/// Where the injected writes go (the attacker's `--inject-offset`): past fio's region.
const INJECT_OFFSET: u64 = 60 << 20;
/// What the injected writes' payload repeats (`tyche-attack`'s `MARKER`).
const MARKER: &[u8] = b"TYCHE-ATTACK-INJECTED-WRITE ";
/// The channel index the re-addressed CONNECT names.
const READDRESS_CHANNEL: u16 = 9;

#[derive(Args, Debug)]
pub struct AttackArgs {
    /// Frames each attack sends at most (it stops early once accepted).
    #[arg(long, default_value_t = 300)]
    tries: u32,
    /// fio's writes per second (each also read back and checked).
    #[arg(long, default_value_t = 300)]
    fio_iops: u32,
    /// Seconds fio runs; the attacks start 1 s into it.
    #[arg(long, default_value_t = 12)]
    fio_secs: u64,
    /// MTU of the links.
    #[arg(long, default_value_t = 3000)]
    mtu: u32,
    /// Send every attack frame from a MAC no channel has (the detector's self-check: nothing may
    /// be accepted).
    #[arg(long, hide = true)]
    decoy: bool,
    /// Do not install missing packages.
    #[arg(long)]
    no_install: bool,
}

impl AttackArgs {
    /// The standard run, packages already installed (for `cargo xtask test` once frames are
    /// authenticated).
    #[allow(dead_code)]
    pub fn standard() -> AttackArgs {
        AttackArgs { tries: 300, fio_iops: 300, fio_secs: 12, mtu: 3000, decoy: false, no_install: true }
    }
}

/// `tyche-attack`, driven through its stdin, its JSON lines read on a thread.
struct Attacker {
    child: Guard,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Attacker {
    fn start(root: &Path, lab: &Lab, work: &Path, decoy: bool) -> Result<Attacker> {
        let b = lab.bridged.as_ref().context("the attack needs a bridged lab")?;
        let pair = &lab.pairs[0];
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &b.attacker_ns]).arg(bin(root, "tyche-attack"));
        cmd.args(["--iface", &b.attacker_if, "--target", &pair.target_mac.to_string()]);
        cmd.args(["--initiator", &pair.initiator_mac.to_string(), "--inject-offset", &INJECT_OFFSET.to_string()]);
        if decoy {
            cmd.args(["--decoy", &tyche_wire::MacAddr::local(0xdec0).to_string()]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(fs::File::create(work.join("attacker.err"))?)
            .spawn()
            .context("starting tyche-attack")?;
        let stdin = child.stdin.take().context("tyche-attack's stdin")?;
        let stdout = child.stdout.take().context("tyche-attack's stdout")?;
        let (tx, lines) = mpsc::channel();
        let log = work.join("attacker.out");
        std::thread::spawn(move || {
            let mut log = fs::File::create(log).ok();
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if let Some(f) = log.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut a = Attacker { child: Guard(child), stdin, lines };
        let ready = a.line(Duration::from_secs(10)).context("tyche-attack did not start")?;
        ensure!(ready["event"] == "ready", "tyche-attack: {ready}");
        Ok(a)
    }

    fn line(&mut self, timeout: Duration) -> Result<Value> {
        let line = match self.lines.recv_timeout(timeout) {
            Ok(l) => l,
            Err(_) => {
                let status = self.child.0.try_wait()?;
                bail!("no answer from tyche-attack in {timeout:?} (exited: {status:?})");
            }
        };
        serde_json::from_str(&line).with_context(|| format!("tyche-attack said {line:?}"))
    }

    /// Tells it to exit (it is killed when dropped if it does not).
    fn quit(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait(Duration::from_secs(5));
    }

    /// Sends a command and waits for its line.
    fn cmd(&mut self, cmd: &str, timeout: Duration) -> Result<Value> {
        interrupted()?;
        writeln!(self.stdin, "{cmd}")?;
        self.stdin.flush()?;
        self.line(timeout).with_context(|| format!("tyche-attack {cmd}"))
    }
}

/// One attack's row of the report.
#[derive(Debug)]
struct Row {
    what: &'static str,
    tried: u64,
    evidence: Vec<String>,
    observed: String,
}

impl Row {
    fn from(what: &'static str, v: &Value) -> Row {
        let evidence =
            v["evidence"].as_array().map(|a| a.iter().filter_map(|e| e.as_str().map(String::from)).collect());
        Row {
            what,
            tried: v["tried"].as_u64().unwrap_or(0),
            evidence: evidence.unwrap_or_default(),
            observed: v["observed"].as_str().unwrap_or_default().to_string(),
        }
    }
}

struct Test<'a> {
    root: &'a Path,
    work: PathBuf,
    lab: &'a Lab,
    args: &'a AttackArgs,
    stats: PathBuf,
    key: PathBuf,
}

impl Test<'_> {
    /// `tyched stats --json`, bounded in time.
    fn stats(&self) -> Result<Value> {
        let out = self.work.join("stats.json");
        let child = Command::new(bin(self.root, "tyched"))
            .args(["stats", "--json", "--socket"])
            .arg(&self.stats)
            .stdin(Stdio::null())
            .stdout(fs::File::create(&out)?)
            .stderr(Stdio::null())
            .spawn()
            .context("running tyched stats")?;
        let status = Guard(child).wait(Duration::from_secs(10)).context("tyched stats")?;
        ensure!(status.success(), "tyched stats failed ({status})");
        serde_json::from_str(&fs::read_to_string(&out)?).context("tyched stats --json")
    }

    /// `tyche-init serve-nbd --key` in the initiator namespace, serving NBD on `socket`.
    fn initiator(&self, name: &str) -> Result<Running> {
        let extra = ["--key".to_string(), self.key.display().to_string()];
        let socket = self.work.join(format!("{name}.sock"));
        start_initiator(self.root, self.lab, Link::Xdp, EXPORT, &socket, self.work.join(format!("{name}.log")), &extra)
    }

    /// fio with verify through NBD socket `socket`, in the initiator namespace.
    fn fio(&self, name: &str, socket: &str, job: &[String]) -> Result<(Guard, PathBuf)> {
        fio_nbd(self.lab, &self.work, EXPORT, &self.work.join(format!("{socket}.sock")), name, job)
    }
}

/// The session id of a `tyche-attack` event (hex), as tyched stats prints it (a number).
fn session_of(v: &Value) -> Option<u64> {
    u64::from_str_radix(v["session"].as_str()?, 16).ok()
}

/// Whether `tyched stats` lists channel `channel` of `session`, and whether it is dead.
fn channel_state(stats: &Value, session: u64, channel: u64) -> Option<bool> {
    stats["channels"].as_array()?.iter().find_map(|c| {
        (c["session"].as_u64() == Some(session) && c["channel"].as_u64() == Some(channel))
            .then(|| c["dead"].as_bool().unwrap_or(false))
    })
}

/// Offsets (in MiB, from the start of the region) where the export's file holds the marker.
fn marker_in(image: &Path, from: u64, len: u64) -> Result<Option<u64>> {
    let mut f = fs::File::open(image)?;
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(from))?;
    let mut buf = vec![0u8; len as usize];
    let n = f.read(&mut buf)?;
    Ok(buf[..n].windows(MARKER.len()).position(|w| w == MARKER).map(|p| p as u64 + from))
}

pub fn attack(root: &Path, args: &AttackArgs) -> Result<()> {
    let begun = Instant::now();
    prepare(root, "attack", args.no_install)?;
    let pid = std::process::id();
    let work = PathBuf::from(format!("/run/tyche-attack-{pid}"));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    let lab = Lab::create_bridged(
        &format!("tya-t{pid}"),
        &format!("tya-i{pid}"),
        &format!("tya-s{pid}"),
        &format!("tyattack-{pid}"),
        args.mtu,
    )?;
    let t = Test {
        root,
        work: work.clone(),
        lab: &lab,
        args,
        stats: work.join("tyched.sock"),
        key: work.join("export.key"),
    };
    let result = run(&t);
    drop(lab);
    match &result {
        Ok(_) => {
            let _ = fs::remove_dir_all(&work);
        }
        Err(_) => eprintln!("attack: logs kept in {}", work.display()),
    }
    let (rows, failures) = result?;
    report(&rows, &failures, begun)
}

/// Prints the table and the last line; fails if an attack was accepted or a check failed.
fn report(rows: &[Row], failures: &[String], begun: Instant) -> Result<()> {
    let tried: u64 = rows.iter().map(|r| r.tried).sum();
    let accepted = rows.iter().filter(|r| !r.evidence.is_empty()).count();
    let w = rows.iter().map(|r| r.what.len()).max().unwrap_or(6);
    println!("{:<w$}  {:>6}  {:<8}  evidence", "attack", "tried", "accepted");
    for r in rows {
        let yes = if r.evidence.is_empty() { "no" } else { "YES" };
        let first = r.evidence.first().cloned().unwrap_or_else(|| {
            if r.observed.is_empty() {
                "no effect seen".to_string()
            } else {
                format!("no effect seen ({})", r.observed)
            }
        });
        println!("{:<w$}  {:>6}  {:<8}  {first}", r.what, r.tried, yes);
        for e in r.evidence.iter().skip(1) {
            println!("{:<w$}  {:>6}  {:<8}  {e}", "", "", "");
        }
    }
    for f in failures {
        println!("attack: FAILED: {f}");
    }
    eprintln!("attack: took {:.1} s in all", begun.elapsed().as_secs_f64());
    println!("attack: {tried} tried, {accepted} accepted");
    if accepted > 0 || !failures.is_empty() {
        let mut why = Vec::new();
        if accepted > 0 {
            why.push(format!("{accepted} attack(s) accepted"));
        }
        why.extend(failures.iter().cloned());
        bail!("{}", why.join("; "));
    }
    Ok(())
}

/// Runs the test; returns the rows and the failed checks (not counting accepted attacks).
fn run(t: &Test<'_>) -> Result<(Vec<Row>, Vec<String>)> {
    let args = t.args;
    let tries = args.tries;
    let (config, image) = write_config(t)?;
    let serve = ["--config".to_string(), config.display().to_string()];
    let mut tyched = start_tyched_with(t.root, t.lab, Link::Xdp, &serve, &t.stats, t.work.join("tyched.log"))?;
    let mut a = Attacker::start(t.root, t.lab, &t.work, args.decoy)?;
    if args.decoy {
        eprintln!("attack: decoy run: every attack frame goes out from a MAC no channel has");
    }
    let per_attack = Duration::from_secs(30 + u64::from(tries) / 50);
    let mut rows = Vec::new();
    let mut failures = Vec::new();

    capture_short_session(t, &mut a)?;
    rows.push(replay_connect(t, &mut a, per_attack)?);

    // The live session; (7) the same CONNECT + PROOF re-addressed to it, on channel 9.
    let mut live = t.initiator("live")?;
    rows.push(readdress_connect(t, &mut a, per_attack)?);

    // fio with verify through the live session while the rest runs.
    let fio_secs = args.fio_secs.max(4);
    let (mut fio, fio_out) = t.fio("verify", "live", &verify_job(args, fio_secs))?;
    let fio_started = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let tv = a.cmd("wait-traffic 10", Duration::from_secs(20))?;
    ensure!(tv["ok"] == true, "no requests seen on the live session: {tv}");

    run_attacks(t, &mut a, &mut tyched, &mut rows, per_attack)?;
    a.quit();

    // fio finishes on its own, verify clean.
    let fio_left = Duration::from_secs(fio_secs + 30).saturating_sub(fio_started.elapsed());
    check_fio(t, &mut fio, &fio_out, fio_left, &mut failures);

    // The session alive: both daemons, a live channel of the honest initiator, a fresh write and
    // read-back through the same NBD socket.
    if let Err(e) = tyched.check_alive() {
        failures.push(format!("tyched died: {e:#}"));
    }
    if let Err(e) = live.check_alive() {
        failures.push(format!("tyche-init died: {e:#}"));
    }
    if !honest_channel_alive(t) {
        failures.push("tyched stats shows no live channel of the honest initiator".to_string());
    }
    report_refused(t);
    let check: Vec<String> = ["--rw=write", "--bs=64k", "--iodepth=4", "--size=4m", "--offset=36m", "--do_verify=1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let (mut after, after_out) = t.fio("after", "live", &check)?;
    check_after(&mut after, &after_out, &mut failures);

    // The injected writes' data in the export's file.
    if let Some(at) = marker_in(&image, INJECT_OFFSET, 4 << 20)? {
        if let Some(row) = rows.iter_mut().find(|r| r.what.starts_with("injected WRITE")) {
            row.evidence.push(format!("the export's file holds the injected data at byte {at}"));
        }
    }
    live.daemon.stop();
    tyched.daemon.stop();
    Ok((rows, failures))
}

/// Writes a keyed file export's config, the key in a file only its owner can read; returns the
/// config's path and the export's file.
fn write_config(t: &Test<'_>) -> Result<(PathBuf, PathBuf)> {
    let key: String = {
        let mut raw = [0u8; 24];
        fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
        raw.iter().map(|b| format!("{b:02x}")).collect()
    };
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&t.key)?;
        f.write_all(key.as_bytes())?;
    }
    let config = t.work.join("tyched.toml");
    let image = t.work.join("export.img");
    fs::write(
        &config,
        format!(
            "[[export]]\nname = \"{EXPORT}\"\npath = \"{}\"\nsize = \"{EXPORT_MIB}M\"\nkey_file = \"{}\"\n",
            image.display(),
            t.key.display()
        ),
    )?;
    Ok((config, image))
}

/// A short keyed session whose handshake the attacker keeps; then its session is reclaimed.
fn capture_short_session(t: &Test<'_>, a: &mut Attacker) -> Result<()> {
    let mut short = t.initiator("short")?;
    let hs = a.cmd("wait-handshake 10", Duration::from_secs(20))?;
    ensure!(hs["ok"] == true, "the attacker captured no keyed handshake: {hs}");
    short.daemon.stop();
    let short_session = session_of(&hs).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = t.stats()?;
        if v["sessions"].as_u64() == Some(0) {
            eprintln!(
                "attack: short session {short_session:016x} captured, ended and reclaimed ({} reclaimed in all)",
                v["sessions_reclaimed"]
            );
            break;
        }
        ensure!(Instant::now() < deadline, "the short session was not reclaimed in 10 s: {}", v["sessions"]);
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// (6) The short session's CONNECT + PROOF replayed, byte for byte, with no initiator running.
fn replay_connect(t: &Test<'_>, a: &mut Attacker, per_attack: Duration) -> Result<Row> {
    let v = a.cmd(&format!("replay-connect {}", t.args.tries), per_attack)?;
    let mut row = Row::from("CONNECT+PROOF replayed after reclaim", &v);
    let sessions = t.stats()?["sessions"].as_u64().unwrap_or(0);
    if sessions > 0 {
        row.evidence.push(format!("tyched stats: {sessions} session(s) live while no initiator runs"));
    }
    Ok(row)
}

/// Waits for the live session, then (7) re-addresses the short session's CONNECT + PROOF to it,
/// on channel 9.
fn readdress_connect(t: &Test<'_>, a: &mut Attacker, per_attack: Duration) -> Result<Row> {
    let lv = a.cmd("wait-live 10", Duration::from_secs(20))?;
    ensure!(lv["ok"] == true, "the attacker saw no live session: {lv}");
    let live_session = session_of(&lv).context("live session id")?;
    eprintln!("attack: live session {live_session:016x}");
    let v = a.cmd(&format!("readdress {} {READDRESS_CHANNEL}", t.args.tries), per_attack)?;
    let mut row = Row::from("CONNECT+PROOF re-addressed to the live session, ch 9", &v);
    if channel_state(&t.stats()?, live_session, READDRESS_CHANNEL.into()).is_some() {
        row.evidence.push(format!("tyched stats: channel {READDRESS_CHANNEL} in the live session"));
    }
    Ok(row)
}

/// fio's options for the verify job that runs `fio_secs` seconds through the live session.
fn verify_job(args: &AttackArgs, fio_secs: u64) -> Vec<String> {
    ["--rw=randwrite", "--bs=4k", "--iodepth=8", "--size=32m", "--time_based"]
        .iter()
        .map(|s| s.to_string())
        .chain([
            format!("--runtime={fio_secs}"),
            format!("--rate_iops={}", args.fio_iops),
            "--verify_backlog=64".to_string(),
        ])
        .collect()
}

/// The attacks on the live session while fio runs, one at a time; a row for each.
fn run_attacks(
    t: &Test<'_>,
    a: &mut Attacker,
    tyched: &mut Running,
    rows: &mut Vec<Row>,
    per_attack: Duration,
) -> Result<()> {
    let tries = t.args.tries;
    let attacks: [(&str, &'static str); 6] = [
        ("forge-completion", "forged COMPLETION OK -> initiator"),
        ("inject-write", "injected WRITE (+ DATA) -> target"),
        ("disconnect-initiator", "forged DISCONNECT -> initiator"),
        ("replay-data", "replayed DATA (byte for byte)"),
        ("disconnect-target", "forged DISCONNECT -> target"),
        ("huge-floor", "REQUEST with a huge FLOOR -> target"),
    ];
    for (cmd, what) in attacks {
        tyched.check_alive().context("tyched died under the attack")?;
        // Wait for requests and completions on the live session (after an accepted attack
        // the initiator may first have to reconnect).
        let tv = a.cmd("wait-traffic 8", Duration::from_secs(20))?;
        if tv["ok"] != true {
            eprintln!("attack: no requests answered on the live session before {cmd}");
        }
        let v = a.cmd(&format!("{cmd} {tries}"), per_attack)?;
        let mut row = Row::from(what, &v);
        if cmd == "disconnect-target" {
            if let (Some(s), Some(c)) = (session_of(&v["at"]), v["at"]["channel"].as_u64()) {
                let stats = t.stats()?;
                match channel_state(&stats, s, c) {
                    Some(true) => row.evidence.push(format!("tyched stats: channel {c} of session {s:016x} dead")),
                    None => row.evidence.push(format!("tyched stats: channel {c} of session {s:016x} gone")),
                    Some(false) => {}
                }
            }
        }
        eprintln!(
            "attack: {cmd}: {} frames, {}",
            row.tried,
            if row.evidence.is_empty() { "no effect" } else { "ACCEPTED" }
        );
        rows.push(row);
    }
    Ok(())
}

/// Waits up to `fio_left` for fio to finish on its own; a failure unless its verify is clean.
fn check_fio(t: &Test<'_>, fio: &mut Guard, fio_out: &Path, fio_left: Duration, failures: &mut Vec<String>) {
    match fio.wait(fio_left) {
        Ok(status) => {
            let log = fs::read_to_string(t.work.join("verify.log")).unwrap_or_default();
            match fio_result(fio_out) {
                Ok((0, written, read)) if status.success() && written > 0 && read > 0 => eprintln!(
                    "attack: fio ok: {:.1} MiB written, {:.1} MiB read back and verified",
                    written as f64 / 1048576.0,
                    read as f64 / 1048576.0
                ),
                Ok((err, written, read)) => failures.push(format!(
                    "fio's verify failed ({status}, error {err}, {written} B written, {read} B verified): {}",
                    log.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
                )),
                Err(e) => failures.push(format!("fio failed ({status}): {e:#}")),
            }
        }
        Err(e) => failures.push(format!("fio did not finish: {e:#}")),
    }
}

/// Whether `tyched stats` shows a live channel of the honest initiator within 8 s.
fn honest_channel_alive(t: &Test<'_>) -> bool {
    let initiator_mac = t.lab.pairs[0].initiator_mac.to_string();
    let alive = |v: &Value| {
        v["channels"].as_array().is_some_and(|cs| {
            cs.iter().any(|c| {
                c["dead"] == false && c["peer"].as_str().is_some_and(|p| p.eq_ignore_ascii_case(&initiator_mac))
            })
        })
    };
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        match t.stats() {
            Ok(v) if alive(&v) => break true,
            _ if Instant::now() >= deadline => break false,
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Reports what the target refused, as it counted it (channel drops by reason, every NIC).
fn report_refused(t: &Test<'_>) {
    if let Ok(v) = t.stats() {
        let count = |reason: &str| -> u64 {
            v["nics"].as_array().map_or(0, |ns| ns.iter().filter_map(|n| n["drops"]["channel"][reason].as_u64()).sum())
        };
        let denied: u64 =
            v["nics"].as_array().map_or(0, |ns| ns.iter().filter_map(|n| n["drops"]["denied_key"].as_u64()).sum());
        eprintln!(
            "attack: tyched counted {} unauthenticated and {} replayed channel frames, {} CONNECTs with a wrong or replayed proof",
            count("unauthenticated"),
            count("replayed"),
            denied
        );
    }
}

/// Waits for the fresh write and read-back through the live session; a failure unless it is ok.
fn check_after(after: &mut Guard, after_out: &Path, failures: &mut Vec<String>) {
    match after.wait(Duration::from_secs(15)) {
        Ok(status) => match fio_result(after_out) {
            Ok((0, w, r)) if status.success() && w == 4 << 20 && r == 4 << 20 => {
                eprintln!("attack: the session is alive: a fresh 4 MiB write and read-back through it ok")
            }
            Ok((err, w, r)) => failures.push(format!(
                "the write and read-back after the attacks failed ({status}, error {err}, {w} B written, {r} B read)"
            )),
            Err(e) => failures.push(format!("the write and read-back after the attacks failed: {e:#}")),
        },
        Err(e) => failures.push(format!("the write and read-back after the attacks did not finish: {e:#}")),
    }
}
