//! The probe ABI, version 1 (docs/events.md): the bytes a probe or the
//! guest kernel leaves in an event buffer, parsed and validated.
//!
//! Everything here is guest-controlled. A malformed buffer is an
//! [`AbiError`] naming what is wrong, never a panic.

/// EBX of a probe's int3.
pub const EVENTNOTIFY: u32 = 0x5456_4e45;
/// First field of every event: "INSE".
pub const MAGIC: u32 = 0x4553_4e49;
pub const VERSION: u16 = 1;
/// Bytes of the generic header.
pub const HEADER_LEN: usize = 48;
/// An event buffer never crosses a page; this is the most the host reads.
pub const PAGE: usize = 4096;

/// Event kinds, as numbered by the ABI. `ContextSwitch` (read from the
/// guest kernel's switch ring) and `Sample` (the host's own) never come
/// from a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u16)]
pub enum Kind {
    Lock = 1,
    LockRet = 2,
    TryLock = 3,
    TryLockRet = 4,
    TimedLock = 5,
    TimedLockRet = 6,
    Unlock = 7,
    LockInit = 8,
    ThreadCreate = 9,
    Fork = 10,
    Exit = 11,
    Symbol = 12,
    ContextSwitch = 13,
    Sample = 14,
    ThreadJoin = 15,
    ThreadSpawn = 16,
    /// A load or store of a process traced at replay (the host's).
    MemAccess = 17,
    /// An allocation function was called: the accesses until the thread's
    /// next ALLOC or FREE are the allocator's own.
    HeapCall = 18,
    /// An allocation function returned a block.
    Alloc = 19,
    /// A block was freed (or unmapped, or moved by realloc).
    Free = 20,
    /// A probe given at replay (`replay --probe`) was hit at a function's
    /// entry (the host's; docs/probes.md).
    Probe = 21,
    /// The function of such a probe returned.
    ProbeReturn = 22,
    /// pthread_cond_wait, timedwait or clockwait was called: the mutex is
    /// released while the thread waits.
    CondWait = 23,
    /// The wait returned: the mutex is held again.
    CondWaitRet = 24,
    CondSignal = 25,
    CondBroadcast = 26,
    /// pthread_barrier_wait was called.
    Barrier = 27,
    BarrierRet = 28,
    /// A read or write lock of a read-write lock was asked for.
    RwLock = 29,
    RwLockRet = 30,
    RwUnlock = 31,
    /// sem_wait, sem_trywait, sem_timedwait or sem_clockwait was called.
    SemWait = 32,
    SemWaitRet = 33,
    SemPost = 34,
}

impl Kind {
    pub const ALL: [Kind; 34] = [
        Kind::Lock,
        Kind::LockRet,
        Kind::TryLock,
        Kind::TryLockRet,
        Kind::TimedLock,
        Kind::TimedLockRet,
        Kind::Unlock,
        Kind::LockInit,
        Kind::ThreadCreate,
        Kind::Fork,
        Kind::Exit,
        Kind::Symbol,
        Kind::ContextSwitch,
        Kind::Sample,
        Kind::ThreadJoin,
        Kind::ThreadSpawn,
        Kind::MemAccess,
        Kind::HeapCall,
        Kind::Alloc,
        Kind::Free,
        Kind::Probe,
        Kind::ProbeReturn,
        Kind::CondWait,
        Kind::CondWaitRet,
        Kind::CondSignal,
        Kind::CondBroadcast,
        Kind::Barrier,
        Kind::BarrierRet,
        Kind::RwLock,
        Kind::RwLockRet,
        Kind::RwUnlock,
        Kind::SemWait,
        Kind::SemWaitRet,
        Kind::SemPost,
    ];

    pub fn from_u16(v: u16) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u16 == v)
    }

    /// The paper's name of the event.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Lock => "LOCK",
            Kind::LockRet => "LOCK_RET",
            Kind::TryLock => "TRYLOCK",
            Kind::TryLockRet => "TRYLOCK_RET",
            Kind::TimedLock => "TIMEDLOCK",
            Kind::TimedLockRet => "TIMEDLOCK_RET",
            Kind::Unlock => "UNLOCK",
            Kind::LockInit => "LOCKINIT",
            Kind::ThreadCreate => "THREADCREATE",
            Kind::Fork => "FORK",
            Kind::Exit => "EXIT",
            Kind::Symbol => "SYMBOL",
            Kind::ContextSwitch => "CONTEXTSWITCH",
            Kind::Sample => "SAMPLE",
            Kind::ThreadJoin => "THREADJOIN",
            Kind::ThreadSpawn => "THREADSPAWN",
            Kind::MemAccess => "MEMACCESS",
            Kind::HeapCall => "HEAPCALL",
            Kind::Alloc => "ALLOC",
            Kind::Free => "FREE",
            Kind::Probe => "PROBE",
            Kind::ProbeReturn => "PROBE_RET",
            Kind::CondWait => "CONDWAIT",
            Kind::CondWaitRet => "CONDWAIT_RET",
            Kind::CondSignal => "CONDSIGNAL",
            Kind::CondBroadcast => "CONDBROADCAST",
            Kind::Barrier => "BARRIER",
            Kind::BarrierRet => "BARRIER_RET",
            Kind::RwLock => "RWLOCK",
            Kind::RwLockRet => "RWLOCK_RET",
            Kind::RwUnlock => "RWUNLOCK",
            Kind::SemWait => "SEMWAIT",
            Kind::SemWaitRet => "SEMWAIT_RET",
            Kind::SemPost => "SEMPOST",
        }
    }

    pub fn is_lock(self) -> bool {
        (Kind::Lock as u16..=Kind::LockInit as u16).contains(&(self as u16))
    }

    /// CONDWAIT .. SEMPOST: synchronisation other than a mutex's own
    /// calls (`Payload::Sync`).
    pub fn is_sync(self) -> bool {
        (Kind::CondWait as u16..=Kind::SemPost as u16).contains(&(self as u16))
    }

    /// Events that keep their caller's whole stack at replay: the calls
    /// that ask for or give up a lock or wait (a request's return shares
    /// its request's), and a lock's init (whose callers name the lock).
    pub fn keeps_stack(self) -> bool {
        matches!(
            self,
            Kind::Lock
                | Kind::LockInit
                | Kind::TryLock
                | Kind::TimedLock
                | Kind::Unlock
                | Kind::CondWait
                | Kind::Barrier
                | Kind::RwLock
                | Kind::RwUnlock
                | Kind::SemWait
        )
    }

    /// HEAPCALL, ALLOC and FREE: raised through the heap gate, collected
    /// only by replays that ask for them.
    pub fn is_heap(self) -> bool {
        matches!(self, Kind::HeapCall | Kind::Alloc | Kind::Free)
    }
}

/// The allocation function a heap event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum HeapFunction {
    Malloc = 1,
    Calloc = 2,
    Realloc = 3,
    Free = 4,
    Mmap = 5,
    Munmap = 6,
    /// posix_memalign, aligned_alloc and memalign.
    Memalign = 7,
}

impl HeapFunction {
    const ALL: [HeapFunction; 7] = [
        HeapFunction::Malloc,
        HeapFunction::Calloc,
        HeapFunction::Realloc,
        HeapFunction::Free,
        HeapFunction::Mmap,
        HeapFunction::Munmap,
        HeapFunction::Memalign,
    ];

    pub fn from_u32(v: u32) -> Option<HeapFunction> {
        HeapFunction::ALL.into_iter().find(|f| *f as u32 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            HeapFunction::Malloc => "malloc",
            HeapFunction::Calloc => "calloc",
            HeapFunction::Realloc => "realloc",
            HeapFunction::Free => "free",
            HeapFunction::Mmap => "mmap",
            HeapFunction::Munmap => "munmap",
            HeapFunction::Memalign => "memalign",
        }
    }

    /// The value of a heap event in the database: the size plus 2^56
    /// times the function (sizes stay below 2^56 on x86-64).
    pub fn value(self, size: u64) -> i64 {
        (size.min((1 << 56) - 1) | (u64::from(self as u8) << 56)) as i64
    }

    /// The function and size a heap event's value says, if it says one.
    pub fn from_value(value: i64) -> Option<(HeapFunction, u64)> {
        let v = value as u64;
        let f = HeapFunction::from_u32((v >> 56) as u32)?;
        Some((f, v & ((1 << 56) - 1)))
    }
}

/// How a synchronisation call asks: the `flags` of `Payload::Sync`.
pub struct SyncFlags;

impl SyncFlags {
    /// RWLOCK: a write lock (else a read lock).
    pub const WRITE: u32 = 1;
    /// The call never waits: a trylock or trywait.
    pub const TRY: u32 = 2;
    /// The call gives up at a deadline.
    pub const TIMED: u32 = 4;
}

/// Where a SAMPLE found its task: the event's `value`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SampleMode {
    /// Running user code at the sample's RIP.
    User = 0,
    /// In the guest kernel.
    Kernel = 1,
    /// In user mode at RIP, but between the guest kernel (or the
    /// hypervisor) and that instruction: just back from a system call or
    /// an exit to the hypervisor, or about to restart an instruction after
    /// a fault (RFLAGS.RF set). On hosts that interpret the guest kernel
    /// these moments last long enough to be sampled; the time is the
    /// kernel's, and RIP and the stack name the user code it served.
    KernelBoundary = 2,
}

impl SampleMode {
    pub fn from_value(value: Option<i64>) -> Option<SampleMode> {
        match value? {
            0 => Some(SampleMode::User),
            1 => Some(SampleMode::Kernel),
            2 => Some(SampleMode::KernelBoundary),
            _ => None,
        }
    }
}

/// How a traced instruction used memory: the access of a MEMACCESS event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum MemAccess {
    Load = 1,
    Store = 2,
    /// Read and written by the same instruction (`add [rax], 1`).
    Modify = 3,
}

impl MemAccess {
    /// The letter Valgrind's lackey uses: L, S or M.
    pub fn letter(self) -> char {
        match self {
            MemAccess::Load => 'L',
            MemAccess::Store => 'S',
            MemAccess::Modify => 'M',
        }
    }

    /// A MEMACCESS event's value for an access of `size` bytes: the size
    /// plus 2^32 times the access, plus 2^40 if it was to the accessing
    /// thread's own stack.
    pub fn value(self, size: u32, on_stack: bool) -> i64 {
        i64::from(size) | (i64::from(self as u8) << 32) | (i64::from(on_stack) << 40)
    }

    /// Whether a MEMACCESS event's value says the access was to the
    /// thread's own stack.
    pub fn on_stack(value: i64) -> bool {
        value >> 40 == 1
    }

    /// The access and size a MEMACCESS event's value says, if it says one.
    pub fn from_value(value: i64) -> Option<(MemAccess, u32)> {
        if value >> 41 != 0 {
            return None;
        }
        let access = match (value >> 32) & 0xff {
            1 => MemAccess::Load,
            2 => MemAccess::Store,
            3 => MemAccess::Modify,
            _ => return None,
        };
        Some((access, (value & 0xffff_ffff) as u32))
    }
}

/// Who raised the event: the guest kernel reports probe or kernel with
/// the exit; SAMPLE and MEMACCESS events are the host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Source {
    /// A probe's int3, forwarded by the kernel.
    Probe = 0,
    /// The guest kernel itself.
    Kernel = 1,
    /// The hypervisor (SAMPLE, MEMACCESS).
    Host = 2,
}

impl Source {
    pub fn from_u8(v: u8) -> Option<Source> {
        [Source::Probe, Source::Kernel, Source::Host]
            .into_iter()
            .find(|s| *s as u8 == v)
    }
}

/// The event-specific part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload {
    /// LOCK .. LOCKINIT: the mutex, the return address into its caller,
    /// and for the *_RET events and LOCKINIT the call's result.
    Lock {
        lock: u64,
        caller: u64,
        result: i32,
    },
    /// Raised in the new thread; `creator_events`: how many events the
    /// creator had raised when it called pthread_create.
    ThreadCreate {
        parent_lwpid: u32,
        creator_events: u32,
        start_routine: u64,
    },
    /// Raised in the creator as it calls pthread_create: the new thread's
    /// start routine and the return address into the caller.
    ThreadSpawn {
        start_routine: u64,
        caller: u64,
    },
    /// pthread_join returned: the joined thread.
    ThreadJoin {
        joined_lwpid: u32,
    },
    Fork {
        parent_pid: u32,
    },
    Exit {
        status: i32,
    },
    Symbol {
        base: u64,
        path: String,
    },
    /// CONDWAIT .. SEMPOST (probes/insight-events.h, struct
    /// insight_sync_payload): the condition variable, barrier, read-write
    /// lock or semaphore; the mutex a condition variable's wait releases
    /// and takes again (else 0); the *_RET events' result; how the call
    /// asks (`SyncFlags`).
    Sync {
        object: u64,
        caller: u64,
        mutex: u64,
        result: i32,
        flags: u32,
    },
    /// HEAPCALL, ALLOC, FREE (probes/insight-events.h,
    /// struct insight_heap_payload).
    Heap {
        addr: u64,
        size: u64,
        caller: u64,
        function: HeapFunction,
    },
}

/// A parsed event. `pid`/`lwpid`/`comm` are what the buffer says; the
/// host trusts the kernel's identification of the caller instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawEvent {
    pub kind: Kind,
    pub pid: u32,
    pub lwpid: u32,
    pub comm: String,
    pub payload: Payload,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AbiError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("ABI version {0}, this insight reads version {VERSION}")]
    Version(u16),
    #[error("unknown event kind {0}")]
    UnknownKind(u16),
    #[error("event kind {0} cannot come from a guest buffer")]
    HostKind(u16),
    #[error("declared size {declared} is outside {min}..={max} bytes")]
    Size {
        declared: u32,
        min: usize,
        max: usize,
    },
    #[error("SYMBOL path is not UTF-8 or not absolute")]
    BadPath,
    #[error("unknown allocation function {0} in a heap event")]
    BadHeapFunction(u32),
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    (u64::from(u32_at(b, at + 4)) << 32) | u64::from(u32_at(b, at))
}

/// A NUL-padded name of at most 16 bytes, lossily decoded.
fn comm_at(b: &[u8], at: usize) -> String {
    let raw = &b[at..at + 16];
    let end = raw.iter().position(|&c| c == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// Bytes the payload of `kind` takes (at least, for SYMBOL).
fn payload_len(kind: Kind) -> usize {
    match kind {
        k if k.is_lock() => 24,
        Kind::ThreadCreate | Kind::ThreadSpawn => 16,
        Kind::Fork | Kind::Exit | Kind::ThreadJoin => 8,
        Kind::Symbol => 16,
        Kind::HeapCall | Kind::Alloc | Kind::Free => 32,
        k if k.is_sync() => 32,
        _ => 0,
    }
}

/// The size field of the header in `head` (at least 12 bytes), so that a
/// reader can fetch exactly the event: `None` if `head` is too short.
pub fn declared_size(head: &[u8]) -> Option<u32> {
    (head.len() >= 12).then(|| u32_at(head, 8))
}

/// Parses the event at the start of `buf`. `room` is how many bytes the
/// buffer may span before the page ends; the event must fit in it.
pub fn parse(buf: &[u8], room: usize) -> Result<RawEvent, AbiError> {
    if buf.len() < HEADER_LEN {
        return Err(AbiError::Size {
            declared: buf.len() as u32,
            min: HEADER_LEN,
            max: room.min(PAGE),
        });
    }
    let magic = u32_at(buf, 0);
    if magic != MAGIC {
        return Err(AbiError::BadMagic(magic));
    }
    let version = u16_at(buf, 4);
    if version != VERSION {
        return Err(AbiError::Version(version));
    }
    let raw_kind = u16_at(buf, 6);
    let kind = Kind::from_u16(raw_kind).ok_or(AbiError::UnknownKind(raw_kind))?;
    if matches!(
        kind,
        Kind::Sample | Kind::ContextSwitch | Kind::MemAccess | Kind::Probe | Kind::ProbeReturn
    ) {
        return Err(AbiError::HostKind(raw_kind));
    }
    let size = u32_at(buf, 8);
    let min = HEADER_LEN + payload_len(kind);
    let max = room.min(PAGE).min(buf.len());
    if (size as usize) < min || size as usize > max {
        return Err(AbiError::Size {
            declared: size,
            min,
            max,
        });
    }
    let p = HEADER_LEN;
    let payload = match kind {
        k if k.is_lock() => Payload::Lock {
            lock: u64_at(buf, p),
            caller: u64_at(buf, p + 8),
            result: u32_at(buf, p + 16) as i32,
        },
        Kind::ThreadCreate => Payload::ThreadCreate {
            parent_lwpid: u32_at(buf, p),
            creator_events: u32_at(buf, p + 4),
            start_routine: u64_at(buf, p + 8),
        },
        Kind::ThreadSpawn => Payload::ThreadSpawn {
            start_routine: u64_at(buf, p),
            caller: u64_at(buf, p + 8),
        },
        Kind::ThreadJoin => Payload::ThreadJoin {
            joined_lwpid: u32_at(buf, p),
        },
        Kind::Fork => Payload::Fork {
            parent_pid: u32_at(buf, p),
        },
        Kind::Exit => Payload::Exit {
            status: u32_at(buf, p) as i32,
        },
        k if k.is_sync() => Payload::Sync {
            object: u64_at(buf, p),
            caller: u64_at(buf, p + 8),
            mutex: u64_at(buf, p + 16),
            result: u32_at(buf, p + 24) as i32,
            flags: u32_at(buf, p + 28),
        },
        Kind::HeapCall | Kind::Alloc | Kind::Free => {
            let raw = u32_at(buf, p + 24);
            Payload::Heap {
                addr: u64_at(buf, p),
                size: u64_at(buf, p + 8),
                caller: u64_at(buf, p + 16),
                function: HeapFunction::from_u32(raw).ok_or(AbiError::BadHeapFunction(raw))?,
            }
        }
        _ => {
            let len = u32_at(buf, p + 8) as usize;
            let start = p + 16;
            if start + len > size as usize {
                return Err(AbiError::Size {
                    declared: size,
                    min: start + len,
                    max,
                });
            }
            let path =
                std::str::from_utf8(&buf[start..start + len]).map_err(|_| AbiError::BadPath)?;
            if !path.starts_with('/') {
                return Err(AbiError::BadPath);
            }
            Payload::Symbol {
                base: u64_at(buf, p),
                path: path.to_owned(),
            }
        }
    };
    Ok(RawEvent {
        kind,
        pid: u32_at(buf, 12),
        lwpid: u32_at(buf, 16),
        comm: comm_at(buf, 32),
        payload,
    })
}

/// Builds the bytes of an event as a probe would (tests, fuzzing, tools).
pub fn encode(kind: u16, pid: u32, lwpid: u32, comm: &str, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_LEN + payload.len());
    b.extend_from_slice(&MAGIC.to_le_bytes());
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(&((HEADER_LEN + payload.len()) as u32).to_le_bytes());
    b.extend_from_slice(&pid.to_le_bytes());
    b.extend_from_slice(&lwpid.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    let mut name = [0u8; 16];
    let n = comm.len().min(15);
    name[..n].copy_from_slice(&comm.as_bytes()[..n]);
    b.extend_from_slice(&name);
    b.extend_from_slice(payload);
    b
}

/// The payload bytes of a synchronisation event (CONDWAIT .. SEMPOST).
pub fn sync_payload(object: u64, caller: u64, mutex: u64, result: i32, flags: u32) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    p.extend_from_slice(&object.to_le_bytes());
    p.extend_from_slice(&caller.to_le_bytes());
    p.extend_from_slice(&mutex.to_le_bytes());
    p.extend_from_slice(&result.to_le_bytes());
    p.extend_from_slice(&flags.to_le_bytes());
    p
}

/// The payload bytes of a heap event.
pub fn heap_payload(addr: u64, size: u64, caller: u64, function: HeapFunction) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    p.extend_from_slice(&addr.to_le_bytes());
    p.extend_from_slice(&size.to_le_bytes());
    p.extend_from_slice(&caller.to_le_bytes());
    p.extend_from_slice(&(function as u32).to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p
}

/// The payload bytes of a lock event.
pub fn lock_payload(lock: u64, caller: u64, result: i32) -> Vec<u8> {
    let mut p = Vec::with_capacity(24);
    p.extend_from_slice(&lock.to_le_bytes());
    p.extend_from_slice(&caller.to_le_bytes());
    p.extend_from_slice(&result.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_a_probe_writes() {
        let b = encode(
            Kind::LockRet as u16,
            7,
            9,
            "syn_cont",
            &lock_payload(0x5000, 0x4010, 0),
        );
        let e = parse(&b, PAGE).unwrap();
        assert_eq!(e.kind, Kind::LockRet);
        assert_eq!((e.pid, e.lwpid, e.comm.as_str()), (7, 9, "syn_cont"));
        assert_eq!(
            e.payload,
            Payload::Lock {
                lock: 0x5000,
                caller: 0x4010,
                result: 0
            }
        );
    }

    #[test]
    fn thread_spawns_carry_the_start_routine_and_the_caller() {
        let mut p = 0x5555_0000_1234u64.to_le_bytes().to_vec();
        p.extend_from_slice(&0x5555_0000_4321u64.to_le_bytes());
        let b = encode(Kind::ThreadSpawn as u16, 3, 3, "main", &p);
        let e = parse(&b, PAGE).unwrap();
        assert_eq!(
            e.payload,
            Payload::ThreadSpawn {
                start_routine: 0x5555_0000_1234,
                caller: 0x5555_0000_4321
            }
        );
        assert_eq!(Kind::from_u16(16), Some(Kind::ThreadSpawn));
        assert!(matches!(
            parse(&b[..b.len() - 1], PAGE),
            Err(AbiError::Size { .. })
        ));
    }

    #[test]
    fn symbol_paths_are_bounded_and_absolute() {
        let mut p = 0x7f00_0000_0000u64.to_le_bytes().to_vec();
        p.extend_from_slice(&11u32.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(b"/lib/libc.so");
        let b = encode(Kind::Symbol as u16, 1, 1, "a", &p);
        let e = parse(&b, PAGE).unwrap();
        assert_eq!(
            e.payload,
            Payload::Symbol {
                base: 0x7f00_0000_0000,
                path: "/lib/libc.s".into()
            }
        );
        // A path length beyond the event.
        p[8..12].copy_from_slice(&200u32.to_le_bytes());
        let b = encode(Kind::Symbol as u16, 1, 1, "a", &p);
        assert!(matches!(parse(&b, PAGE), Err(AbiError::Size { .. })));
        // A relative path.
        p[8..12].copy_from_slice(&4u32.to_le_bytes());
        p[16] = b'x';
        let b = encode(Kind::Symbol as u16, 1, 1, "a", &p);
        assert_eq!(parse(&b, PAGE), Err(AbiError::BadPath));
    }

    #[test]
    fn malformed_buffers_are_errors() {
        let good = encode(Kind::Lock as u16, 1, 1, "a", &lock_payload(1, 2, 0));
        let mut b = good.clone();
        b[0] = 0;
        assert!(matches!(parse(&b, PAGE), Err(AbiError::BadMagic(_))));
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(parse(&b, PAGE), Err(AbiError::Version(2)));
        let mut b = good.clone();
        b[6] = 99;
        assert_eq!(parse(&b, PAGE), Err(AbiError::UnknownKind(99)));
        let mut b = good.clone();
        b[6] = Kind::Sample as u8;
        assert!(matches!(parse(&b, PAGE), Err(AbiError::HostKind(_))));
        // Too short for its kind, and larger than the page allows.
        let mut b = good.clone();
        b[8] = 50;
        assert!(matches!(parse(&b, PAGE), Err(AbiError::Size { .. })));
        assert!(matches!(parse(&good, 60), Err(AbiError::Size { .. })));
        assert!(matches!(
            parse(&good[..20], PAGE),
            Err(AbiError::Size { .. })
        ));
        // Context switches come from the switch ring, never a buffer.
        let b = encode(Kind::ContextSwitch as u16, 1, 1, "a", &[0; 48]);
        assert!(matches!(parse(&b, PAGE), Err(AbiError::HostKind(_))));
        // A MEMACCESS value says its access and size, or nothing.
        for access in [MemAccess::Load, MemAccess::Store, MemAccess::Modify] {
            assert_eq!(
                MemAccess::from_value(access.value(16, false)),
                Some((access, 16))
            );
            let stack = access.value(8, true);
            assert_eq!(MemAccess::from_value(stack), Some((access, 8)));
            assert!(MemAccess::on_stack(stack) && !MemAccess::on_stack(access.value(8, false)));
        }
        assert_eq!(MemAccess::from_value(4 | (9 << 32)), None);
        // Memory accesses are traced by the host, never raised.
        let b = encode(Kind::MemAccess as u16, 1, 1, "a", &[0; 48]);
        assert!(matches!(parse(&b, PAGE), Err(AbiError::HostKind(_))));
    }

    #[test]
    fn heap_events_carry_block_size_caller_and_function() {
        let p = heap_payload(0x4052a0, 64, 0x401156, HeapFunction::Calloc);
        let b = encode(Kind::Alloc as u16, 5, 5, "mem_access", &p);
        let e = parse(&b, PAGE).unwrap();
        assert_eq!(
            e.payload,
            Payload::Heap {
                addr: 0x4052a0,
                size: 64,
                caller: 0x401156,
                function: HeapFunction::Calloc
            }
        );
        assert!(Kind::Alloc.is_heap() && !Kind::Lock.is_heap());
        // A function the ABI does not number, and a short payload.
        let mut bad = p.clone();
        bad[24] = 99;
        let b = encode(Kind::Free as u16, 5, 5, "m", &bad);
        assert_eq!(parse(&b, PAGE), Err(AbiError::BadHeapFunction(99)));
        let b = encode(Kind::HeapCall as u16, 5, 5, "m", &p[..24]);
        assert!(matches!(parse(&b, PAGE), Err(AbiError::Size { .. })));
        // The database value: size and function, both back.
        for f in HeapFunction::ALL {
            assert_eq!(HeapFunction::from_value(f.value(4096)), Some((f, 4096)));
        }
        assert_eq!(HeapFunction::from_value(64), None);
    }

    #[test]
    fn no_input_panics() {
        // Every prefix and every single-byte corruption of valid events.
        let mut sym = 0u64.to_le_bytes().to_vec();
        sym.extend_from_slice(&3u32.to_le_bytes());
        sym.extend_from_slice(&[0; 4]);
        sym.extend_from_slice(b"/ab");
        let samples = [
            encode(Kind::Lock as u16, 1, 1, "a", &lock_payload(1, 2, 3)),
            encode(Kind::Symbol as u16, 1, 1, "a", &sym),
            encode(Kind::Exit as u16, 1, 1, "a", &[0xff; 8]),
        ];
        for s in &samples {
            assert!(parse(s, PAGE).is_ok());
            // A cut event is never read, whatever its size field says.
            for n in 0..s.len() {
                assert!(parse(&s[..n], PAGE).is_err(), "{n} bytes of {s:x?}");
            }
            for i in 0..s.len() {
                for v in [0u8, 1, 0x7f, 0xff] {
                    let mut b = s.clone();
                    b[i] = v;
                    for room in [0, 47, 48, 72, PAGE] {
                        let r = parse(&b, room);
                        // A changed magic or version is named as such.
                        if v != s[i] && i < 4 {
                            assert!(matches!(r, Err(AbiError::BadMagic(_))), "{r:?}");
                        }
                        if v != s[i] && (4..6).contains(&i) {
                            assert!(matches!(r, Err(AbiError::Version(_))), "{r:?}");
                        }
                        // What is read is what the bytes say, and lies
                        // within the room the event had.
                        if let Ok(e) = &r {
                            assert!(u32_at(&b, 8) as usize <= room.min(b.len()), "{e:?}");
                            assert_eq!(e.kind as u16, u16_at(&b, 6));
                            assert_eq!((e.pid, e.lwpid), (u32_at(&b, 12), u32_at(&b, 16)));
                        }
                    }
                }
            }
        }
    }
}
