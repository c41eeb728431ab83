//! Unwinds a real thread's stack, captured natively from a program built
//! with `-O2 -fomit-frame-pointer`, by the call-frame information of the
//! program and the C library, and checks the functions found.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use guestfiles::ElfSymbols;
use unwind::{AddressSpace, ObjectCfi, ProcessMemory, Processes, Regs};

struct Snapshot {
    regs: Regs,
    objects: Vec<(u64, String)>,
    stack: Vec<u8>,
}

impl ProcessMemory for Snapshot {
    fn read_u64(&mut self, addr: u64) -> Option<u64> {
        let at = usize::try_from(addr.checked_sub(self.regs.rsp)?).ok()?;
        let bytes = self.stack.get(at..at.checked_add(8)?)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("insight-unwind-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Builds and runs tests/snapshot.c; its snapshot and the program's path.
fn capture(dir: &Path) -> (Snapshot, PathBuf) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshot.c");
    let exe = dir.join("snapshot");
    let cc = Command::new("gcc")
        .args(["-O2", "-g", "-fomit-frame-pointer", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("gcc (the test builds a C program)");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = dir.join("snapshot.out");
    let run = Command::new(&exe).arg(&out).status().unwrap();
    assert!(run.success());
    let bytes = std::fs::read(&out).unwrap();
    let split = bytes.windows(7).position(|w| w == b"\nstack\n").unwrap();
    let text = String::from_utf8(bytes[..split].to_vec()).unwrap();
    let mut lines = text.lines();
    let regs: Vec<u64> = lines
        .next()
        .unwrap()
        .split(' ')
        .map(|v| v.parse().unwrap())
        .collect();
    let objects = lines
        .map(|l| {
            let (bias, path) = l.split_once(' ').unwrap();
            (bias.parse().unwrap(), path.to_owned())
        })
        .collect();
    let regs = Regs {
        rip: regs[0],
        rsp: regs[1],
        rbp: regs[2],
    };
    let stack = bytes[split + 7..].to_vec();
    (
        Snapshot {
            regs,
            objects,
            stack,
        },
        exe,
    )
}

/// The function of `exe` holding `addr` (an address of the program's).
fn function(exe: &[u8], addr: u64) -> Option<String> {
    let symbols = ElfSymbols::parse(exe).unwrap();
    symbols.function(addr).map(str::to_owned)
}

#[test]
fn a_thread_without_frame_pointers_unwinds_to_its_start() {
    let dir = scratch("walk");
    let (mut snap, exe) = capture(&dir);
    let mut space = AddressSpace::default();
    let mut files: HashMap<u64, (String, Vec<u8>)> = HashMap::new();
    for (bias, path) in snap.objects.clone() {
        // The program itself is named "" by dl_iterate_phdr; the vDSO
        // has no file.
        let path = if path.is_empty() {
            exe.display().to_string()
        } else {
            path
        };
        let Ok(data) = std::fs::read(&path) else {
            continue;
        };
        let cfi = ObjectCfi::parse(&data).expect("an ELF file");
        space.add(bias, Arc::new(cfi));
        files.insert(bias, (path, data));
    }
    let exe_bias = snap.objects.iter().find(|o| o.1.is_empty()).unwrap().0;
    let exe_data = std::fs::read(&exe).unwrap();
    let regs = snap.regs;
    let frames = space.unwind(&mut snap, regs, 64);
    let named: Vec<String> = frames
        .iter()
        .map(|&ra| {
            function(&exe_data, ra.wrapping_sub(exe_bias).wrapping_sub(1)).unwrap_or_default()
        })
        .collect();
    assert_eq!(
        function(&exe_data, regs.rip - exe_bias).as_deref(),
        Some("third")
    );
    // third was called by second, by first, by the thread routine...
    assert_eq!(&named[..3], ["second", "first", "routine"], "{frames:x?}");
    // ... which the C library's thread start called, itself called from
    // the clone system call's wrapper, where the walk ends: neither in
    // the program, both in the C library.
    let libc = files
        .iter()
        .find(|(_, (path, _))| path.contains("libc.so"))
        .map(|(bias, (_, data))| (*bias, data.len() as u64))
        .unwrap();
    let outer = &frames[3..];
    assert_eq!(outer.len(), 2, "start_thread and clone3: {frames:x?}");
    assert!(outer
        .iter()
        .all(|&ra| ra > libc.0 && ra < libc.0 + (64 << 20)));
    // Without the call-frame information the walk follows RBP, which
    // this program never set up as a frame pointer: nothing sensible.
    let mut bare = AddressSpace::default();
    let empty = ObjectCfi::parse(&strip_eh_frame(&exe_data)).unwrap();
    assert_eq!(empty.functions(), 0);
    bare.add(exe_bias, Arc::new(empty));
    let fp_frames = bare.unwind(&mut snap, regs, 64);
    assert_ne!(&fp_frames[..fp_frames.len().min(3)], &frames[..3]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn processes_read_each_file_once_and_start_over_after_an_exec() {
    let dir = scratch("processes");
    let (mut snap, exe) = capture(&dir);
    let exe_path = exe.display().to_string();
    let reads = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log = Arc::clone(&reads);
    let mut processes = Processes::new(Box::new(move |path: &str| {
        log.lock().unwrap().push(path.to_owned());
        std::fs::read(path).ok()
    }));
    let objects: Vec<(u64, String)> = snap
        .objects
        .iter()
        .map(|(bias, path)| {
            let path = if path.is_empty() { &exe_path } else { path };
            (*bias, path.clone())
        })
        .collect();
    // Two processes map the same files (a fork): each is read once.
    for pid in [10, 11] {
        for (bias, path) in &objects {
            processes.mapped(pid, *bias, path);
        }
    }
    let read = reads.lock().unwrap().len();
    assert_eq!(read, objects.len(), "{:?}", reads.lock().unwrap());
    let regs = snap.regs;
    let whole = processes.unwind(10, &mut snap, regs, 64);
    assert_eq!(whole.len(), 5, "{whole:x?}");
    assert_eq!(processes.unwind(11, &mut snap, regs, 64), whole);
    // A process nothing is known of is walked by frame pointer.
    assert_ne!(processes.unwind(12, &mut snap, regs, 64), whole);
    // Process 10 raised an event, then announced objects again: it has
    // run another program, and only the new objects count. A missing
    // file is remembered as such.
    processes.raised(10);
    processes.mapped(10, 0x7000_0000, "/nonexistent/lib.so");
    assert_ne!(processes.unwind(10, &mut snap, regs, 64), whole);
    assert_eq!(processes.unwind(11, &mut snap, regs, 64), whole);
    processes.mapped(11, 0x7000_0000, "/nonexistent/lib.so");
    assert_eq!(reads.lock().unwrap().len(), read + 1);
    let on_disk = objects
        .iter()
        .filter(|(_, path)| Path::new(path).is_file())
        .count();
    assert_eq!(processes.files(), (objects.len() + 1, on_disk));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `elf` with its `.eh_frame` section renamed, so that it is not found.
fn strip_eh_frame(elf: &[u8]) -> Vec<u8> {
    let mut bytes = elf.to_vec();
    let at = bytes
        .windows(10)
        .position(|w| w == b".eh_frame\0")
        .expect("a section name table");
    bytes[at + 1] = b'x';
    bytes
}
