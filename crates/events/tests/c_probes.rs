//! The probe library as the guest runs it, parsed by the host's ABI
//! parser: `probes/insight-probes.c`, built unmodified with the guest
//! image's flags, preloaded into a small C program. Outside insight a
//! probe's int3 is a SIGTRAP; the program's handler copies the event the
//! probe points RAX at into a file, which `abi::parse` must read field by
//! field. A drift between `insight-events.h`, the library and `abi.rs`
//! fails here, not only end to end.
//!
//! The library raises events only where the guest kernel forwards them
//! (`insight.platform` on the kernel command line): the program runs in a
//! mount namespace of its own where a file of the test's temporary
//! directory is bind-mounted over /proc/cmdline. Needs root and gcc.

use std::path::{Path, PathBuf};
use std::process::Command;

use events::abi::{self, Kind, Payload, RawEvent};

const HARNESS: &str = r#"
#define _GNU_SOURCE
#include <fcntl.h>
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static int out = -1;

/* A probe's int3: RAX holds the event, EBX the notify code. */
static void on_trap(int sig, siginfo_t *info, void *context)
{
	(void)sig;
	(void)info;
	ucontext_t *uc = context;
	const unsigned char *e = (const unsigned char *)uc->uc_mcontext.gregs[REG_RAX];
	uint32_t notify = (uint32_t)uc->uc_mcontext.gregs[REG_RBX];
	if (notify != 0x54564e45u || e == NULL)
		_exit(3);
	uint32_t size;
	__builtin_memcpy(&size, e + 8, 4);
	if (size > 4096)
		_exit(4);
	if (write(out, e, size) != (ssize_t)size)
		_exit(5);
}

static pthread_mutex_t shared;

static void *worker(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&shared);
	pthread_mutex_unlock(&shared);
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 2)
		return 2;
	out = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0600);
	struct sigaction sa = { .sa_sigaction = on_trap, .sa_flags = SA_SIGINFO };
	if (out < 0 || sigaction(SIGTRAP, &sa, NULL) != 0)
		return 1;
	pthread_mutex_init(&shared, NULL);
	pthread_mutex_lock(&shared);
	/* Held already: EBUSY, a result the event must carry. */
	if (pthread_mutex_trylock(&shared) == 0)
		return 6;
	pthread_mutex_unlock(&shared);
	pthread_t t;
	pthread_create(&t, NULL, worker, NULL);
	pthread_join(t, NULL);
	/* A condition variable's wait that times out at once, a signal, a
	 * read lock and a write lock refused under it, a semaphore posted,
	 * taken and found empty, a barrier of one. */
	static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
	static pthread_rwlock_t rw = PTHREAD_RWLOCK_INITIALIZER;
	static pthread_barrier_t barrier;
	static sem_t sem;
	struct timespec past = { 0, 0 };
	pthread_mutex_lock(&shared);
	if (pthread_cond_timedwait(&cond, &shared, &past) != ETIMEDOUT)
		return 8;
	pthread_mutex_unlock(&shared);
	pthread_cond_signal(&cond);
	pthread_rwlock_rdlock(&rw);
	if (pthread_rwlock_trywrlock(&rw) == 0)
		return 9;
	pthread_rwlock_unlock(&rw);
	sem_init(&sem, 0, 0);
	sem_post(&sem);
	sem_wait(&sem);
	if (sem_trywait(&sem) == 0 || errno != EAGAIN)
		return 10;
	pthread_barrier_init(&barrier, NULL, 1);
	pthread_barrier_wait(&barrier);
	printf("%d %ld %lu %lu %lu %lu %lu %lu\n", getpid(), (long)syscall(SYS_gettid),
	       (unsigned long)(uintptr_t)&shared, (unsigned long)(uintptr_t)worker,
	       (unsigned long)(uintptr_t)&cond, (unsigned long)(uintptr_t)&rw,
	       (unsigned long)(uintptr_t)&sem, (unsigned long)(uintptr_t)&barrier);
	fflush(stdout);
	exit(7);
}
"#;

fn gcc(args: &[&std::ffi::OsStr]) {
    let status = Command::new("gcc")
        .args(args)
        .status()
        .expect("gcc is needed to build the probe library (tools/test installs it)");
    assert!(status.success(), "gcc {args:?} failed");
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("insight-c-probes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The events in `bytes`, one after the other, each as long as it says.
fn split_events(mut bytes: &[u8]) -> Vec<RawEvent> {
    let mut events = Vec::new();
    while !bytes.is_empty() {
        let size = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        let event = abi::parse(&bytes[..size], abi::PAGE)
            .unwrap_or_else(|e| panic!("event {} of the C library: {e}", events.len()));
        events.push(event);
        bytes = &bytes[size..];
    }
    events
}

#[test]
#[ignore = "needs root (a mount namespace) and gcc: tools/test runs it"]
fn the_c_probe_library_writes_what_the_parser_reads() {
    let dir = scratch();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let lib = dir.join("libinsight-probes.so");
    // The guest image's flags (tools/build-guest).
    gcc(&[
        "-O2".as_ref(),
        "-Wall".as_ref(),
        "-Wextra".as_ref(),
        "-Werror".as_ref(),
        "-fPIC".as_ref(),
        "-shared".as_ref(),
        "-fvisibility=hidden".as_ref(),
        "-o".as_ref(),
        lib.as_os_str(),
        repo.join("probes/insight-probes.c").as_os_str(),
        "-ldl".as_ref(),
    ]);
    let src = dir.join("harness.c");
    std::fs::write(&src, HARNESS).unwrap();
    let prog = dir.join("harness");
    gcc(&[
        "-O2".as_ref(),
        "-Wall".as_ref(),
        "-pthread".as_ref(),
        "-o".as_ref(),
        prog.as_os_str(),
        src.as_os_str(),
    ]);
    let cmdline = dir.join("cmdline");
    std::fs::write(&cmdline, "console=ttyS0 insight.platform quiet\n").unwrap();
    let events_file = dir.join("events.bin");
    let script = format!(
        "mount --bind '{}' /proc/cmdline && exec '{}' '{}'",
        cmdline.display(),
        prog.display(),
        events_file.display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        // int3, never the event port: outside insight it is the host's.
        .env("INSIGHT_PROBES", "int3")
        .env("LD_PRELOAD", &lib)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<u64> = stdout
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let [pid, lwpid, mutex, worker, cond, rw, sem, barrier] = ids[..] else {
        panic!("{stdout}")
    };
    let events = split_events(&std::fs::read(&events_file).unwrap());

    // Every event names the program and its process.
    for e in &events {
        assert_eq!((e.pid as u64, e.comm.as_str()), (pid, "harness"), "{e:?}");
    }
    // The loaded objects first, by absolute path, the program among them.
    let symbols: Vec<&str> = events
        .iter()
        .take_while(|e| e.kind == Kind::Symbol)
        .map(|e| match &e.payload {
            Payload::Symbol { path, .. } => path.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(
        symbols.iter().any(|p| p.ends_with("/harness")),
        "{symbols:?}"
    );
    assert!(symbols.iter().any(|p| p.contains("libc.so")), "{symbols:?}");
    // Then the main thread's calls, in order, on the one mutex.
    let main: Vec<(Kind, Option<i32>)> = events
        .iter()
        .skip(symbols.len())
        .filter(|e| e.lwpid as u64 == lwpid)
        .map(|e| match e.payload {
            Payload::Lock { lock, result, .. } => {
                assert_eq!(lock, mutex, "{e:?}");
                (e.kind, Some(result))
            }
            Payload::Sync {
                object,
                caller,
                mutex: m,
                result,
                flags,
            } => {
                let expected = match e.kind {
                    Kind::CondWait | Kind::CondWaitRet | Kind::CondSignal => cond,
                    Kind::RwLock | Kind::RwLockRet | Kind::RwUnlock => rw,
                    Kind::SemWait | Kind::SemWaitRet | Kind::SemPost => sem,
                    _ => barrier,
                };
                assert_eq!(object, expected, "{e:?}");
                assert!(caller != 0, "{e:?}");
                // Only a condition variable's wait names its mutex.
                let waits = matches!(e.kind, Kind::CondWait | Kind::CondWaitRet);
                assert_eq!(m, if waits { mutex } else { 0 }, "{e:?}");
                (e.kind, Some(result * 100 + flags as i32))
            }
            _ => (e.kind, None),
        })
        .collect();
    let kinds: Vec<Kind> = main.iter().map(|k| k.0).collect();
    assert_eq!(
        kinds,
        [
            Kind::LockInit,
            Kind::Lock,
            Kind::LockRet,
            Kind::TryLock,
            Kind::TryLockRet,
            Kind::Unlock,
            Kind::ThreadSpawn,
            Kind::ThreadJoin,
            Kind::Lock,
            Kind::LockRet,
            Kind::CondWait,
            Kind::CondWaitRet,
            Kind::Unlock,
            Kind::CondSignal,
            Kind::RwLock,
            Kind::RwLockRet,
            Kind::RwLock,
            Kind::RwLockRet,
            Kind::RwUnlock,
            Kind::SemPost,
            Kind::SemWait,
            Kind::SemWaitRet,
            Kind::SemWait,
            Kind::SemWaitRet,
            Kind::Barrier,
            Kind::BarrierRet,
            Kind::Exit,
        ],
        "{main:?}"
    );
    // The calls' results: 0, but EBUSY for the trylock of a held mutex.
    let results: Vec<Option<i32>> = main.iter().map(|k| k.1).collect();
    assert_eq!(
        results[..6],
        [Some(0), Some(0), Some(0), Some(0), Some(16), Some(0)]
    );
    // The synchronisation calls' results (x100) and flags (timed 4, write
    // 1, try 2): the wait timed out (ETIMEDOUT, 110), the write lock was
    // refused (EBUSY, 16), the trywait failed (-1), the barrier's one
    // thread is its serial thread (-1).
    assert_eq!(
        results[10..26],
        [
            Some(4),
            Some(11004),
            Some(0),
            Some(0),
            Some(0),
            Some(0),
            Some(3),
            Some(1603),
            Some(0),
            Some(0),
            Some(0),
            Some(0),
            Some(2),
            Some(-98),
            Some(0),
            Some(-100)
        ]
    );
    // The creator says what it starts, from where, as it calls
    // pthread_create.
    let spawn = events
        .iter()
        .position(|e| e.kind == Kind::ThreadSpawn)
        .expect("no THREADSPAWN");
    match events[spawn].payload {
        Payload::ThreadSpawn {
            start_routine,
            caller,
        } => assert!(
            start_routine == worker && caller != 0,
            "{:?}",
            events[spawn]
        ),
        ref other => panic!("{other:?}"),
    }
    // Its count of events raised, THREADSPAWN included, is the one the
    // new thread's THREADCREATE names.
    let raised_by_main = events[..=spawn]
        .iter()
        .filter(|e| e.lwpid as u64 == lwpid)
        .count() as u32;
    // The worker: created by the main thread at its start routine, then
    // its lock calls; joined by its id; the exit status.
    let worker_lwpid = events
        .iter()
        .find_map(|e| match e.payload {
            Payload::ThreadCreate {
                parent_lwpid,
                start_routine,
                creator_events,
            } => {
                assert_eq!(parent_lwpid as u64, lwpid, "{e:?}");
                assert_eq!(start_routine, worker, "{e:?}");
                assert_eq!(creator_events, raised_by_main, "{e:?}");
                Some(e.lwpid)
            }
            _ => None,
        })
        .expect("no THREADCREATE");
    assert_ne!(worker_lwpid as u64, lwpid);
    let worker_kinds: Vec<Kind> = events
        .iter()
        .filter(|e| e.lwpid == worker_lwpid)
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        worker_kinds,
        [Kind::ThreadCreate, Kind::Lock, Kind::LockRet, Kind::Unlock],
        "{events:?}"
    );
    assert!(events.iter().any(|e| e.payload
        == Payload::ThreadJoin {
            joined_lwpid: worker_lwpid
        }));
    assert_eq!(
        events.last().map(|e| &e.payload),
        Some(&Payload::Exit { status: 7 })
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
