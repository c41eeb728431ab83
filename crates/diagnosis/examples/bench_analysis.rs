//! Analysis throughput: writes a synthetic event database (a simulated
//! uniprocessor run of a Syn_cont-like program: threads taking two levels
//! of shared locks, blocking and being switched out, sampled every
//! millisecond) and times each built-in plugin over it, next to a plain
//! read of the database.
//!
//!   cargo run --release -p diagnosis --example bench_analysis -- [EVENTS] [DIR]
//!
//! EVENTS defaults to 10 000 000; the database goes to DIR (default: a
//! temporary directory) and is removed afterwards. `tools/bench analysis`
//! runs this and prints the table docs/BENCHMARKS.md keeps.

use std::collections::VecDeque;
use std::time::Instant;

use diagnosis::plugin::{self, Output, Plugin, PluginContext, PluginError};
use diagnosis::plugins;
use events::abi::{Kind, Source};
use events::db::{EventDb, EventFormat, EventWriter, Row};
use guestfiles::GuestFiles;

const THREADS: u32 = 16;
const PID: u32 = 100;
/// Level-1 locks, each shared by 2 threads; level-2 locks, by 8.
const LEVEL1: u64 = 0x5555_0000_1000;
const LEVEL2: u64 = 0x5555_0000_2000;
const SAMPLE_NS: u64 = 1_000_000;

/// xorshift64*: reproducible, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Lock {
    owner: Option<u32>,
    waiters: VecDeque<u32>,
}

struct Thread {
    lwpid: u32,
    /// 0: take level 1; 1: take level 2; 2: release level 2; 3: release level 1.
    step: u8,
    /// Blocked in a request; `granted` once the lock was handed over.
    blocked: bool,
    granted: bool,
}

struct Sim {
    w: EventWriter,
    rng: Rng,
    time: u64,
    next_sample: u64,
    written: u64,
    locks: Vec<Lock>,
}

impl Sim {
    fn emit(&mut self, kind: Kind, source: Source, lwpid: u32, addr: u64, value: i64) {
        self.time += 200 + self.rng.below(2000);
        let caller = match (kind, source) {
            // Events the creator had raised before: none.
            (Kind::ThreadCreate, _) => Some(0),
            (_, Source::Probe) => Some(0x5555_0000_0100 + u64::from(kind as u16)),
            _ => None,
        };
        self.w
            .push(&Row {
                seq: 0,
                time: self.time,
                kind,
                source,
                pid: PID,
                lwpid,
                addr: Some(addr),
                caller,
                value: Some(value),
            })
            .unwrap_or_else(|e| panic!("writing the database: {e}"));
        self.written += 1;
    }

    fn lock_index(t: &Thread) -> [usize; 2] {
        let i = (t.lwpid - PID - 1) as usize;
        [i / 2, 8 + i / 8]
    }

    fn addr(index: usize) -> u64 {
        if index < 8 {
            LEVEL1 + 64 * index as u64
        } else {
            LEVEL2 + 64 * (index - 8) as u64
        }
    }

    /// Runs `t` for up to `quantum` steps; false when it blocked.
    fn run(&mut self, t: &mut Thread, threads_waiting: &mut [bool], quantum: u32) -> bool {
        for _ in 0..quantum {
            if self.time >= self.next_sample {
                self.next_sample += SAMPLE_NS;
                let rip = 0x5555_0000_4000 + self.rng.below(0x400);
                self.emit(Kind::Sample, Source::Host, t.lwpid, rip, 0);
            }
            let [l1, l2] = Self::lock_index(t);
            let which = if t.step == 0 || t.step == 3 { l1 } else { l2 };
            let addr = Self::addr(which);
            match t.step {
                0 | 1 => {
                    if t.blocked {
                        if !t.granted {
                            return false;
                        }
                        t.blocked = false;
                        t.granted = false;
                        self.emit(Kind::LockRet, Source::Probe, t.lwpid, addr, 0);
                        t.step += 1;
                        continue;
                    }
                    self.emit(Kind::Lock, Source::Probe, t.lwpid, addr, 0);
                    let lock = &mut self.locks[which];
                    if lock.owner.is_none() {
                        lock.owner = Some(t.lwpid);
                        self.emit(Kind::LockRet, Source::Probe, t.lwpid, addr, 0);
                        t.step += 1;
                    } else {
                        lock.waiters.push_back(t.lwpid);
                        t.blocked = true;
                        return false;
                    }
                }
                _ => {
                    self.emit(Kind::Unlock, Source::Probe, t.lwpid, addr, 0);
                    let lock = &mut self.locks[which];
                    lock.owner = lock.waiters.pop_front();
                    if let Some(next) = lock.owner {
                        threads_waiting[(next - PID - 1) as usize] = true;
                    }
                    t.step = (t.step + 1) % 4;
                }
            }
        }
        true
    }
}

/// Writes about `events` events to `path`; returns how many.
fn synthesize(path: &std::path::Path, events: u64, format: EventFormat) -> u64 {
    let w = EventWriter::create_with(path, &[("created_by", "bench_analysis".to_owned())], format)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut sim = Sim {
        w,
        rng: Rng(0x9e37_79b9_7f4a_7c15),
        time: 0,
        next_sample: SAMPLE_NS,
        written: 0,
        locks: (0..10).map(|_| Lock::default()).collect(),
    };
    let main = PID;
    sim.w.thread(PID, main, "syn_cont", 1).unwrap();
    let mut threads: Vec<Thread> = (1..=THREADS)
        .map(|i| Thread {
            lwpid: PID + i,
            step: 0,
            blocked: false,
            granted: false,
        })
        .collect();
    for t in &threads {
        sim.emit(
            Kind::ThreadCreate,
            Source::Probe,
            t.lwpid,
            0,
            i64::from(main),
        );
        sim.w.thread(PID, t.lwpid, "worker", sim.written).unwrap();
    }
    let mut granted = vec![false; THREADS as usize];
    let mut current = 0usize;
    while sim.written < events {
        for (t, g) in threads.iter_mut().zip(granted.iter_mut()) {
            if std::mem::take(g) {
                t.granted = true;
            }
        }
        let quantum = 20 + sim.rng.below(200) as u32;
        let t = &mut threads[current];
        sim.run(t, &mut granted, quantum);
        let from = t.lwpid;
        // Next runnable thread, round robin.
        let mut next = (current + 1) % threads.len();
        for _ in 0..threads.len() {
            let n = &threads[next];
            if !n.blocked || n.granted || granted[next] {
                break;
            }
            next = (next + 1) % threads.len();
        }
        let to = threads[next].lwpid;
        sim.time += 1000;
        sim.w
            .push(&Row {
                seq: 0,
                time: sim.time,
                kind: Kind::ContextSwitch,
                source: Source::Kernel,
                pid: PID,
                lwpid: from,
                addr: Some(u64::from(PID)),
                caller: None,
                value: Some(i64::from(to)),
            })
            .unwrap();
        sim.written += 1;
        current = next;
    }
    let written = sim.written;
    sim.w.finish().unwrap_or_else(|e| panic!("{e}"));
    written
}

/// Reads every event and does nothing: the cost of the database itself.
struct Scan(u64);

impl Plugin for Scan {
    fn name(&self) -> &'static str {
        "(read only)"
    }
    fn about(&self) -> &'static str {
        "reads every event"
    }
    fn subscribes(&self) -> &'static [Kind] {
        &[]
    }
    fn event(&mut self, _: &Row) {
        self.0 += 1;
    }
    fn finish(&mut self, _: &PluginContext) -> Result<Output, PluginError> {
        Ok(Output::default())
    }
}

/// Writes a database of `events` in `format` and times every plugin over it.
fn bench(dir: &std::path::Path, events: u64, format: EventFormat) {
    let path = dir.join(format!("synthetic-{}.db", format.name()));
    eprintln!(
        "bench_analysis: writing {events} synthetic events ({}) to {}",
        format.name(),
        path.display()
    );
    let start = Instant::now();
    let written = synthesize(&path, events, format);
    let write_s = start.elapsed().as_secs_f64();
    let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    println!(
        "\n{} database: {written} events, {:.1} MB ({:.1} B/event), written in {write_s:.1} s ({:.2} M events/s)",
        format.name(),
        size as f64 / 1e6,
        size as f64 / written as f64,
        written as f64 / write_s / 1e6
    );
    let db = EventDb::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let files = GuestFiles::default();
    let cx = PluginContext {
        db: &db,
        files: &files,
        files_missing: None,
        label: path.display().to_string(),
    };
    println!(
        "{:<12}  {:>10}  {:>8}  {:>16}",
        "tool", "events", "seconds", "M events/s"
    );
    let mut tools: Vec<Box<dyn Plugin>> = vec![Box::new(Scan(0))];
    tools.extend(plugins::registry());
    for tool in tools {
        let name = tool.name();
        let start = Instant::now();
        let mut one = vec![tool];
        let out = plugin::run(&mut one, &cx).unwrap_or_else(|e| panic!("{name}: {e}"));
        let s = start.elapsed().as_secs_f64();
        println!(
            "{name:<12}  {written:>10}  {s:>8.2}  {:>16.2}",
            written as f64 / s / 1e6
        );
        if name == "timeline" {
            let bytes = |format| out[0].attachment(format).map_or(0, str::len) as f64;
            eprintln!(
                "bench_analysis: timeline: JSON {:.1} MB ({:.1} B/event), page {:.1} MB",
                bytes("json") / 1e6,
                bytes("json") / written as f64,
                bytes("html") / 1e6
            );
        }
        if name == "locks" || name == "deadlock" {
            let first = out[0].text.lines().next().unwrap_or("").to_owned();
            eprintln!("bench_analysis: {name}: {first}");
        }
    }
    drop(db);
    let _ = std::fs::remove_file(&path);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let events: u64 = match args.next() {
        Some(n) => n.replace('_', "").parse().unwrap_or_else(|_| {
            eprintln!("bench_analysis: EVENTS must be a number, not '{n}'");
            std::process::exit(2)
        }),
        None => 10_000_000,
    };
    let (dir, remove) = match args.next() {
        Some(d) => (std::path::PathBuf::from(d), false),
        None => (
            std::env::temp_dir().join(format!("insight-bench-analysis-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for format in [EventFormat::Packed, EventFormat::Rows] {
        bench(&dir, events, format);
    }
    if remove {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
