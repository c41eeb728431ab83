//! The function profiler against the truth: a program that times its own
//! phases, recorded once, its profile taken at the recording's sample
//! marks. In a binary of its own: the truth is the guest's clock, which a
//! second VM on the same CPUs (the other tests of a binary run beside
//! each other) would stretch in one phase and not another.
//!
//! It needs /dev/kvm and the guest image (the test command builds it).

mod common;

use std::path::Path;

use common::*;
use events::abi::Kind;
use events::db::EventDb;

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn profiles_are_shares_of_the_recorded_run_and_every_replay_has_the_same_samples() {
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
        // "profile_split: phases arith A ns chase C ns hash H ns"
        let phases: Vec<f64> = stdout
            .lines()
            .find_map(|l| l.strip_prefix("profile_split: phases "))
            .unwrap_or_else(|| panic!("no phases in:\n{stdout}"))
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        assert_eq!(phases.len(), 3, "{stdout}");
        let total: f64 = phases.iter().sum();

        let db = dir.join(format!("events{opt}.db"));
        let out = replay_into(&trace, &db, &["--diagnose", "profile"]);
        let (report, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(stderr.contains("sampled at "), "{stderr}");
        // "  24.60%       292  profile_split    arith": samples per function.
        let samples = |function: &str| -> f64 {
            report
                .lines()
                .find(|l| l.split_whitespace().nth(3) == Some(function))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no {function} in:\n{report}"))
        };
        let counts = [samples("arith"), samples("chase"), samples("hash")];
        let user: f64 = counts.iter().sum();
        assert!(user >= 400.0, "{user} user samples:\n{report}");
        // The phases are timed by the guest's clock, the host's: time the
        // host gives other work (a shared, noisy host) stretches a phase
        // without a sample in it, which the profile rightly leaves out.
        // On a quiet host the shares are within 2 pp (tools/bench-samples,
        // docs/BENCHMARKS.md, where the 3-pp goal is measured); on a loaded
        // one 4 pp has been seen. The bound here catches what the marks
        // exist to fix: replay-time sampling was 16.8 pp off on this
        // program, and a tight loop losing its marks 7 pp.
        for (i, name) in ["arith", "chase", "hash"].iter().enumerate() {
            let (truth, share) = (100.0 * phases[i] / total, 100.0 * counts[i] / user);
            assert!(
                (share - truth).abs() <= 6.0,
                "{opt} {name}: {share:.1} % of the user samples, {truth:.1} % of the time \
                 (phases {phases:?}):\n{report}"
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
