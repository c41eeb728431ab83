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
            extra_initramfs: b"070701".to_vec(),
            net: None,
        },
        digest_interval: 64,
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
fn a_corrupt_frame_ends_the_stream_and_says_so() {
    let dir = scratch("corrupt");
    write(&dir, 5000);
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
        if round % 3 == 0 && len >= 8 {
            // Plausible lengths, garbage contents.
            bytes[..4].copy_from_slice(&((len - 8) as u32).to_le_bytes());
            bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        }
        std::fs::write(dir.join(EVENTS_FILE), &bytes).unwrap();
        let mut r = TraceReader::<Ev>::open(&dir).unwrap();
        let _ = all(&mut r);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
