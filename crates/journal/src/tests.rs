//! The journal against small recorded runs: faithful replays, and every
//! kind of mismatch reported at its exit.

use super::*;
use crate::testing::{header, temp_trace};
use kvm_bindings::kvm_regs;
use trace::{TraceReader, TraceWriter};

fn regs(rip: u64, rax: u64) -> kvm_regs {
    kvm_regs {
        rip,
        rax,
        ..Default::default()
    }
}

fn port_in(port: u16, rip: u64, value: u32) -> Entry {
    Entry::In {
        port,
        size: 1,
        rip,
        value,
    }
}

/// Records a small run: reads, a write, an interrupt, a halt.
fn record(dir: &std::path::Path, complete: bool) {
    let writer = TraceWriter::create(dir, &header(2)).unwrap();
    let mut r = Recorder::new(writer, 2);
    r.exit(port_in(0x40, 0x100, 7), &regs(0x100, 1), 0).unwrap();
    r.exit(port_in(0x40, 0x104, 9), &regs(0x104, 2), 0).unwrap();
    r.interrupt(0x30).unwrap();
    r.exit(serial_out(b'A'), &regs(0x200, 3), 0).unwrap();
    r.exit(Entry::Halt { rip: 0x300 }, &regs(0x300, 4), 0)
        .unwrap();
    r.interrupt(0x30).unwrap();
    if complete {
        r.finish(EndReason::CommandExited(3), 0).unwrap();
    } else {
        r.abandon();
    }
}

fn replayer(dir: &std::path::Path) -> Replayer {
    Replayer::new(TraceReader::open(dir).unwrap())
}

/// Replays one read exit the way dispatch and the vCPU loop do.
fn replay_read(j: &mut Replayer, port: u16, rip: u64, rax: u64) -> Result<u32, JournalError> {
    let observed = port_in(port, 0, 0);
    let value = match j.read(&observed)? {
        Entry::In { value, .. } => value,
        other => panic!("no logged read: {other:?}"),
    };
    j.exit(port_in(port, rip, value), &regs(rip, rax))?;
    Ok(value)
}

fn serial_out(byte: u8) -> Entry {
    Entry::Out {
        port: 0x3f8,
        size: 1,
        rip: 0x200,
        value: byte.into(),
    }
}

/// Replays the two reads and the interrupt of `record`.
fn replay_reads(j: &mut Replayer) {
    replay_read(j, 0x40, 0x100, 1).unwrap();
    replay_read(j, 0x40, 0x104, 2).unwrap();
    assert_eq!(j.interrupt().unwrap(), Some(0x30));
}

/// Replays all of `record`'s exits faithfully.
fn replay_all(j: &mut Replayer) {
    replay_reads(j);
    j.exit(serial_out(b'A'), &regs(0x200, 3)).unwrap();
    j.exit(Entry::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
    assert!(j.wakeup_due().unwrap());
    assert_eq!(j.interrupt().unwrap(), Some(0x30));
}

fn diverged_at(e: JournalError) -> u64 {
    match e {
        JournalError::Diverged(d) => d.exit,
        other => panic!("expected a divergence, got {other}"),
    }
}

#[test]
fn faithful_replay_gets_logged_values_and_interrupts() {
    let dir = temp_trace("faithful");
    record(&dir, true);
    let mut j = replayer(&dir);
    assert_eq!(replay_read(&mut j, 0x40, 0x100, 1).unwrap(), 7);
    assert_eq!(j.interrupt().unwrap(), None);
    assert_eq!(replay_read(&mut j, 0x40, 0x104, 2).unwrap(), 9);
    assert_eq!(j.interrupt().unwrap(), Some(0x30));
    j.exit(serial_out(b'A'), &regs(0x200, 3)).unwrap();
    j.exit(Entry::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
    assert!(j.wakeup_due().unwrap());
    assert_eq!(j.interrupt().unwrap(), Some(0x30));
    assert_eq!(j.end_reached().unwrap(), Some(EndReason::CommandExited(3)));
    j.end(&EndReason::CommandExited(3)).unwrap();
    assert_eq!(j.progress().exits, 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inputs_replay_in_their_recorded_order_with_their_payloads() {
    let dir = temp_trace("inputs");
    let frames = vec![vec![1u8; 60], vec![2u8; 1514]];
    {
        let writer = TraceWriter::create(&dir, &header(64)).unwrap();
        let mut r = Recorder::new(writer, 64);
        r.exit(Entry::Halt { rip: 0x300 }, &regs(0x300, 4), 0)
            .unwrap();
        r.net_rx(&frames).unwrap();
        r.disk_done(1).unwrap();
        r.net_rx(&frames[1..]).unwrap();
        r.interrupt(0x26).unwrap();
        r.finish(EndReason::PowerOff, 0).unwrap();
    }
    let mut j = replayer(&dir);
    j.exit(Entry::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
    assert!(j.wakeup_due().unwrap());
    assert_eq!(j.interrupt().unwrap(), None);
    assert_eq!(j.input().unwrap(), Some(Input::Net(frames.clone())));
    assert_eq!(j.input().unwrap(), Some(Input::Disk(1)));
    assert_eq!(j.input().unwrap(), Some(Input::Net(frames[1..].to_vec())));
    assert_eq!(j.input().unwrap(), None);
    assert_eq!(j.interrupt().unwrap(), Some(0x26));

    // A payload cut short: an error naming the payload, no panic; in a
    // complete trace, before replay starts.
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("payloads"))
        .unwrap()
        .set_len(100)
        .unwrap();
    let err = TraceReader::<Entry>::open(&dir).err().unwrap();
    assert!(err.is_damage(), "{err}");
    assert!(err.to_string().contains("payloads is damaged"), "{err}");
    std::fs::remove_file(dir.join("complete")).unwrap();
    let mut j = replayer(&dir);
    j.exit(Entry::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
    match j.input() {
        Err(JournalError::Trace(e)) => {
            let text = format!(
                "{e}: {}",
                std::error::Error::source(&e).map_or(String::new(), |s| s.to_string())
            );
            assert!(text.contains("payload"), "{text}");
        }
        other => panic!(
            "a cut payload was accepted: {:?}",
            other.map(|i| i.is_some())
        ),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn console_output_input_and_size_replay_and_output_is_checked() {
    let dir = temp_trace("console");
    let notify = |rip| Entry::MmioWrite {
        addr: 0xd000_0450,
        size: 4,
        rip,
        value: 1,
    };
    {
        let writer = TraceWriter::create(&dir, &header(64)).unwrap();
        let mut r = Recorder::new(writer, 64);
        r.exit(notify(0x100), &regs(0x100, 1), 0).unwrap();
        r.console_out(6, 0xfeed).unwrap();
        r.console_size((132, 43)).unwrap();
        r.console_rx(b"ls\n".to_vec()).unwrap();
        r.interrupt(0x27).unwrap();
        r.exit(notify(0x104), &regs(0x104, 2), 0).unwrap();
        r.console_out(2, 0xbeef).unwrap();
        r.exit(notify(0x108), &regs(0x108, 3), 0).unwrap();
        r.finish(EndReason::PowerOff, 0).unwrap();
    }
    let mut j = replayer(&dir);
    j.exit(notify(0x100), &regs(0x100, 1)).unwrap();
    j.console_out(Some((6, 0xfeed))).unwrap();
    assert!(j.wakeup_due().unwrap());
    assert_eq!(j.input().unwrap(), Some(Input::ConsoleSize(132, 43)));
    assert_eq!(j.input().unwrap(), Some(Input::Console(b"ls\n".to_vec())));
    assert_eq!(j.input().unwrap(), None);
    assert_eq!(j.interrupt().unwrap(), Some(0x27));
    // Other bytes than the recording's: a divergence at that exit.
    j.exit(notify(0x104), &regs(0x104, 2)).unwrap();
    let err = j.console_out(Some((2, 0xbee0))).unwrap_err();
    assert!(err.to_string().contains("console output"), "{err}");
    assert_eq!(diverged_at(err), 2);

    // Output where the recording had none, and none where it had some.
    let mut j = replayer(&dir);
    j.exit(notify(0x100), &regs(0x100, 1)).unwrap();
    assert_eq!(diverged_at(j.console_out(None).unwrap_err()), 1);
    let mut j = replayer(&dir);
    j.exit(notify(0x100), &regs(0x100, 1)).unwrap();
    j.console_out(Some((6, 0xfeed))).unwrap();
    while j.input().unwrap().is_some() {}
    j.interrupt().unwrap();
    j.exit(notify(0x104), &regs(0x104, 2)).unwrap();
    j.console_out(Some((2, 0xbeef))).unwrap();
    j.exit(notify(0x108), &regs(0x108, 3)).unwrap();
    assert_eq!(diverged_at(j.console_out(Some((1, 0))).unwrap_err()), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_command_s_streams_replay_and_each_is_checked() {
    let dir = temp_trace("streams");
    let message = |rip| Entry::Out {
        port: 0x0f00,
        size: 4,
        rip,
        value: 0x0e00_0001,
    };
    {
        let writer = TraceWriter::create(&dir, &header(64)).unwrap();
        let mut r = Recorder::new(writer, 64);
        r.exit(message(0x100), &regs(0x100, 1), 0).unwrap();
        r.stream_out(1, 4, 0xfeed, false).unwrap();
        r.exit(message(0x104), &regs(0x104, 2), 0).unwrap();
        r.stream_out(2, 4, 0xbeef, true).unwrap();
        r.exit(message(0x108), &regs(0x108, 3), 0).unwrap();
        r.finish(EndReason::CommandExited(0), 0).unwrap();
    }
    let mut j = replayer(&dir);
    j.exit(message(0x100), &regs(0x100, 1)).unwrap();
    assert!(!j.stream_out(1, 4, 0xfeed).unwrap());
    j.exit(message(0x104), &regs(0x104, 2)).unwrap();
    // The same bytes on the other stream: a divergence at that exit.
    let err = j.stream_out(1, 4, 0xbeef).unwrap_err();
    assert!(err.to_string().contains("standard output"), "{err}");
    assert_eq!(diverged_at(err), 2);
    // Output where the recording had none.
    let mut j = replayer(&dir);
    j.exit(message(0x100), &regs(0x100, 1)).unwrap();
    j.stream_out(1, 4, 0xfeed).unwrap();
    j.exit(message(0x104), &regs(0x104, 2)).unwrap();
    // The recording's standard error was closed there: so is the replay's.
    assert!(j.stream_out(2, 4, 0xbeef).unwrap());
    j.exit(message(0x108), &regs(0x108, 3)).unwrap();
    let err = j.stream_out(2, 1, 0).unwrap_err();
    assert!(err.to_string().contains("standard error"), "{err}");
    assert_eq!(diverged_at(err), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn entries_after_the_end_are_damage() {
    let dir = temp_trace("after-end");
    let mut w = TraceWriter::create(&dir, &header(64)).unwrap();
    w.push(Entry::End(EndReason::CommandExited(0))).unwrap();
    w.push(serial_out(b'X')).unwrap();
    w.finish().unwrap();
    let mut j = replayer(&dir);
    match j.end_reached() {
        Err(JournalError::Trace(e)) => {
            assert!(e.is_damage(), "{e}");
            assert!(e.to_string().contains("goes on after its end entry"), "{e}");
        }
        other => panic!("an entry after the end was accepted: {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mismatches_are_reported_at_their_exit() {
    let dir = temp_trace("mismatch");
    record(&dir, true);

    // Another port at exit 1.
    let mut j = replayer(&dir);
    assert_eq!(
        diverged_at(replay_read(&mut j, 0x41, 0x100, 1).unwrap_err()),
        1
    );

    // Another RIP at exit 2: found once the RIP is known.
    let mut j = replayer(&dir);
    replay_read(&mut j, 0x40, 0x100, 1).unwrap();
    assert_eq!(
        diverged_at(replay_read(&mut j, 0x40, 0x999, 2).unwrap_err()),
        2
    );

    // Other registers at exit 2 (digested every 2 exits).
    let mut j = replayer(&dir);
    replay_read(&mut j, 0x40, 0x100, 1).unwrap();
    assert_eq!(
        diverged_at(replay_read(&mut j, 0x40, 0x104, 99).unwrap_err()),
        2
    );

    // Another value written at exit 3.
    let mut j = replayer(&dir);
    replay_reads(&mut j);
    let err = j.exit(serial_out(b'B'), &regs(0x200, 3)).unwrap_err();
    assert_eq!(diverged_at(err), 3);

    // A different end.
    let mut j = replayer(&dir);
    replay_all(&mut j);
    assert!(j.end(&EndReason::PowerOff).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_incomplete_trace_ends_where_its_log_does() {
    let dir = temp_trace("incomplete");
    record(&dir, false);
    let mut j = replayer(&dir);
    assert!(!j.trace_complete());
    replay_all(&mut j);
    assert!(j.log_exhausted().unwrap());
    assert_eq!(j.end_reached().unwrap(), None);
    // The guest going on past the log (here after the interrupt the log
    // ends with) ends the replay there, at an exit or a read alike; the
    // exit the log does not hold is not counted.
    assert!(matches!(
        j.exit(Entry::Halt { rip: 0x300 }, &regs(0x300, 4)),
        Err(JournalError::LogEnded)
    ));
    assert!(matches!(
        replay_read(&mut j, 0x21, 0x310, 5),
        Err(JournalError::LogEnded)
    ));
    assert_eq!(j.progress().exits, 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn digests_depend_on_every_register() {
    // Each of the 18 registers the digest covers, changed alone (in its
    // lowest and its highest bit), changes the digest; the registers it
    // leaves out by design are none of these.
    type Field = fn(&mut kvm_regs) -> &mut u64;
    let fields: [(&str, Field); 18] = [
        ("rax", |r| &mut r.rax),
        ("rbx", |r| &mut r.rbx),
        ("rcx", |r| &mut r.rcx),
        ("rdx", |r| &mut r.rdx),
        ("rsi", |r| &mut r.rsi),
        ("rdi", |r| &mut r.rdi),
        ("rsp", |r| &mut r.rsp),
        ("rbp", |r| &mut r.rbp),
        ("r8", |r| &mut r.r8),
        ("r9", |r| &mut r.r9),
        ("r10", |r| &mut r.r10),
        ("r11", |r| &mut r.r11),
        ("r12", |r| &mut r.r12),
        ("r13", |r| &mut r.r13),
        ("r14", |r| &mut r.r14),
        ("r15", |r| &mut r.r15),
        ("rip", |r| &mut r.rip),
        ("rflags", |r| &mut r.rflags),
    ];
    let base_regs = regs(0x1234, 0x5678);
    let base = register_digest(&base_regs);
    let mut seen = std::collections::HashSet::new();
    for (name, field) in fields {
        for bit in [0, 63] {
            let mut r = base_regs;
            *field(&mut r) ^= 1 << bit;
            let digest = register_digest(&r);
            assert_ne!(digest, base, "{name} bit {bit} does not change the digest");
            // Nor does it collide with another register's change.
            assert!(seen.insert(digest), "{name} bit {bit}: a collision");
        }
    }
    assert_eq!(register_digest(&regs(0x1234, 0x5678)), base);
}

/// A sample mark at `rip` in user code (registers only), or in the kernel.
fn mark(ns: u64, rip: Option<u64>) -> crate::preempt::SampleMark {
    use crate::preempt::{state::UserState, AsyncPoint, MarkAt, SampleMark};
    let at = match rip {
        None => MarkAt::Kernel {
            rip: 0xffff_ffff_8100_0000,
        },
        Some(rip) => MarkAt::User(Box::new(AsyncPoint {
            state: UserState {
                cr3: 0x1000,
                rip,
                rflags: 0x202,
                gprs: [ns; 16],
                fs_base: 0,
                gs_base: 0,
                xstate: 0,
                words: vec![],
                pages: Default::default(),
                memory: 0,
            },
            stub: 0x7000_0000,
            code_pages: vec![(rip & !0xfff, 0x20_0000)],
            run_ns: ns,
        })),
    };
    SampleMark { ns, at }
}

/// Records reads with sample marks between them: two after the first
/// exit, before an asynchronous point, one after the second, one before
/// the end.
fn record_with_marks(dir: &std::path::Path) -> Box<crate::preempt::AsyncPoint> {
    let writer = TraceWriter::create(dir, &header(1000)).unwrap();
    let mut r = Recorder::new(writer, 1000);
    r.exit(port_in(0x40, 0x100, 7), &regs(0x100, 1), 0).unwrap();
    r.sample(mark(10, Some(0x40_1000))).unwrap();
    r.sample(mark(20, None)).unwrap();
    let crate::preempt::MarkAt::User(point) = mark(25, Some(0x40_1010)).at else {
        unreachable!()
    };
    r.async_point(*point.clone()).unwrap();
    r.interrupt(0x30).unwrap();
    r.exit(port_in(0x40, 0x104, 9), &regs(0x104, 2), 0).unwrap();
    r.sample(mark(30, Some(0x40_1020))).unwrap();
    r.exit(port_in(0x40, 0x108, 5), &regs(0x108, 3), 0).unwrap();
    r.sample(mark(40, None)).unwrap();
    r.finish(EndReason::CommandExited(0), 0).unwrap();
    point
}

#[test]
fn sample_marks_come_in_order_before_a_point_and_are_passed_by_at_an_exit() {
    let dir = temp_trace("marks");
    let point = record_with_marks(&dir);
    // Marks taken: found in their order, the point after them.
    let mut j = replayer(&dir);
    j.take_sample_marks();
    replay_read(&mut j, 0x40, 0x100, 1).unwrap();
    assert_eq!(j.interrupt().unwrap(), None);
    // Entry 0 is the exit: the first mark is the next entry not taken.
    assert_eq!(j.position().entry, 1);
    let Some(Sought::Mark(m)) = j.sought().unwrap() else {
        panic!("no mark")
    };
    assert_eq!(m, mark(10, Some(0x40_1000)));
    // Looked at again: the same, until done.
    assert!(matches!(j.sought().unwrap(), Some(Sought::Mark(m)) if m.ns == 10));
    j.sample_mark_done(true);
    assert_eq!(j.position().entry, 2);
    assert!(matches!(j.sought().unwrap(), Some(Sought::Mark(m)) if m.ns == 20));
    j.sample_mark_done(true);
    assert!(matches!(j.sought().unwrap(), Some(Sought::Point(p)) if p == point));
    j.async_point_reached().unwrap();
    assert_eq!(j.interrupt().unwrap(), Some(0x30));
    // The mark after the second exit is not found before the third: the
    // third exit passes it by.
    replay_read(&mut j, 0x40, 0x104, 2).unwrap();
    assert!(matches!(j.sought().unwrap(), Some(Sought::Mark(m)) if m.ns == 30));
    replay_read(&mut j, 0x40, 0x108, 3).unwrap();
    assert_eq!(j.sample_marks_missed(), 1);
    // A mark given up counts as missed too; the end follows it.
    assert!(matches!(j.sought().unwrap(), Some(Sought::Mark(m)) if m.ns == 40));
    j.sample_mark_done(false);
    assert_eq!(j.sample_marks_missed(), 2);
    assert_eq!(j.sought().unwrap().map(|_| ()), None);
    assert_eq!(j.end_reached().unwrap(), Some(EndReason::CommandExited(0)));
    j.end(&EndReason::CommandExited(0)).unwrap();

    // Marks not wanted: passed over, the point is next, every position
    // counts them.
    let mut k = replayer(&dir);
    replay_read(&mut k, 0x40, 0x100, 1).unwrap();
    assert!(matches!(k.sought().unwrap(), Some(Sought::Point(p)) if p == point));
    assert_eq!(k.position().entry, 3);
    k.async_point_reached().unwrap();
    assert_eq!(k.interrupt().unwrap(), Some(0x30));
    replay_read(&mut k, 0x40, 0x104, 2).unwrap();
    assert!(k.sought().unwrap().is_none());
    replay_read(&mut k, 0x40, 0x108, 3).unwrap();
    assert_eq!(k.end_reached().unwrap(), Some(EndReason::CommandExited(0)));
    k.end(&EndReason::CommandExited(0)).unwrap();
    assert_eq!(k.sample_marks_missed(), 0);

    // A checkpoint's position between the marks resumes at the second.
    let mut s = replayer(&dir);
    s.take_sample_marks();
    replay_read(&mut s, 0x40, 0x100, 1).unwrap();
    s.sought().unwrap();
    s.sample_mark_done(true);
    let at = s.position();
    let mut t = replayer(&dir);
    t.take_sample_marks();
    t.seek(&at).unwrap();
    assert!(matches!(t.sought().unwrap(), Some(Sought::Mark(m)) if m.ns == 20));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn clock_read(rip: u64, value: u64) -> Entry {
    Entry::RdMsr {
        index: MSR_INSIGHT_CLOCK,
        rip,
        value,
        fault: false,
    }
}

/// Replays one read of the guest's clock; returns the value it read.
fn replay_clock(j: &mut Replayer, rip: u64) -> u64 {
    let value = match j.read(&clock_read(0, 0)).unwrap() {
        Entry::RdMsr { value, .. } => value,
        other => panic!("no logged clock read: {other:?}"),
    };
    j.exit(clock_read(rip, value), &regs(rip, value)).unwrap();
    value
}

#[test]
fn events_are_timed_by_the_last_clock_read_or_user_mark_and_never_go_back() {
    let dir = temp_trace("event-times");
    let writer = TraceWriter::create(&dir, &header(1000)).unwrap();
    let mut r = Recorder::new(writer, 1000);
    r.exit(clock_read(0x100, 100), &regs(0x100, 100), 0)
        .unwrap();
    r.sample(mark(150, Some(0x40_1000))).unwrap();
    r.sample(mark(180, None)).unwrap();
    r.sample(mark(200, Some(0x40_1010))).unwrap();
    r.exit(port_in(0x40, 0x104, 9), &regs(0x104, 2), 0).unwrap();
    r.sample(mark(250, Some(0x40_1020))).unwrap();
    // A clock read earlier than the mark before it (a damaged trace).
    r.exit(clock_read(0x108, 240), &regs(0x108, 240), 0)
        .unwrap();
    r.exit(clock_read(0x10c, 300), &regs(0x10c, 300), 0)
        .unwrap();
    r.finish(EndReason::CommandExited(0), 0).unwrap();

    let mut j = replayer(&dir);
    j.take_sample_marks();
    assert_eq!(replay_clock(&mut j, 0x100), 100);
    assert_eq!((j.event_ns(), j.mark_time_pending()), (100, false));
    // A mark found in user code: later events are at least that late.
    assert!(matches!(j.sought().unwrap(), Some(Sought::Mark(m)) if m.ns == 150));
    j.mark_found();
    j.sample_mark_done(true);
    assert_eq!((j.event_ns(), j.mark_time_pending()), (150, true));
    // One in the kernel is taken where replay stands, not where the
    // recording was: it times nothing.
    assert!(matches!(j.sought().unwrap(), Some(Sought::Mark(m)) if m.ns == 180));
    j.sample_mark_done(true);
    assert_eq!(j.event_ns(), 150);
    j.sought().unwrap();
    j.mark_found();
    j.sample_mark_done(true);
    assert_eq!(j.event_ns(), 200);
    // Another exit, not a clock read: the mark's time stands.
    replay_read(&mut j, 0x40, 0x104, 2).unwrap();
    assert_eq!((j.event_ns(), j.position().guest_ns), (200, 100));
    j.sought().unwrap();
    j.mark_found();
    j.sample_mark_done(true);
    assert_eq!(j.event_ns(), 250);
    // An earlier clock reading does not take the time back; a later one
    // is the time, and no mark is pending.
    assert_eq!(replay_clock(&mut j, 0x108), 240);
    assert_eq!((j.event_ns(), j.mark_time_pending()), (250, true));
    assert_eq!(replay_clock(&mut j, 0x10c), 300);
    assert_eq!((j.event_ns(), j.mark_time_pending()), (300, false));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn exits_log_the_time_when_it_has_moved_on_and_replay_times_events_by_it() {
    let dir = temp_trace("exit-times");
    let writer = TraceWriter::create(&dir, &header(2)).unwrap();
    let mut r = Recorder::new(writer, 2);
    let grain = TIME_GRAIN_NS;
    r.exit(port_in(0x40, 0x100, 7), &regs(0x100, 1), grain - 1)
        .unwrap();
    // Past the grain, after the exit's registers digest.
    r.exit(port_in(0x40, 0x104, 8), &regs(0x104, 2), 3 * grain)
        .unwrap();
    r.exit(port_in(0x40, 0x108, 9), &regs(0x108, 3), 3 * grain + 1)
        .unwrap();
    // A clock read is a time of its own: no `Time` after it.
    r.exit(
        clock_read(0x10c, 5 * grain),
        &regs(0x10c, 5 * grain),
        5 * grain,
    )
    .unwrap();
    r.exit(port_in(0x40, 0x110, 10), &regs(0x110, 5), 6 * grain - 1)
        .unwrap();
    r.finish(EndReason::CommandExited(0), 0).unwrap();

    let mut reader: TraceReader<Entry> = TraceReader::open(&dir).unwrap();
    let mut kinds = Vec::new();
    while let Some(e) = reader.next_event().unwrap() {
        kinds.push(e.kind());
    }
    assert_eq!(
        kinds,
        [
            "In",
            "In",
            "Registers",
            "Time",
            "In",
            "RdMsr",
            "Registers",
            "In",
            "End"
        ]
    );

    let mut j = replayer(&dir);
    replay_read(&mut j, 0x40, 0x100, 1).unwrap();
    assert_eq!(j.event_ns(), 0);
    replay_read(&mut j, 0x40, 0x104, 2).unwrap();
    assert_eq!(j.event_ns(), 3 * grain);
    replay_read(&mut j, 0x40, 0x108, 3).unwrap();
    assert_eq!(j.event_ns(), 3 * grain);
    assert_eq!(replay_clock(&mut j, 0x10c), 5 * grain);
    replay_read(&mut j, 0x40, 0x110, 5).unwrap();
    assert_eq!(j.event_ns(), 5 * grain);
    assert!(j.end_reached().unwrap().is_some());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The MMIO write that notifies the host files' queue, as an exit.
fn notify(rip: u64) -> Entry {
    Entry::MmioWrite {
        addr: 0xd000_0650,
        size: 4,
        rip,
        value: 0,
    }
}

#[test]
fn host_file_replies_come_back_from_the_log_and_the_stored_file() {
    let dir = temp_trace("host-files");
    let file = b"the file's bytes, stored once".to_vec();
    let digest: [u8; 32] = {
        use sha2::Digest;
        sha2::Sha256::digest(&file).into()
    };
    // A getattr-like request answered by a message, and two reads of the
    // same file: one object.
    let (ask, read_a, read_b) = (
        b"\x0b\0\0\0\x18\x01\0request".to_vec(),
        b"\x0b\0\0\0\x74\x02\0read-a".to_vec(),
        b"\x0b\0\0\0\x74\x03\0read-b".to_vec(),
    );
    let writer = TraceWriter::create(&dir, &header(1)).unwrap();
    let mut r = Recorder::new(writer, 1);
    r.exit(notify(0x100), &regs(0x100, 0), 0).unwrap();
    r.host_files(output_digest(&ask), b"reply bytes").unwrap();
    r.host_file_read(output_digest(&read_a), &digest, &file, 4, 4)
        .unwrap();
    r.exit(notify(0x200), &regs(0x200, 0), 0).unwrap();
    r.host_file_read(output_digest(&read_b), &digest, &file, 11, 5)
        .unwrap();
    r.finish(EndReason::PowerOff, 0).unwrap();
    let objects = std::fs::read_dir(dir.join("objects")).unwrap().count();
    assert_eq!(objects, 1, "the file is stored once");

    let mut j = replayer(&dir);
    j.exit(notify(0x100), &regs(0x100, 0)).unwrap();
    assert_eq!(j.host_files(&ask).unwrap(), b"reply bytes");
    let reply = j.host_files(&read_a).unwrap();
    // Rread: size 15, type 117, the request's tag (2), count 4, data.
    assert_eq!(&reply[..11], b"\x0f\0\0\0\x75\x02\0\x04\0\0\0");
    assert_eq!(&reply[11..], b"file");
    // Another request than the recording's: a divergence at that exit.
    j.exit(notify(0x200), &regs(0x200, 0)).unwrap();
    match j.host_files(&read_a) {
        Err(JournalError::Diverged(d)) => assert_eq!(d.exit, 2),
        other => panic!("expected a divergence, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();

    // A killed recorder's log that ends before a request's reply: the
    // replay ends there, as an incomplete trace does.
    let writer = TraceWriter::create(&dir, &header(1)).unwrap();
    let mut r = Recorder::new(writer, 1);
    r.exit(notify(0x100), &regs(0x100, 0), 0).unwrap();
    r.host_files(output_digest(&ask), b"reply bytes").unwrap();
    r.abandon();
    let mut j = replayer(&dir);
    j.exit(notify(0x100), &regs(0x100, 0)).unwrap();
    assert_eq!(j.host_files(&ask).unwrap(), b"reply bytes");
    assert!(matches!(j.host_files(&read_a), Err(JournalError::LogEnded)));
    std::fs::remove_dir_all(&dir).unwrap();
}
