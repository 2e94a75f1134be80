//! When a thread that serves rings and sockets polls again, and when it sleeps.
//!
//! Every thread of the data path (the target's network threads, the initiator's engine threads)
//! loops over turns: look at the rings and sockets, do what is there, then either go round again
//! or sleep in `poll(2)` until a descriptor is ready. Sleeping after every empty turn costs a
//! wake-up on each hop of a request, which at queue depth 1 is most of its latency; polling
//! forever burns a core. A [`Poller`] decides between the two after each turn.
//!
//! # Contract
//! - Sans-IO: the poller reads no clock and makes no system call. The caller passes the time
//!   (any monotonic [`Instant`]) and whether the turn did work, and gets [`Next::Poll`] (go round
//!   again now) or [`Next::Sleep`] (wait for an event, with the caller's own timeout). The same
//!   inputs always give the same answers, so tests drive it with a made-up clock.
//! - [`PollMode::Sleep`] sleeps after every turn that found nothing (the behaviour before this
//!   module). [`PollMode::Spin`] never sleeps. [`PollMode::Adaptive`] (the default) keeps polling
//!   after a turn that did work for at most a *budget*, then sleeps; a thread that has been idle
//!   longer than that sleeps after every empty turn, so an idle daemon does not burn a core.
//! - The budget adapts, always between [`PollConfig::floor`] and the configured
//!   [`PollConfig::budget`]: a poll that found work grows it (to twice the time that work took to
//!   come, and by an eighth), a poll that ran out shrinks it by half, and a sleep that work ended
//!   within the configured budget (a near miss) raises it to cover that wait.
//! - Counters ([`PollStats`]) say how long the thread polled, how often polling found work, how
//!   often it slept, and how many of those sleeps ended in work (wake-ups polling did not save).
//! - **Contention.** A polling thread that yields between empty turns stays runnable, so on a core
//!   shared with other busy work it keeps taking CPU the rest of the path needs (measured: 2–3x
//!   fewer IOPS than sleeping, with two busy loops on two cores). The thread's own run-queue
//!   wait is the signal: the caller feeds the poller the time the thread has run and waited for
//!   a CPU ([`SchedStat`], from the kernel's schedstat) when [`Poller::sample_due`] says so, at
//!   most every [`SAMPLE_EVERY`]. When, since the last sample, the thread waited more than
//!   [`CONTENDED_RATIO`] times as long as it ran and more than [`CONTENDED_SHARE`] of the wall
//!   time, [`PollMode::Adaptive`] gives polling up for [`HOLDOFF`] and sleeps after every empty
//!   turn, as [`PollMode::Sleep`] does; then it tries again. [`PollMode::Spin`] (dedicated
//!   cores) never gives up. Why run against wait: the threads of one request's path take turns
//!   on the cores too, so a polling thread waits a lot even alone (measured on 2 cores at queue
//!   depth 1: the initiator's engine ran 45–70% of the time and waited 33–58%); with two busy
//!   loops on the cores, polling threads ran 5–9% and waited 76–100%.

use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How a thread waits between turns that found nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PollMode {
    /// After a turn that did work, poll for up to an adaptive budget, then sleep.
    #[default]
    Adaptive,
    /// Sleep after every turn that found nothing.
    Sleep,
    /// Never sleep (dedicated cores, benchmarks): the thread keeps its core busy even when idle.
    Spin,
}

impl PollMode {
    /// The name used in configuration files and on command lines.
    pub fn as_str(self) -> &'static str {
        match self {
            PollMode::Adaptive => "adaptive",
            PollMode::Sleep => "sleep",
            PollMode::Spin => "spin",
        }
    }
}

impl fmt::Display for PollMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How often [`PollMode::Adaptive`] looks at the thread's run-queue wait.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(10);
/// Contention, between two samples: the thread waited for a CPU more than this many times as
/// long as it ran ...
pub const CONTENDED_RATIO: u32 = 4;
/// ... and more than this share of the wall time (a half, as numerator and denominator).
pub const CONTENDED_SHARE: (u32, u32) = (1, 2);
/// How long [`PollMode::Adaptive`] sleeps after every empty turn once contention is seen.
pub const HOLDOFF: Duration = Duration::from_millis(100);

/// How a [`Poller`] behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollConfig {
    /// The mode.
    pub mode: PollMode,
    /// [`PollMode::Adaptive`]: the longest a thread polls after work before it sleeps (the
    /// adaptive budget stays between [`PollConfig::floor`] and this). Zero sleeps at once, as
    /// [`PollMode::Sleep`] does.
    pub budget: Duration,
}

/// A poll budget above [`MAX_BUDGET`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("poll budget {0} µs is above the most allowed, {max} µs", max = MAX_BUDGET.as_micros())]
pub struct BudgetTooLarge(pub u64);

/// The default budget of [`PollMode::Adaptive`]: longer than a request's round trip on a local
/// link, short enough that a thread that then sleeps has wasted little.
pub const DEFAULT_BUDGET: Duration = Duration::from_micros(100);
/// The largest budget accepted (10 ms): beyond it, use [`PollMode::Spin`].
pub const MAX_BUDGET: Duration = Duration::from_millis(10);

impl Default for PollConfig {
    fn default() -> Self {
        PollConfig { mode: PollMode::default(), budget: DEFAULT_BUDGET }
    }
}

impl PollConfig {
    /// A configuration of `mode` with a budget of `budget_us` microseconds.
    pub fn new(mode: PollMode, budget_us: u64) -> Result<Self, BudgetTooLarge> {
        let budget = Duration::from_micros(budget_us);
        if budget > MAX_BUDGET {
            return Err(BudgetTooLarge(budget_us));
        }
        Ok(PollConfig { mode, budget })
    }

    /// The smallest the adaptive budget shrinks to: a sixteenth of [`PollConfig::budget`].
    pub fn floor(&self) -> Duration {
        self.budget / 16
    }
}

/// What the thread does after a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Go round again now (a thread sharing its core may yield it first).
    Poll,
    /// Sleep until an event or the caller's own timeout.
    Sleep,
}

/// Counters of one [`Poller`] (one thread).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PollStats {
    /// Nanoseconds spent polling: in turns that found nothing, after work and before the next
    /// work or sleep.
    pub poll_ns: u64,
    /// Polls (runs of empty turns after work) that ended with work found: wake-ups saved.
    pub poll_hits: u64,
    /// Polls that ran out of budget and ended in a sleep.
    pub poll_misses: u64,
    /// Sleeps.
    pub sleeps: u64,
    /// Sleeps after which the next turn found work: wake-ups that polling did not save.
    pub wakeups: u64,
    /// The adaptive budget now, in nanoseconds.
    pub budget_ns: u64,
    /// Times polling was given up for [`HOLDOFF`] because the thread waited for a CPU far longer
    /// than it ran ([`CONTENDED_RATIO`], [`CONTENDED_SHARE`]): a core shared with other busy work.
    pub contended: u64,
}

impl PollStats {
    /// Adds `other`'s counters to these (the budget becomes the larger of the two).
    pub fn add(&mut self, other: &PollStats) {
        self.poll_ns += other.poll_ns;
        self.poll_hits += other.poll_hits;
        self.poll_misses += other.poll_misses;
        self.sleeps += other.sleeps;
        self.wakeups += other.wakeups;
        self.budget_ns = self.budget_ns.max(other.budget_ns);
        self.contended += other.contended;
    }
}

/// One line summing up the pollers of a daemon's threads (`mode`, configured budget in µs), for
/// the daemons' human-readable stats.
pub fn summary(mode: PollMode, budget_us: u64, threads: &[PollStats]) -> String {
    let mut all = PollStats::default();
    threads.iter().for_each(|t| all.add(t));
    format!(
        "poll {mode} (budget {budget_us} µs, now {} µs)  polled {:.3}s  found work {}  ran out {}  sleeps {}  woken for work {}  held off (cpu contended) {}",
        all.budget_ns / 1000,
        all.poll_ns as f64 / 1e9,
        all.poll_hits,
        all.poll_misses,
        all.sleeps,
        all.wakeups,
        all.contended
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing has happened yet, or the thread has been idle since before its last sleep with no
    /// work to measure a near miss against.
    Idle,
    /// The last turn did work; it ended at this time.
    Worked(Instant),
    /// Turns since `since` (the end of the last turn that did work) found nothing; the last one
    /// ended at `prev`.
    Polling { since: Instant, prev: Instant },
    /// The thread was told to sleep; work last ended at `last_work`, if known.
    Slept { last_work: Option<Instant> },
}

/// A thread's time on a CPU and waiting for one (runnable, not running), in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuTimes {
    /// On a CPU.
    pub run: Duration,
    /// Waiting in a run queue.
    pub wait: Duration,
}

/// The calling thread's [`CpuTimes`], from `/proc/thread-self/schedstat`. Opened by the thread it
/// measures; a kernel without schedstat gives `None`, and the poller then never sees contention.
#[derive(Debug)]
pub struct SchedStat {
    file: Option<File>,
}

impl SchedStat {
    /// Opens the calling thread's schedstat (call it on the thread that polls).
    pub fn of_this_thread() -> Self {
        SchedStat { file: File::open("/proc/thread-self/schedstat").ok() }
    }

    /// The thread's CPU times so far, if the kernel reports them.
    pub fn read(&self) -> Option<CpuTimes> {
        let mut buf = [0u8; 96];
        let n = self.file.as_ref()?.read_at(&mut buf, 0).ok()?;
        parse_schedstat(&buf[..n])
    }

    /// Feeds `poller` a sample if one is due at `now`.
    pub fn feed(&self, poller: &mut Poller, now: Instant) {
        if poller.sample_due(now) {
            if let Some(t) = self.read() {
                poller.sample(now, t);
            }
        }
    }
}

/// The CPU times in a schedstat line: "<on cpu ns> <waiting ns> <timeslices>".
fn parse_schedstat(line: &[u8]) -> Option<CpuTimes> {
    let text = std::str::from_utf8(line).ok()?;
    let mut fields = text.split_ascii_whitespace().map(str::parse::<u64>);
    let run = fields.next()?.ok()?;
    let wait = fields.next()?.ok()?;
    Some(CpuTimes { run: Duration::from_nanos(run), wait: Duration::from_nanos(wait) })
}

/// The polling policy of one thread. See the [module documentation](self).
#[derive(Debug, Clone)]
pub struct Poller {
    config: PollConfig,
    budget: Duration,
    state: State,
    stats: PollStats,
    /// The last sample: when, and the thread's CPU times then.
    sample: Option<(Instant, CpuTimes)>,
    /// Polling is given up until then (contention).
    holdoff_until: Option<Instant>,
}

impl Poller {
    /// A poller in `config`'s mode, its budget at the configured (largest) one.
    pub fn new(config: PollConfig) -> Self {
        Poller {
            config,
            budget: config.budget,
            state: State::Idle,
            stats: PollStats::default(),
            sample: None,
            holdoff_until: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> PollConfig {
        self.config
    }

    /// The adaptive budget now.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// The counters.
    pub fn stats(&self) -> PollStats {
        PollStats { budget_ns: self.budget.as_nanos() as u64, ..self.stats }
    }

    /// Whether the caller should pass [`Poller::sample`] the thread's CPU times now (adaptive
    /// mode, [`SAMPLE_EVERY`] after the last sample).
    pub fn sample_due(&self, now: Instant) -> bool {
        self.config.mode == PollMode::Adaptive
            && self.sample.is_none_or(|(at, _)| now.saturating_duration_since(at) >= SAMPLE_EVERY)
    }

    /// The thread's CPU times as of `now` ([`SchedStat::read`]). If, since the last sample, it
    /// waited more than [`CONTENDED_RATIO`] times as long as it ran and more than
    /// [`CONTENDED_SHARE`] of the time, polling is given up for [`HOLDOFF`].
    pub fn sample(&mut self, now: Instant, times: CpuTimes) {
        if let Some((at, before)) = self.sample {
            let elapsed = now.saturating_duration_since(at);
            let ran = times.run.saturating_sub(before.run);
            let waited = times.wait.saturating_sub(before.wait);
            let (num, den) = CONTENDED_SHARE;
            if waited > ran * CONTENDED_RATIO && waited * den > elapsed * num {
                if !self.held_off(now) {
                    self.stats.contended += 1;
                }
                self.holdoff_until = Some(now + HOLDOFF);
            }
        }
        self.sample = Some((now, times));
    }

    /// Whether polling is given up at `now` (contention seen less than [`HOLDOFF`] ago).
    pub fn held_off(&self, now: Instant) -> bool {
        self.holdoff_until.is_some_and(|t| now < t)
    }

    /// Says what to do after a turn that ended at `now` and did work or not (`did_work`).
    pub fn turn(&mut self, now: Instant, did_work: bool) -> Next {
        if did_work {
            self.worked(now);
            return Next::Poll;
        }
        match (self.config.mode, self.state) {
            (PollMode::Sleep, _) => self.sleep(None),
            // The core is contended: sleep as `Sleep` does, keeping the time of the last work.
            (PollMode::Adaptive, State::Worked(at) | State::Polling { since: at, .. }) if self.held_off(now) => {
                self.sleep(Some(at))
            }
            (_, State::Worked(at)) => self.poll_on(at, at, now),
            (_, State::Polling { since, prev }) => self.poll_on(since, prev, now),
            (PollMode::Spin, State::Idle | State::Slept { .. }) => {
                self.state = State::Polling { since: now, prev: now };
                Next::Poll
            }
            // Idle since before the last sleep: sleep again.
            (PollMode::Adaptive, State::Idle | State::Slept { .. }) => self.sleep(None),
        }
    }

    /// A turn that found nothing while polling since `since`: poll on within the budget.
    fn poll_on(&mut self, since: Instant, prev: Instant, now: Instant) -> Next {
        self.stats.poll_ns += now.saturating_duration_since(prev).as_nanos() as u64;
        if self.config.mode == PollMode::Spin || now.saturating_duration_since(since) < self.budget {
            self.state = State::Polling { since, prev: now };
            return Next::Poll;
        }
        // Polled the whole budget for nothing: poll less next time.
        self.stats.poll_misses += 1;
        self.budget = (self.budget / 2).max(self.config.floor());
        self.sleep(Some(since))
    }

    fn sleep(&mut self, last_work: Option<Instant>) -> Next {
        self.stats.sleeps += 1;
        self.state = State::Slept { last_work };
        Next::Sleep
    }

    fn worked(&mut self, now: Instant) {
        let max = self.config.budget;
        match self.state {
            State::Polling { since, .. } => {
                // Polling found work `gap` after the last: keep at least twice that, and grow.
                self.stats.poll_hits += 1;
                let gap = now.saturating_duration_since(since);
                self.budget = (self.budget + self.budget / 8).max(gap * 2).min(max);
            }
            State::Slept { last_work } => {
                self.stats.wakeups += 1;
                if let Some(gap) = last_work.map(|w| now.saturating_duration_since(w)).filter(|g| *g <= max) {
                    // A near miss: polling a little longer would have caught this.
                    if self.config.mode == PollMode::Adaptive {
                        self.budget = self.budget.max(gap + gap / 4).min(max);
                    }
                }
            }
            State::Idle | State::Worked(_) => {}
        }
        self.state = State::Worked(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// A made-up clock: the poller never reads a real one.
    struct Clock(Instant);

    impl Clock {
        fn new() -> Self {
            Clock(Instant::now())
        }
        fn tick(&mut self, d: Duration) -> Instant {
            self.0 += d;
            self.0
        }
    }

    fn adaptive(budget_us: u64) -> Poller {
        Poller::new(PollConfig::new(PollMode::Adaptive, budget_us).expect("budget in range"))
    }

    /// Turns `step` apart with nothing to do until the poller says to sleep; how many there were.
    fn idle_until_sleep(p: &mut Poller, c: &mut Clock, step: Duration) -> usize {
        for n in 1..100_000 {
            if p.turn(c.tick(step), false) == Next::Sleep {
                return n;
            }
        }
        panic!("the poller never slept");
    }

    /// Work, then silence until the poller sleeps, then an empty wake-up long after: the budget
    /// shrinks once and no near miss is left to raise it.
    fn go_idle(p: &mut Poller, c: &mut Clock) {
        p.turn(c.tick(us(1)), true);
        idle_until_sleep(p, c, us(1));
        assert_eq!(p.turn(c.tick(Duration::from_millis(10)), false), Next::Sleep);
    }

    #[test]
    fn modes_parse_and_print() {
        for m in [PollMode::Adaptive, PollMode::Sleep, PollMode::Spin] {
            assert_eq!(<PollMode as clap::ValueEnum>::from_str(&m.to_string(), false), Ok(m));
        }
        assert!(<PollMode as clap::ValueEnum>::from_str("busy", false).is_err());
        assert_eq!(PollConfig::default().mode, PollMode::Adaptive);
    }

    #[test]
    fn budgets_above_the_limit_are_refused() {
        assert_eq!(PollConfig::new(PollMode::Adaptive, 10_001), Err(BudgetTooLarge(10_001)));
        assert!(PollConfig::new(PollMode::Adaptive, 10_000).is_ok());
        assert!(BudgetTooLarge(20_000).to_string().contains("10000"), "{}", BudgetTooLarge(20_000));
    }

    #[test]
    fn an_idle_thread_sleeps_after_the_budget_and_then_at_once() {
        let mut c = Clock::new();
        let mut p = adaptive(100);
        // Never worked: sleeps at the first empty turn.
        assert_eq!(p.turn(c.tick(us(1)), false), Next::Sleep);
        assert_eq!(p.turn(c.tick(us(1)), true), Next::Poll);
        // Polls about 100 µs in 1 µs turns, then sleeps.
        let turns = idle_until_sleep(&mut p, &mut c, us(1));
        assert_eq!(turns, 100);
        let s = p.stats();
        assert_eq!((s.poll_misses, s.poll_hits, s.sleeps), (1, 0, 2));
        assert_eq!(s.poll_ns, 100_000);
        // The wake-up found nothing: straight back to sleep, no polling, however often.
        for _ in 0..1000 {
            assert_eq!(p.turn(c.tick(Duration::from_millis(100)), false), Next::Sleep);
        }
        let s = p.stats();
        assert_eq!((s.poll_ns, s.sleeps, s.wakeups), (100_000, 1002, 1));
    }

    #[test]
    fn a_steady_stream_keeps_polling() {
        let mut c = Clock::new();
        let mut p = adaptive(100);
        p.turn(c.tick(us(1)), true);
        // Work every 30 µs, empty turns of 2 µs between: never a sleep.
        for _ in 0..1000 {
            for _ in 0..14 {
                assert_eq!(p.turn(c.tick(us(2)), false), Next::Poll);
            }
            assert_eq!(p.turn(c.tick(us(2)), true), Next::Poll);
        }
        let s = p.stats();
        assert_eq!((s.sleeps, s.poll_misses, s.wakeups, s.poll_hits), (0, 0, 0, 1000));
        assert_eq!(p.budget(), us(100), "hits keep the budget at its most");
        assert_eq!(s.poll_ns, 1000 * 28_000);
    }

    #[test]
    fn spin_never_sleeps_and_sleep_always_does() {
        let mut c = Clock::new();
        let mut spin = Poller::new(PollConfig { mode: PollMode::Spin, budget: us(10) });
        let mut sleep = Poller::new(PollConfig { mode: PollMode::Sleep, budget: us(10) });
        let now = c.tick(us(1));
        for p in [&mut spin, &mut sleep] {
            p.turn(now, true);
        }
        for _ in 0..10_000 {
            let now = c.tick(us(1));
            assert_eq!(spin.turn(now, false), Next::Poll);
            assert_eq!(sleep.turn(now, false), Next::Sleep);
        }
        assert_eq!(spin.turn(c.tick(us(1)), true), Next::Poll);
        assert_eq!(sleep.turn(c.tick(us(1)), true), Next::Poll);
        let (a, b) = (spin.stats(), sleep.stats());
        assert_eq!((a.sleeps, a.poll_hits, a.poll_ns), (0, 1, 10_000_000));
        assert_eq!((b.sleeps, b.wakeups, b.poll_ns), (10_000, 1, 0));
    }

    #[test]
    fn a_zero_budget_sleeps_at_once() {
        let mut c = Clock::new();
        let mut p = adaptive(0);
        p.turn(c.tick(us(1)), true);
        assert_eq!(p.turn(c.tick(us(1)), false), Next::Sleep);
        assert_eq!(p.stats().poll_misses, 1);
    }

    #[test]
    fn misses_shrink_the_budget_to_its_floor_and_no_further() {
        let mut c = Clock::new();
        let mut p = adaptive(160);
        let mut last = p.budget();
        // Work, then a long silence, again and again: each poll runs out and halves the budget.
        for _ in 0..10 {
            go_idle(&mut p, &mut c);
            assert!(p.budget() <= last);
            last = p.budget();
        }
        assert_eq!(p.budget(), us(10), "floor: a sixteenth of 160 µs");
        // Polls now last about the floor.
        p.turn(c.tick(us(1)), true);
        assert_eq!(idle_until_sleep(&mut p, &mut c, us(1)), 10);
    }

    #[test]
    fn hits_grow_the_budget_back_within_bounds() {
        let mut c = Clock::new();
        let mut p = adaptive(160);
        for _ in 0..10 {
            go_idle(&mut p, &mut c);
        }
        assert_eq!(p.budget(), us(10));
        // Work comes 8 µs after the last, within the budget: the budget goes to twice that gap
        // at least, and grows by an eighth with every hit, up to the configured 160 µs.
        p.turn(c.tick(us(1)), true);
        for _ in 0..7 {
            p.turn(c.tick(us(1)), false);
        }
        p.turn(c.tick(us(1)), true);
        assert_eq!(p.budget(), us(16));
        let mut prev = p.budget();
        for _ in 0..100 {
            for _ in 0..7 {
                assert_eq!(p.turn(c.tick(us(1)), false), Next::Poll);
            }
            p.turn(c.tick(us(1)), true);
            assert!(p.budget() >= prev && p.budget() <= us(160));
            prev = p.budget();
        }
        assert_eq!(p.budget(), us(160));
    }

    #[test]
    fn a_near_miss_raises_the_budget_to_cover_it() {
        let mut c = Clock::new();
        let mut p = adaptive(100);
        for _ in 0..10 {
            go_idle(&mut p, &mut c);
        }
        let floor = p.budget();
        assert_eq!(floor, us(6) + Duration::from_nanos(250));
        let before = p.stats();
        // Work every 40 µs: the first poll runs out (a miss), the wake-up 40 µs after the last
        // work is a near miss, and the budget becomes 50 µs, after which polling catches it.
        p.turn(c.tick(us(1)), true);
        let mut slept = 0;
        for _ in 0..100 {
            let mut t = 0;
            let mut asleep = false;
            while t < 39 {
                t += 1;
                if !asleep && p.turn(c.tick(us(1)), false) == Next::Sleep {
                    asleep = true;
                    slept += 1;
                } else if asleep {
                    c.tick(us(1));
                }
            }
            p.turn(c.tick(us(1)), true);
        }
        assert_eq!(slept, 1, "one miss, then every request is caught by polling");
        let s = p.stats();
        // Wake-ups: the first work after the idle spell, and the near miss.
        assert_eq!((s.wakeups - before.wakeups, s.poll_hits - before.poll_hits), (2, 99));
        assert_eq!(p.budget(), us(100));
    }

    #[test]
    fn wake_ups_long_after_the_last_work_leave_the_budget_alone() {
        let mut c = Clock::new();
        let mut p = adaptive(100);
        p.turn(c.tick(us(1)), true);
        idle_until_sleep(&mut p, &mut c, us(1));
        let b = p.budget();
        assert_eq!(p.turn(c.tick(Duration::from_millis(5)), true), Next::Poll);
        assert_eq!(p.budget(), b);
        assert_eq!(p.stats().wakeups, 1);
    }

    fn times(run_us: u64, wait_us: u64) -> CpuTimes {
        CpuTimes { run: us(run_us), wait: us(wait_us) }
    }

    #[test]
    fn a_contended_core_gives_polling_up_for_the_holdoff() {
        let mut c = Clock::new();
        let mut p = adaptive(100);
        assert!(p.sample_due(c.0));
        p.sample(c.0, times(0, 0));
        // Work, then 10 ms in which the thread ran 4.5 ms and waited 5.5 ms for a CPU (the other
        // threads of the path had it): not contention.
        p.turn(c.tick(us(1)), true);
        assert_eq!(p.turn(c.tick(us(10)), false), Next::Poll);
        let now = c.tick(SAMPLE_EVERY);
        assert!(p.sample_due(now));
        p.sample(now, times(4500, 5500));
        assert!(!p.held_off(now));
        assert!(!p.sample_due(c.tick(us(10))), "at most one sample per {SAMPLE_EVERY:?}");
        // A thread that slept most of the time and waited a little, more than it ran: not either.
        let now = c.tick(SAMPLE_EVERY);
        p.sample(now, times(4510, 5600));
        assert!(!p.held_off(now));
        // The next 10 ms it ran 0.5 ms and waited 9 ms: contended. Empty turns after work now
        // sleep at once.
        let now = c.tick(SAMPLE_EVERY);
        p.sample(now, times(5010, 14_600));
        assert!(p.held_off(now));
        assert_eq!(p.stats().contended, 1);
        assert_eq!(p.turn(c.tick(us(1)), true), Next::Poll, "work still goes round again");
        assert_eq!(p.turn(c.tick(us(1)), false), Next::Sleep);
        let misses = p.stats().poll_misses;
        for _ in 0..10 {
            p.turn(c.tick(us(1)), true);
            assert_eq!(p.turn(c.tick(us(1)), false), Next::Sleep);
        }
        assert_eq!(p.stats().poll_misses, misses, "a held-off sleep is not a miss: the budget stays");
        assert_eq!(p.budget(), us(100));
        // Contention seen again while held off extends the holdoff but counts once.
        let now = c.tick(SAMPLE_EVERY);
        p.sample(now, times(5110, 24_100));
        assert_eq!(p.stats().contended, 1);
        // After the holdoff, with the core free again, polling comes back.
        let now = c.tick(HOLDOFF);
        p.sample(now, times(90_000, 30_000));
        assert!(!p.held_off(now));
        p.turn(c.tick(us(1)), true);
        assert_eq!(p.turn(c.tick(us(1)), false), Next::Poll);
    }

    #[test]
    fn spin_and_sleep_never_sample() {
        let now = Instant::now();
        for mode in [PollMode::Spin, PollMode::Sleep] {
            let mut p = Poller::new(PollConfig { mode, budget: us(10) });
            assert!(!p.sample_due(now));
            // Even told of contention, spin keeps polling.
            p.sample(now, times(0, 0));
            p.sample(now + SAMPLE_EVERY, times(0, 10_000));
            if mode == PollMode::Spin {
                p.turn(now + SAMPLE_EVERY, true);
                assert_eq!(p.turn(now + SAMPLE_EVERY + us(1), false), Next::Poll);
            }
        }
    }

    #[test]
    fn schedstat_lines_parse_and_bad_ones_do_not() {
        assert_eq!(parse_schedstat(b"123000 456789000 12\n"), Some(times(123, 456_789)));
        assert_eq!(parse_schedstat(b"123\n"), None);
        assert_eq!(parse_schedstat(b"1 x 2"), None);
        assert_eq!(parse_schedstat(&[0xff, 0x20, 0x31]), None);
        assert_eq!(parse_schedstat(b""), None);
        // This kernel has it (CONFIG_SCHED_INFO); without, the reader says None, never panics.
        let stat = SchedStat::of_this_thread();
        if let Some(a) = stat.read() {
            let b = stat.read().expect("read twice");
            assert!(b.run >= a.run && b.wait >= a.wait);
        }
    }

    #[test]
    fn stats_add_up() {
        let a =
            PollStats { poll_ns: 1, poll_hits: 2, poll_misses: 3, sleeps: 4, wakeups: 5, budget_ns: 6, contended: 7 };
        let mut b = PollStats { budget_ns: 9, ..a };
        b.add(&a);
        assert_eq!(
            b,
            PollStats { poll_ns: 2, poll_hits: 4, poll_misses: 6, sleeps: 8, wakeups: 10, budget_ns: 9, contended: 14 }
        );
        let json = serde_json::to_string(&b).expect("serialises");
        assert_eq!(serde_json::from_str::<PollStats>(&json).expect("parses"), b);
        assert_eq!(serde_json::from_str::<PollMode>("\"spin\"").expect("parses"), PollMode::Spin);
    }
}
