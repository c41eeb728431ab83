//! Round trips, damage and limits of the trace files.

use super::*;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
enum Ev {
    PortIn { ordinal: u64, port: u16, value: u32 },
    Packet(PayloadRef),
}

fn header() -> Header {
    Header {
        clock: ClockKind::Exit,
        created_unix_secs: 1_700_000_000,
        guest_cpuid: vec![(1, 0, 0x800f11, 0, 0x7ed8320b, 0x178bfbff)],
        kvm_caps: vec![(1, 1)],
        user_rdtsc_traps: false,
        host_apic_id: Some(1),
        config: "memory_mib = 128\n".into(),
        images: vec![ImageDigest {
            role: "kernel".into(),
            path: "/x/vmlinux".into(),
            digest: "abc".into(),
        }],
        boot: BootParams {
            cmdline: "console=ttyS0".into(),
            memory_mib: 128,
            rng_seed: vec![7; 32],
            archive: b"070701".to_vec(),
            snapshot: None,
            wall_clock: None,
            net: None,
        },
        digest_interval: 64,
        sample_period_ns: 0,
        chaos: None,
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("insight-trace-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn all(r: &mut TraceReader<Ev>) -> Vec<Ev> {
    let mut v = Vec::new();
    while let Some(frame) = r.next_frame().unwrap() {
        v.extend(frame);
    }
    v
}

fn write(dir: &Path, n: u64) -> Vec<Ev> {
    let mut w = TraceWriter::create(dir, &header()).unwrap();
    let mut evs = Vec::new();
    for i in 0..n {
        let e = if i % 1000 == 7 {
            Ev::Packet(w.payload(format!("packet {i}").as_bytes()).unwrap())
        } else {
            Ev::PortIn {
                ordinal: i,
                port: 0x40,
                value: (i * 7) as u32,
            }
        };
        evs.push(e.clone());
        w.push(e).unwrap();
    }
    let s = w.finish().unwrap();
    assert_eq!(s.events, n);
    evs
}

#[test]
fn round_trip_with_payloads_and_completion() {
    let dir = scratch("rt");
    let evs = write(&dir, 10_000);
    let mut r = TraceReader::<Ev>::open(&dir).unwrap();
    assert_eq!(r.header, header());
    assert_eq!(r.complete.map(|s| (s.events, s.frames)), Some((10_000, 3)));
    let got = all(&mut r);
    assert_eq!(got, evs);
    assert_eq!(r.tail_problem, None);
    // One event at a time, across the three frames.
    let mut r = TraceReader::<Ev>::open(&dir).unwrap();
    let mut one_by_one = Vec::new();
    while let Some(e) = r.next_event().unwrap() {
        one_by_one.push(e);
    }
    assert_eq!(one_by_one, evs);
    let Ev::Packet(p) = &got[1007] else {
        panic!("{:?}", got[1007])
    };
    assert_eq!(r.payload(*p).unwrap(), b"packet 1007");
    // Frames are compressed: smaller than the events' encoding alone.
    let size = std::fs::metadata(dir.join(EVENTS_FILE)).unwrap().len() as usize;
    let raw = encode(&evs, "events").unwrap().len();
    assert!(size < raw, "{size} bytes compressed, {raw} raw");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_crashed_recording_reads_as_a_prefix() {
    let dir = scratch("crash");
    let mut w = TraceWriter::create(&dir, &header()).unwrap();
    for i in 0..5000 {
        w.push(Ev::PortIn {
            ordinal: i,
            port: 1,
            value: 2,
        })
        .unwrap();
    }
    w.flush().unwrap();
    drop(w); // no finish: as if killed
             // Tear the last frame.
    let events = dir.join(EVENTS_FILE);
    let len = std::fs::metadata(&events).unwrap().len();
    let f = OpenOptions::new().write(true).open(&events).unwrap();
    f.set_len(len - 10).unwrap();
    let mut r = TraceReader::<Ev>::open(&dir).unwrap();
    assert_eq!(r.complete, None);
    assert_eq!(all(&mut r).len(), FRAME_EVENTS);
    assert_eq!(r.tail_problem, Some(TailProblem::Truncated { frame: 1 }));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupt_last_frame_ends_an_unfinished_recording_and_says_so() {
    let dir = scratch("corrupt");
    write(&dir, 5000);
    std::fs::remove_file(dir.join(COMPLETE_FILE)).unwrap();
    let events = dir.join(EVENTS_FILE);
    let mut bytes = std::fs::read(&events).unwrap();
    let last = bytes.len() - 20;
    bytes[last] ^= 0x55;
    std::fs::write(&events, bytes).unwrap();
    let mut r = TraceReader::<Ev>::open(&dir).unwrap();
    assert_eq!(all(&mut r).len(), FRAME_EVENTS);
    assert!(matches!(
        r.tail_problem,
        Some(TailProblem::Corrupt { frame: 1, .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A trace's events, the payloads they reference, and how the log ended.
type Whole = (Vec<Ev>, Vec<Vec<u8>>, Option<TailProblem>);

/// Reads every event and payload; the first error found.
fn read_whole(dir: &Path) -> Result<Whole, TraceError> {
    let mut r = TraceReader::<Ev>::open(dir)?;
    let mut evs = Vec::new();
    while let Some(frame) = r.next_frame()? {
        evs.extend(frame);
    }
    let mut payloads = Vec::new();
    for e in &evs {
        if let Ev::Packet(p) = e {
            payloads.push(r.payload(*p)?);
        }
    }
    Ok((evs, payloads, r.tail_problem.clone()))
}

#[test]
fn damage_in_a_complete_trace_is_an_error_naming_the_frame() {
    let dir = scratch("damaged");
    write(&dir, 5000);
    let events = dir.join(EVENTS_FILE);
    let original = std::fs::read(&events).unwrap();
    // A flipped byte in the first of two frames.
    let mut bytes = original.clone();
    bytes[100] ^= 0x55;
    std::fs::write(&events, &bytes).unwrap();
    let err = read_whole(&dir).unwrap_err();
    assert!(err.is_damage(), "{err}");
    assert!(err.to_string().contains("frame 0 at byte 0"), "{err}");
    // Cut exactly after the first frame.
    let first_len = 16 + u32::from_le_bytes(original[..4].try_into().unwrap()) as usize;
    std::fs::write(&events, &original[..first_len]).unwrap();
    let err = read_whole(&dir).unwrap_err();
    assert!(
        err.is_damage() && err.to_string().contains("its completion summary says"),
        "{err}"
    );
    // Emptied.
    std::fs::write(&events, b"").unwrap();
    assert!(read_whole(&dir).unwrap_err().is_damage());
    // A frame appended after the end (the second one again).
    let mut bytes = original.clone();
    bytes.extend_from_slice(&original[first_len..]);
    std::fs::write(&events, &bytes).unwrap();
    assert!(read_whole(&dir).unwrap_err().is_damage());
    // The same frame duplicated in an unfinished recording is found by
    // where it says it starts.
    std::fs::remove_file(dir.join(COMPLETE_FILE)).unwrap();
    let mut bytes = original[..first_len].to_vec();
    bytes.extend_from_slice(&original[..first_len]);
    bytes.extend_from_slice(&original[first_len..]);
    std::fs::write(&events, &bytes).unwrap();
    let err = read_whole(&dir).unwrap_err();
    assert!(err.to_string().contains("starts at event 0"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn header_summary_and_payload_bytes_are_checksummed() {
    let dir = scratch("crc");
    write(&dir, 2000);
    for (file, at) in [(HEADER_FILE, 40), (COMPLETE_FILE, 5), (PAYLOADS_FILE, 3)] {
        let path = dir.join(file);
        let original = std::fs::read(&path).unwrap();
        let mut bytes = original.clone();
        bytes[at] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_whole(&dir).unwrap_err();
        assert!(err.is_damage(), "{file}: {err}");
        assert!(
            err.to_string().contains("checksum mismatch"),
            "{file}: {err}"
        );
        std::fs::write(&path, &original).unwrap();
    }
    assert_eq!(read_whole(&dir).unwrap().0.len(), 2000);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn untrusted_trace_files_are_refused_unless_regular_and_bounded() {
    let dir = scratch("special");
    write(&dir, 10);
    let header = dir.join(HEADER_FILE);
    std::fs::remove_file(&header).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &header).unwrap();
    let err = TraceReader::<Ev>::open(&dir).err().unwrap().to_string();
    assert!(
        err.contains("is a character device, not a regular file"),
        "{err}"
    );
    assert!(!is_trace(&dir));
    std::fs::remove_file(&header).unwrap();
    let big = std::fs::File::create(&header).unwrap();
    big.set_len(MAX_HEADER_BYTES + 1).unwrap();
    let err = TraceReader::<Ev>::open(&dir).err().unwrap().to_string();
    assert!(err.contains("more than the"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn foreign_and_future_traces_are_refused() {
    let dir = scratch("version");
    write(&dir, 1);
    assert!(is_trace(&dir));
    let files = [HEADER_FILE, EVENTS_FILE, PAYLOADS_FILE];
    let on_disk: u64 = files
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).unwrap().len())
        .sum();
    assert_eq!(stored_bytes(&dir), on_disk);
    let path = dir.join(HEADER_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&(TRACE_VERSION + 1).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = TraceReader::<Ev>::open(&dir).err().unwrap().to_string();
    assert!(
        err.contains(&format!("version {}", TRACE_VERSION + 1)),
        "{err}"
    );
    bytes[0] = b'X';
    std::fs::write(&path, &bytes).unwrap();
    let err = TraceReader::<Ev>::open(&dir).err().unwrap().to_string();
    assert!(err.contains("not an insight trace"), "{err}");
    assert!(!is_trace(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_writer_whose_directory_was_removed_writes_nothing_into_its_successor() {
    let dir = scratch("removed");
    let mut w = TraceWriter::create(&dir, &header()).unwrap();
    w.push(Ev::PortIn {
        ordinal: 1,
        port: 1,
        value: 2,
    })
    .unwrap();
    w.flush().unwrap();
    // Removed, and another recording takes the name.
    std::fs::remove_dir_all(&dir).unwrap();
    write(&dir, 10);
    let theirs = std::fs::read(dir.join(COMPLETE_FILE)).unwrap();
    let err = w.flush().unwrap_err();
    assert!(matches!(err, TraceError::Removed(_)), "{err}");
    let err = w.finish().unwrap_err();
    assert!(
        err.to_string().contains("was removed while it was written"),
        "{err}"
    );
    assert_eq!(std::fs::read(dir.join(COMPLETE_FILE)).unwrap(), theirs);
    assert_eq!(all(&mut TraceReader::<Ev>::open(&dir).unwrap()).len(), 10);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn writer_refuses_a_non_empty_directory() {
    let dir = scratch("nonempty");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("x"), b"x").unwrap();
    let err = TraceWriter::<Ev>::create(&dir, &header())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not empty"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn arbitrary_event_files_never_panic() {
    let dir = scratch("fuzz");
    write(&dir, 10);
    let summary = std::fs::read(dir.join(COMPLETE_FILE)).unwrap();
    let (mut truncated, mut corrupt) = (0, 0);
    let mut x = 0x1234_5678_9abc_def1u64;
    for round in 0..300 {
        let len = (x % 300) as usize;
        let mut bytes = Vec::with_capacity(len);
        for _ in 0..len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bytes.push(x as u8);
        }
        if round % 3 == 0 && len >= 16 {
            // Plausible lengths, garbage contents.
            bytes[..4].copy_from_slice(&((len - 16) as u32).to_le_bytes());
            bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
            bytes[8..16].copy_from_slice(&0u64.to_le_bytes());
        }
        std::fs::write(dir.join(EVENTS_FILE), &bytes).unwrap();
        // In a complete trace, garbage is damage, never a crash's end.
        std::fs::write(dir.join(COMPLETE_FILE), &summary).unwrap();
        match read_whole(&dir) {
            Err(e) => assert!(e.is_damage(), "{len} bytes: {e}"),
            Ok(whole) => panic!("garbage in a complete trace read as {whole:?}"),
        }
        // In an unfinished recording it is read, not refused by its size.
        std::fs::remove_file(dir.join(COMPLETE_FILE)).unwrap();
        // Garbage never reads as events: it ends the stream, reported.
        match read_whole(&dir) {
            Ok((evs, _, problem)) => {
                assert!(evs.is_empty(), "garbage read as {evs:?}");
                assert_eq!(problem.is_some(), len > 0, "{len} bytes: {problem:?}");
                // Shorter than a frame head, or than the (bounded) length
                // its head declares: the frame is cut short; whole but
                // garbage: it is corrupt. Either way it is the first frame.
                let le = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap()) as usize;
                let cut = match bytes.get(..FRAME_HEAD) {
                    None => true,
                    Some(head) => {
                        let (n, count) = (le(&head[..4]), le(&head[4..8]));
                        n <= MAX_FRAME_BYTES && count != 0 && FRAME_HEAD + n > len
                    }
                };
                match problem {
                    None => {}
                    Some(TailProblem::Truncated { frame: 0 }) if cut => truncated += 1,
                    Some(TailProblem::Corrupt { frame: 0, .. }) if !cut => corrupt += 1,
                    Some(p) => panic!("{len} bytes ({bytes:x?}) reported as {p:?}"),
                }
            }
            Err(e) => panic!("garbage at the end of an unfinished recording: {e}"),
        }
    }
    // Both kinds came up, so both checks above ran.
    assert!(
        truncated > 0 && corrupt > 0,
        "{truncated} cut, {corrupt} corrupt"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The largest single allocation made by each thread, so that a test can
/// bound what a damaged trace makes the reader allocate.
mod largest_allocation {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    struct Tracking;

    thread_local! {
        static LARGEST: Cell<usize> = const { Cell::new(0) };
    }

    // SAFETY: every call is forwarded to the system allocator unchanged;
    // the thread-local cell is const-initialized and never allocates.
    unsafe impl GlobalAlloc for Tracking {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: the caller's contract is passed on as it is.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: as above.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            note(new_size);
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    fn note(size: usize) {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    }

    #[global_allocator]
    static TRACKING: Tracking = Tracking;

    /// Resets this thread's record; returns what it was.
    pub fn take() -> usize {
        LARGEST.with(|l| l.replace(0))
    }
}

/// A trace of small frames, its files' bytes, and where its frames start.
struct Specimen {
    files: Vec<(&'static str, Vec<u8>)>,
    frame_starts: Vec<usize>,
    events: Vec<Ev>,
    payloads: Vec<Vec<u8>>,
}

fn specimen(dir: &Path) -> Specimen {
    let mut w = TraceWriter::create(dir, &header()).unwrap();
    let mut events = Vec::new();
    let mut payloads = Vec::new();
    let mut frame_starts = Vec::new();
    for i in 0..300u64 {
        if i % 50 == 0 {
            w.flush().unwrap();
            frame_starts.push(w.summary().event_bytes as usize);
        }
        let e = if i % 40 == 3 {
            let bytes = format!("payload {i}").into_bytes();
            let p = Ev::Packet(w.payload(&bytes).unwrap());
            payloads.push(bytes);
            p
        } else {
            Ev::PortIn {
                ordinal: i,
                port: (i % 7) as u16,
                value: (i * 31) as u32,
            }
        };
        events.push(e.clone());
        w.push(e).unwrap();
    }
    w.finish().unwrap();
    let files = [HEADER_FILE, EVENTS_FILE, PAYLOADS_FILE, COMPLETE_FILE]
        .into_iter()
        .map(|f| (f, std::fs::read(dir.join(f)).unwrap()))
        .collect();
    Specimen {
        files,
        frame_starts,
        events,
        payloads,
    }
}

#[test]
fn randomly_damaged_traces_are_read_faithfully_or_refused() {
    const CASES: u64 = 10_000;
    let dir = scratch("damage-fuzz");
    let s = specimen(&dir);
    let ends: Vec<usize> = s
        .frame_starts
        .iter()
        .skip(1)
        .copied()
        .chain([s.files[1].1.len()])
        .collect();
    let frames: Vec<(usize, usize)> = s.frame_starts.iter().copied().zip(ends).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n.max(1) as u64) as usize
    };
    let (mut refused, mut unchanged) = (0, 0);
    for case in 0..CASES {
        let mut files = s.files.clone();
        let how = case % 6;
        let which = if how == 0 { rand(4) } else { 1 };
        let bytes = &mut files[which].1;
        let what = match how {
            // A flipped bit anywhere in any file.
            0 => {
                let at = rand(bytes.len());
                bytes[at] ^= 1 << rand(8);
                format!("bit flip at {at} of {}", files[which].0)
            }
            // Cut at a frame boundary or inside a frame.
            1 | 2 => {
                let at = if how == 1 {
                    frames[rand(frames.len())].0
                } else {
                    rand(bytes.len())
                };
                bytes.truncate(at);
                format!("log cut at {at}")
            }
            // A frame duplicated, or two frames swapped.
            3 => {
                let (a, b) = frames[rand(frames.len())];
                let copy = bytes[a..b].to_vec();
                bytes.splice(b..b, copy);
                format!("frame at {a} duplicated")
            }
            4 => {
                let i = rand(frames.len() - 1);
                let ((a, b), (_, c)) = (frames[i], frames[i + 1]);
                let mut swapped = bytes[b..c].to_vec();
                swapped.extend_from_slice(&bytes[a..b]);
                bytes.splice(a..c, swapped);
                format!("frames {i} and {} swapped", i + 1)
            }
            // A huge or zero length or count in a frame head.
            _ => {
                let (a, _) = frames[rand(frames.len())];
                let field = a + 4 * rand(2);
                let value = [0u32, u32::MAX, 1 << 26, 1 << 30][rand(4)];
                bytes[field..field + 4].copy_from_slice(&value.to_le_bytes());
                format!("head field at {field} set to {value}")
            }
        };
        for (name, bytes) in &files {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        largest_allocation::take();
        let result = read_whole(&dir);
        let largest = largest_allocation::take();
        assert!(
            largest <= MAX_FRAME_BYTES,
            "{what}: an allocation of {largest} bytes"
        );
        match result {
            Err(e) => {
                // Refused as damage, or as not a trace of this version
                // (a flip in the magic or the version number).
                assert!(
                    e.is_damage()
                        || matches!(
                            e,
                            TraceError::BadMagic(_) | TraceError::UnsupportedVersion { .. }
                        ),
                    "{what}: {e}"
                );
                refused += 1;
            }
            Ok((events, payloads, problem)) => {
                // Not refused: what is read must be what was written (a
                // flip in compressed bytes that decode to the same events,
                // once in these cases).
                assert_eq!(problem, None, "{what}");
                assert!(
                    events == s.events && payloads == s.payloads,
                    "{what}: read as changed"
                );
                unchanged += 1;
            }
        }
    }
    assert!(
        unchanged <= CASES / 1000,
        "{unchanged} of {CASES} damaged traces read as they were written"
    );
    assert_eq!(refused + unchanged, CASES);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn seeking_to_an_event_reads_on_from_it_to_the_checked_end() {
    let d = scratch("seek");
    let evs = write(&d, 3 * FRAME_EVENTS as u64 + 10);
    for at in [
        0,
        1,
        FRAME_EVENTS as u64 - 1,
        FRAME_EVENTS as u64,
        2 * FRAME_EVENTS as u64 + 9,
        evs.len() as u64 - 1,
    ] {
        let mut r = TraceReader::<Ev>::open(&d).unwrap();
        // Where the reader was before does not matter.
        r.next_event().unwrap();
        r.seek_event(at).unwrap();
        let mut rest = Vec::new();
        while let Some(e) = r.next_event().unwrap() {
            rest.push(e);
        }
        assert_eq!(rest, evs[at as usize..], "from event {at}");
    }
    let mut r = TraceReader::<Ev>::open(&d).unwrap();
    let e = r.seek_event(evs.len() as u64).unwrap_err();
    assert!(e.to_string().contains("before event"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}
