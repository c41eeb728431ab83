//! Replay-time expansion (docs/expansion.md): a process single-stepped at
//! replay yields every user instruction it executed and every load and
//! store, without changing the replay.
//!
//! One recording of tests/programs/mem_access.c (built without PIE, so that
//! its globals have the same addresses in the guest and natively) serves
//! every check: the exact instruction count of a hand-written loop, the
//! accesses to a global array and to three heap blocks named by their
//! allocation sites (one used after it was freed), the same counts over
//! the program's whole data as Valgrind's lackey finds natively, and a
//! faithful replay with the same events as one that traces nothing.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::*;

/// (kind, size) -> accesses in [lo, hi), from lines "KIND ADDRESS,SIZE"
/// (lackey) or "KIND ADDRESS SIZE ..." (insight).
fn count_accesses(text: &str, lo: u64, hi: u64) -> BTreeMap<(String, u32), u64> {
    let mut counts = BTreeMap::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split([' ', ',']).filter(|f| !f.is_empty()).collect();
        let [kind, addr, size, ..] = fields[..] else {
            continue;
        };
        if !matches!(kind, "L" | "S" | "M") {
            continue;
        }
        let addr = addr.trim_start_matches("0x");
        let (Ok(addr), Ok(size)) = (u64::from_str_radix(addr, 16), size.parse::<u32>()) else {
            continue;
        };
        if (lo..hi).contains(&addr) {
            *counts.entry((kind.to_owned(), size)).or_insert(0) += 1;
        }
    }
    counts
}

/// Symbol and section addresses of the program, from binutils.
fn symbol(prog: &Path, name: &str) -> u64 {
    let out = Command::new("nm")
        .arg(prog)
        .output()
        .expect("nm (binutils)");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 3 && f[2] == name).then(|| u64::from_str_radix(f[0], 16).unwrap())
        })
        .unwrap_or_else(|| panic!("{} has no symbol {name}", prog.display()))
}

/// [start, end) of the program's writable data: .data through .bss.
fn data_range(prog: &Path) -> (u64, u64) {
    let out = Command::new("readelf")
        .args(["-SW"])
        .arg(prog)
        .output()
        .expect("readelf (binutils)");
    let text = String::from_utf8_lossy(&out.stdout);
    let section = |name: &str| {
        text.lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let at = f.iter().position(|w| *w == name)?;
                let addr = u64::from_str_radix(f.get(at + 2)?, 16).ok()?;
                let size = u64::from_str_radix(f.get(at + 4)?, 16).ok()?;
                Some((addr, size))
            })
            .unwrap_or_else(|| panic!("{} has no {name} section", prog.display()))
    };
    let (data, _) = section(".data");
    let (bss, bss_size) = section(".bss");
    (data, bss + bss_size)
}

/// The counts per kind of the "N events written to FILE (3 EXIT, ...)"
/// line, but MEMACCESS (the traced accesses).
fn events_written(stderr: &str) -> BTreeMap<String, u64> {
    let line = stderr
        .lines()
        .find(|l| l.contains("events written to"))
        .unwrap_or_else(|| panic!("no event summary in:\n{stderr}"));
    let kinds = line
        .rsplit_once('(')
        .map_or("", |(_, k)| k.trim_end_matches(')'));
    kinds
        .split(", ")
        .filter_map(|k| k.split_once(' '))
        .filter(|(_, kind)| *kind != "MEMACCESS")
        .map(|(n, kind)| (kind.to_owned(), n.parse().unwrap()))
        .collect()
}

#[ignore = "needs /dev/kvm, the guest image and valgrind (tools/test runs it)"]
#[test]
fn traced_instructions_and_accesses_are_exact_and_replay_unchanged() {
    guest_ready();
    let dir = scratch("expand");
    let prog = compile_test_program(&dir, "mem_access", &["-O1", "-no-pie"]);
    let cfg = dir.join("vm.toml");
    std::fs::write(
        &cfg,
        "command = \"mem_access\"\n[[files]]\nhost = \"mem_access\"\nguest = \
         \"/usr/local/bin/mem_access\"\n",
    )
    .unwrap();
    let trace = dir.join("trace");
    let mut cmd = insight();
    cmd.args(["record", "--no-stdin", "--probes", "-o"])
        .arg(&trace)
        .arg(&cfg);
    let out = output_within(cmd, std::time::Duration::from_secs(600));
    let recorded = expect_status(&out, 0);
    assert!(recorded.contains("sum 999000 heap 120"), "{recorded}");

    // A replay that traces nothing: its events (with the heap events, as
    // tracing collects them), and the program's pid.
    let plain_db = dir.join("plain.db");
    let out = replay_with(
        &trace,
        &["--events", plain_db.to_str().unwrap(), "--heap-events"],
    );
    expect_status(&out, 0);
    let plain_events = events_written(&text(&out).1);
    let threads = insight()
        .args(["report", "threads"])
        .arg(&plain_db)
        .output()
        .unwrap();
    let threads = String::from_utf8_lossy(&threads.stdout).into_owned();
    let pid = threads
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "mem_access").then(|| f[1].to_owned())
        })
        .unwrap_or_else(|| panic!("no mem_access thread in:\n{threads}"));

    // The traced replay: faithful, with the same events. Each traced
    // replay writes NAME-insns.zst, NAME-accesses.txt and NAME.db.
    let traced_replay = |name: &str, extra: &[&str]| {
        let files = (
            dir.join(format!("{name}-insns.zst")),
            dir.join(format!("{name}-accesses.txt")),
            dir.join(format!("{name}.db")),
        );
        let mut args = vec![
            "--events",
            files.2.to_str().unwrap(),
            "--trace-process",
            &pid,
            "--trace-instructions",
            files.0.to_str().unwrap(),
            "--trace-registers",
            "--trace-memory",
            files.1.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        (replay_with(&trace, &args), files)
    };
    let (out, (insns, accesses, traced_db)) = traced_replay("traced", &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert!(recorded.ends_with(&stdout), "{stdout}");
    assert!(
        stderr.contains(&format!("traced process {pid}:")),
        "{stderr}"
    );
    assert_eq!(events_written(&stderr), plain_events);
    assert!(plain_events.contains_key("EXIT"), "{plain_events:?}");
    assert!(plain_events.contains_key("ALLOC"), "{plain_events:?}");
    assert!(stderr.contains(" MEMACCESS"), "{stderr}");

    // Most instructions were stepped in guest kernel mode, and stepping
    // each in user mode (--trace-by-traps) writes the same traces and the
    // same event database.
    let count = |what: &str| -> u64 {
        let at = stderr
            .find(what)
            .unwrap_or_else(|| panic!("no '{what}' in {stderr}"));
        let before = stderr[..at].trim_end();
        before[before.rfind(' ').map_or(0, |i| i + 1)..]
            .parse()
            .unwrap_or_else(|e| panic!("{e}: {stderr}"))
    };
    let traced_count = count(" instructions and ");
    let kernel_steps = count(" of them stepped in guest kernel mode");
    assert!(
        kernel_steps * 2 > traced_count,
        "{kernel_steps} of {traced_count} in kernel mode: {stderr}"
    );
    let (out, (trap_insns, trap_accesses, trap_db)) = traced_replay("trap", &["--trace-by-traps"]);
    let (_, trap_stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{trap_stderr}");
    assert!(
        trap_stderr.contains(" 0 of them stepped in guest kernel mode"),
        "{trap_stderr}"
    );
    let decoded = |p: &Path| zstd::decode_all(std::fs::File::open(p).unwrap()).unwrap();
    assert!(
        decoded(&trap_insns) == decoded(&insns),
        "instruction traces differ"
    );
    assert!(
        std::fs::read(&trap_accesses).unwrap() == std::fs::read(&accesses).unwrap(),
        "memory traces differ"
    );
    assert!(
        std::fs::read(&trap_db).unwrap() == std::fs::read(&traced_db).unwrap(),
        "event databases differ"
    );

    // The hand-written loop: exactly its 2001 instructions. The pid is
    // traced from before its execve: only what follows main's first
    // instruction is the program's (the shell it was forked from is not
    // PIE either, and may have code at the same addresses).
    let raw = decoded(&insns);
    let traced = introspect::instructions::read_instructions(&raw).unwrap();
    let (start, end) = (symbol(&prog, "exact_loop"), symbol(&prog, "exact_loop_end"));
    let main = symbol(&prog, "main");
    let from_main = traced
        .iter()
        .position(|i| i.rip == main)
        .expect("main was traced");
    let in_loop = traced[from_main..]
        .iter()
        .filter(|i| (start..end).contains(&i.rip))
        .count();
    assert_eq!(in_loop, 2001);
    // With the registers before each: the loop's `dec ecx` sees ECX count
    // down from 1000 to 1.
    let ecx: Vec<u64> = traced[from_main..]
        .iter()
        .filter(|i| (start..end).contains(&i.rip) && i.bytes == [0xff, 0xc9])
        .map(|i| i.registers.expect("registers").gprs[1] & 0xffff_ffff)
        .collect();
    assert_eq!(ecx, (1..=1000).rev().collect::<Vec<u64>>());
    assert!(traced.iter().all(|i| i.lwpid.to_string() == pid));
    // Nothing is missing anywhere: every instruction that falls through is
    // followed by the next in memory (insight's trampolines and probe gate
    // included, whose own instructions are left out).
    let gaps: Vec<String> = traced
        .windows(2)
        .filter(|w| {
            let insn = introspect::instructions::decode(&w[0].bytes, w[0].rip).unwrap();
            introspect::instructions::continues_at_next(&insn)
                && w[1].rip != w[0].rip + w[0].bytes.len() as u64
        })
        .map(|w| format!("{:#x} {:02x?} -> {:#x}", w[0].rip, w[0].bytes, w[1].rip))
        .collect();
    assert!(
        gaps.is_empty(),
        "{} gaps, the first: {:?}",
        gaps.len(),
        &gaps[..gaps.len().min(5)]
    );

    // The global array: each element stored once and loaded twice.
    let accesses = std::fs::read_to_string(&accesses).unwrap();
    // Each line's position: the exits replayed before it, never going back.
    let exits: Vec<u64> = accesses
        .lines()
        .map(|l| l.split(' ').nth(5).and_then(|e| e.parse().ok()).expect(l))
        .collect();
    assert!(exits.windows(2).all(|w| w[0] <= w[1]) && exits[0] < exits[exits.len() - 1]);
    let a = symbol(&prog, "a");
    let on_a = count_accesses(&accesses, a, a + 4000);
    assert_eq!(
        on_a,
        BTreeMap::from([(("L".into(), 4), 2000), (("S".into(), 4), 1000)])
    );

    // The same accesses as MEMACCESS events, named by variable.
    let json = report_json("memory", &traced_db, &[]);
    let var = json["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["variable"] == "a")
        .unwrap_or_else(|| panic!("no variable a in {json}"));
    assert_eq!(
        (
            var["loads"].as_u64(),
            var["stores"].as_u64(),
            var["bytes"].as_u64()
        ),
        (Some(2000), Some(1000), Some(12000))
    );
    assert_eq!(
        json["accesses"].as_u64(),
        Some(accesses.lines().count() as u64)
    );

    // The main thread's own stack, by its name.
    let stack = json["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["variable"] == format!("stack:{pid}"))
        .unwrap_or_else(|| panic!("no stack:{pid} in {json}"));
    assert!(stack["loads"].as_u64() > Some(100) && stack["stores"].as_u64() > Some(100));

    // The heap blocks, by allocation site: exact counts, and the store
    // after free flagged on the block free() was given.
    let blocks = json["heap_blocks"].as_array().unwrap();
    let block = |site: &str| {
        let found: Vec<&serde_json::Value> = blocks
            .iter()
            .filter(|b| b["block"].as_str().unwrap_or("").starts_with(site))
            .collect();
        assert_eq!(found.len(), 1, "{site} in {blocks:?}");
        found[0]
    };
    let counts =
        |c: &serde_json::Value| ["loads", "stores", "modifies"].map(|k| c[k].as_u64().unwrap());
    let ints = block("malloc@make_ints+");
    assert_eq!(ints["size"].as_u64(), Some(64));
    assert_eq!(counts(&ints["accesses"]), [16, 16, 0]);
    assert_eq!(counts(&ints["after_free"]), [0, 0, 0]);
    assert!(ints["freed_by"].is_null());
    let longs = block("calloc@make_longs+");
    assert_eq!(longs["size"].as_u64(), Some(64));
    assert_eq!(counts(&longs["accesses"]), [8, 0, 0]);
    assert_eq!(counts(&longs["after_free"]), [0, 1, 0]);
    assert!(
        longs["freed_by"]
            .as_str()
            .unwrap()
            .starts_with("free@main+"),
        "{longs}"
    );
    let bytes = block("malloc@make_bytes+");
    assert_eq!(bytes["size"].as_u64(), Some(100));
    assert_eq!(counts(&bytes["accesses"]), [0, 10, 0]);
    let heat_map = dir.join("pages.svg");
    let text_report = insight()
        .args(["report", "memory"])
        .arg(&traced_db)
        .arg("--svg")
        .arg(&heat_map)
        .output()
        .unwrap();
    let (report_text, stderr) = text(&text_report);
    assert!(text_report.status.success(), "{stderr}");
    assert!(
        report_text.contains("1 access to calloc@make_longs+"),
        "{report_text}"
    );
    // The heat map has a row for the page where `a` starts, named after it.
    let svg = std::fs::read_to_string(&heat_map).unwrap();
    assert!(
        svg.contains(&format!(">{pid} {:#x} a<", a & !0xfff)),
        "no row for a's page in {svg}"
    );

    // The whole of its data, as Valgrind's lackey counts it natively.
    let lackey_log = dir.join("lackey.txt");
    let status = Command::new("valgrind")
        .args(["--tool=lackey", "--trace-mem=yes"])
        .arg(format!("--log-file={}", lackey_log.display()))
        .arg(&prog)
        .status()
        .expect("valgrind is needed (tools/test installs it)");
    assert!(status.success());
    let (lo, hi) = data_range(&prog);
    let lackey = count_accesses(&std::fs::read_to_string(&lackey_log).unwrap(), lo, hi);
    assert!(lackey.values().sum::<u64>() >= 3000, "{lackey:?}");
    assert_eq!(count_accesses(&accesses, lo, hi), lackey);

    // Traced by name: from the first exit after its execve (the shell the
    // pid ran before is not in it), with the same exact counts.
    let (by_name, by_name_db) = (dir.join("by-name.txt"), dir.join("by-name.db"));
    let out = replay_with(
        &trace,
        &[
            "--events",
            by_name_db.to_str().unwrap(),
            "--trace-process",
            "mem_access",
            "--trace-memory",
            by_name.to_str().unwrap(),
        ],
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!("traced process {pid} from exit "))
            && stderr.contains("after it executed /usr/local/bin/mem_access"),
        "{stderr}"
    );
    let by_name = std::fs::read_to_string(&by_name).unwrap();
    assert_eq!(count_accesses(&by_name, a, a + 4000), on_a);
    assert_eq!(count_accesses(&by_name, lo, hi), lackey);

    // --diagnose memory alone traces the recorded command's program.
    let out = replay_with(&trace, &["--diagnose", "memory"]);
    let (report, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("tracing the recorded command's process, mem_access"),
        "{stderr}"
    );
    let row = report
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.len() > 3 && w[1] == "a")
        .unwrap_or_else(|| panic!("no row for a in:\n{report}"));
    assert_eq!(
        (row[0], row[2], row[3]),
        (pid.as_str(), "2000", "1000"),
        "{report}"
    );

    let _ = std::fs::remove_dir_all(&dir);
}
