//! Times insight reports against the program's own clock: the function
//! profiler's shares (a program that times its own phases, its profile
//! taken at the recording's sample marks; a host program whose functions
//! interleave, against its functions timed alone) and the lock tool's
//! hold times (a lock held in user code, with no exit in between). In a
//! binary of their own, one test at a time: the truth is the guest's
//! clock, which a second VM on the same CPUs would stretch in one stretch
//! and not another.
//!
//! They need /dev/kvm and the guest image (the test command builds it).

mod common;

use std::path::Path;
use std::sync::Mutex;

use common::*;
use events::abi::Kind;
use events::db::EventDb;

/// Held by each test: one VM at a time.
static ALONE: Mutex<()> = Mutex::new(());

/// The functions of profile_split and profile_mix, in the order they
/// print their times.
const FUNCTIONS: [&str; 3] = ["arith", "chase", "hash"];

/// The middle of `values` (the mean of the middle two of an even number).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The samples `insight report profile`'s table gives `function`, from
/// a row like "  24.60%       292  profile_split    arith".
fn samples(report: &str, function: &str) -> f64 {
    report
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.ends_with('%'))
        })
        .find(|l| l.split_whitespace().nth(3) == Some(function))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {function} in:\n{report}"))
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn profiles_are_shares_of_the_recorded_run_and_every_replay_has_the_same_samples() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    guest_ready();
    let dir = scratch("ev-split");
    for opt in ["-O1", "-O2"] {
        // profile_split in phases: both threads run all their arith()
        // calls, then chase(), then hash(); the program times each phase
        // (each function alone, in the very run the profile is of).
        let prog = build_workload(&dir, "profile_split", &[opt, "-fomit-frame-pointer"]);
        let prog = prog.to_str().expect("a scratch path in UTF-8");
        let trace = dir.join(format!("trace{opt}"));
        let out = record_into(
            &trace,
            &["--probes", "--file", prog],
            &[prog, "40", "phased"],
        );
        let stdout = expect_status(&out, 0);
        // "profile_split: phases arith A ns chase C ns hash H ns": each
        // phase's time over the five passes. Not a median pass: a pass
        // whose pointer chase takes twice its usual time (the host's
        // caches taken by others) is time the program spent there, and
        // the samples see it; a median left it out (chase 6.7 pp over).
        let phases: Vec<f64> = stdout
            .lines()
            .find_map(|l| l.strip_prefix("profile_split: phases "))
            .map(|l| {
                l.split_whitespace()
                    .filter_map(|w| w.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        assert!(phases.len() == 3, "{stdout}");
        let total: f64 = phases.iter().sum();

        let db = dir.join(format!("events{opt}.db"));
        let out = replay_into(&trace, &db, &["--diagnose", "profile"]);
        let (report, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(stderr.contains("sampled at "), "{stderr}");
        let counts = FUNCTIONS.map(|f| samples(&report, f));
        let user: f64 = counts.iter().sum();
        assert!(user >= 400.0, "{user} user samples:\n{report}");
        // The program's own split against the share of user samples:
        // measured on these hosts 0.2-2.0 pp (three runs of each build).
        // The bound catches what the marks exist to fix: replay-time
        // sampling was 16.8 pp off on this program, a tight loop losing
        // its marks 7 pp, unpatchable positions after a load 3.2 pp, and
        // the hash loop's samples at a trampoline's position taken for
        // the kernel's time 3.2 pp.
        for (i, name) in FUNCTIONS.iter().enumerate() {
            let (truth, share) = (100.0 * phases[i] / total, 100.0 * counts[i] / user);
            eprintln!("{opt} {name}: {share:.1} % of the user samples, {truth:.1} % of the time");
            assert!(
                (share - truth).abs() <= 3.0,
                "{opt} {name}: {share:.1} % of the user samples, {truth:.1} % of the time \
                 (phases {phases:?} ns):\n{stdout}\n{report}"
            );
        }

        if opt == "-O2" {
            // Another replay takes the same samples: times, threads,
            // positions and stacks.
            let again = dir.join("again.db");
            let out = replay_into(&trace, &again, &["--sample-period", "1ms"]);
            assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
            let sampled = |db: &Path| {
                let db = EventDb::open(db).unwrap();
                let mut all = Vec::new();
                db.for_each_with_stacks(&[Kind::Sample], |r, stack| {
                    all.push((r, stack.map(<[u64]>::to_vec)));
                    Ok(())
                })
                .unwrap();
                all
            };
            let first = sampled(&db);
            assert!(first.len() as f64 >= user);
            assert!(first == sampled(&again), "the replays' samples differ");
            // Sampling by the replay's host time is still there.
            let host = dir.join("host.db");
            let out = replay_into(
                &trace,
                &host,
                &["--diagnose", "profile", "--replay-time-samples"],
            );
            let (report, stderr) = text(&out);
            assert_eq!(out.status.code(), Some(0), "{stderr}");
            assert!(!stderr.contains("sampled at "), "{stderr}");
            assert!(sampled(&host).len() >= 300, "{report}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_host_program_whose_functions_interleave_is_profiled_as_its_guest_times_them() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    guest_ready();
    let scratch = scratch("ev-mix");
    for opt in ["-O1", "-O2"] {
        // As a user does: built on the host, recorded by its path from
        // its directory. The functions' rows are the interleaved rounds'
        // (the phases run twins of them, arith_alone and so on).
        let dir = scratch.join(opt);
        std::fs::create_dir_all(&dir).unwrap();
        let flags = [opt, "-fomit-frame-pointer", "-g", "-pthread"];
        compile_test_program(&dir, "profile_mix", &flags);
        let mut record = insight();
        record.current_dir(&dir).args([
            "record",
            "--no-stdin",
            "--probes",
            "-o",
            "trace",
            "--",
            "./profile_mix",
            "30",
            "alone",
        ]);
        let out = output_within(record, std::time::Duration::from_secs(600));
        let stdout = expect_status(&out, 0);
        // The truth: each function alone, timed by the guest in the very
        // run profiled, phase by phase ("profile_mix: pass K arith A ns
        // chase C ns hash H ns none E ns"), less an empty phase (the
        // barrier between phases, a few milliseconds of the guest's
        // kernel); each function's median share of the passes.
        let passes: Vec<Vec<f64>> = stdout
            .lines()
            .filter_map(|l| l.strip_prefix("profile_mix: pass "))
            .map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .filter_map(|w| w.parse().ok())
                    .collect::<Vec<f64>>()
            })
            .filter(|times| times.len() == 4)
            .collect();
        // PASSES in profile_mix.c.
        assert!(passes.len() == 10, "{stdout}");
        let barrier = median(passes.iter().map(|p| p[3]).collect());
        let split: Vec<f64> = (0..3)
            .map(|i| {
                median(
                    passes
                        .iter()
                        .map(|p| (p[i] - barrier) / (p[0] + p[1] + p[2] - 3.0 * barrier))
                        .collect(),
                )
            })
            .collect();
        let total: f64 = split.iter().sum();
        assert!(split.iter().all(|&s| s > 0.0), "{stdout}");

        let out = replay_into(
            &dir.join("trace"),
            &dir.join("events.db"),
            &["--diagnose", "profile"],
        );
        let (report, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let counts = FUNCTIONS.map(|f| samples(&report, f));
        let user: f64 = counts.iter().sum();
        assert!(user >= 400.0, "{user} user samples:\n{report}");
        let shares: Vec<(f64, f64)> = (0..3)
            .map(|i| (100.0 * counts[i] / user, 100.0 * split[i] / total))
            .collect();
        for (name, (share, truth)) in FUNCTIONS.iter().zip(&shares) {
            eprintln!("{opt} {name}: {share:.1} % of the user samples, {truth:.1} % of the time");
        }
        // The program's own split against the share of user samples,
        // the same bound as for profile_split's phases. Measured on a
        // host loaded by others: largest errors 0.6-1.9 pp in three runs
        // of each build (docs/profiler-comparison.md, 2026-12-06). Marks
        // that declines or given-up traps moved into the next function
        // would show here: 0-1 in 1200 did.
        for (name, (share, truth)) in FUNCTIONS.iter().zip(&shares) {
            assert!(
                (share - truth).abs() <= 3.0,
                "{opt} {name}: {share:.1} % of the user samples, {truth:.1} % of the time \
                 (passes {passes:?} ns):\n{report}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn lock_hold_times_inside_user_code_are_the_programs_own() {
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    guest_ready();
    let dir = scratch("lock-hold");
    // 40 holds of 16 ms of user-mode work each, a busy loop with no system
    // call: the guest kernel runs while the lock is held only for a timer
    // interrupt (several milliseconds each on a host that interprets it).
    let trace = dir.join("trace");
    let out = record_into(&trace, &["--probes"], &["lock_hold", "40", "16000"]);
    let stdout = expect_status(&out, 0);
    // "lock_hold: round R ns N": from the clock reading before each
    // request to the one after its release.
    let spans: Vec<f64> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("lock_hold: round "))
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .collect();
    assert_eq!(spans.len(), 40, "{stdout}");
    let db = dir.join("events.db");
    let out = replay_into(&trace, &db, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    // The holds as the lock tool times them: each LOCK_RET to the UNLOCK
    // after it; the first is the program's untimed warm-up.
    let mut holds = Vec::new();
    let mut acquired = None;
    EventDb::open(&db)
        .unwrap()
        .for_each(&[Kind::LockRet, Kind::Unlock], |row| {
            match row.kind {
                Kind::LockRet => acquired = Some(row.time),
                _ => holds.extend(acquired.take().map(|t| row.time as f64 - t as f64)),
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(holds.len(), 41, "{holds:?}");
    // They are the holds `report locks` averages.
    let report = report_json("locks", &db, &[]);
    let locks = report["locks"].as_array().unwrap();
    let held = locks
        .iter()
        .find(|l| l["hold"]["total_ns"].as_u64() > Some(0))
        .unwrap_or_else(|| panic!("no lock held for any time: {report}"));
    let average = holds.iter().sum::<f64>() / holds.len() as f64;
    let reported = held["hold"]["avg_ns"].as_f64().unwrap();
    assert!(
        (reported - average).abs() < 1e3,
        "{reported} {average}: {report}"
    );
    let holds = &holds[1..];
    let table = || -> String {
        let rows = spans.iter().zip(holds);
        rows.map(|(s, h)| format!("{:.2}/{:.2} ", s / 1e6, h / 1e6))
            .collect()
    };
    // The request is timed at the reading before it (an exit) or later,
    // the release at the last sample mark before it (one about every
    // 1.1 ms): a hold is never longer than its span.
    for (span, hold) in spans.iter().zip(holds) {
        assert!(
            *hold <= span + 50e3,
            "held {:.2} ms by the lock tool, {:.2} ms by the program's clock; \
             all rounds (program/tool, ms): {}",
            hold / 1e6,
            span / 1e6,
            table()
        );
    }
    // The program's own average hold: its spans less a clock reading's
    // cost. Each span also holds the guest kernel's work at the readings
    // around the hold (an interrupt delivered there, the system call's
    // entry and return), which the lock tool rightly leaves out: 0.1 to
    // 4.5 ms a round in the recordings measured, and on a host loaded
    // with two busy loops a few rounds in forty had their marks starved
    // (a hold of 0 against a 6-ms span) while the average stayed at
    // 0.88-0.96 of the program's (0.32-0.78 while the program calibrated
    // its loop from one disturbed run, so that its spans were mostly that
    // kernel work). An issue of the tool shows as a low average.
    let program: f64 = (stdout.lines())
        .find_map(|l| l.strip_prefix("lock_hold: rounds 40 hold_avg_ns "))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no average hold: {stdout}"));
    let ratio = holds.iter().sum::<f64>() / holds.len() as f64 / program;
    eprintln!("lock holds: the tool's average {ratio:.3} of the program's");
    assert!(
        (0.8..=1.05).contains(&ratio),
        "the lock tool's average hold is {ratio:.3} of the program's {:.2} ms; \
         all rounds (program/tool, ms): {}",
        program / 1e6,
        table()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
