//! Host system calls the standard library and the KVM crates do not wrap.
//! Every `unsafe` block outside `kvm_ext` lives here.

use std::io;

/// `perf_event_attr` as of its first ABI version (64 bytes); the kernel
/// accepts any published size.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttrV0 {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

/// The host's time stamp counter: what a guest's user-mode RDTSC returns
/// on hosts that cannot trap it (`insight host-check`).
pub fn host_tsc() -> u64 {
    // SAFETY: RDTSC reads a counter; it touches no memory. Every x86-64
    // CPU has it, and the host kernel lets user mode run it (the guest's
    // user code does, natively).
    unsafe { core::arch::x86_64::_rdtsc() }
}

const PERF_TYPE_HARDWARE: u32 = 0;
const PERF_COUNT_HW_BRANCH_INSTRUCTIONS: u64 = 4;
const FLAG_DISABLED: u64 = 1 << 0;
const FLAG_EXCLUDE_KERNEL: u64 = 1 << 5;
const FLAG_EXCLUDE_HV: u64 = 1 << 6;

/// Whether this host can count retired branches with a hardware counter
/// (the prerequisite of the branch clock). Opens and closes a counter on
/// the calling thread.
pub fn hardware_branch_counter() -> io::Result<()> {
    let attr = PerfEventAttrV0 {
        kind: PERF_TYPE_HARDWARE,
        size: std::mem::size_of::<PerfEventAttrV0>() as u32,
        config: PERF_COUNT_HW_BRANCH_INSTRUCTIONS,
        flags: FLAG_DISABLED | FLAG_EXCLUDE_KERNEL | FLAG_EXCLUDE_HV,
        ..Default::default()
    };
    // SAFETY: perf_event_open reads `attr.size` bytes of a live, fully
    // initialized struct; the other arguments are plain integers.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttrV0,
            0 as libc::pid_t,
            -1 as libc::c_int,
            -1 as libc::c_int,
            0 as libc::c_ulong,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody
    // else; closing it once is correct.
    unsafe { libc::close(fd as libc::c_int) };
    Ok(())
}

/// The host terminal on standard input, switched to raw input (no line
/// editing, echo or signal keys; output processing untouched so the
/// guest's "\n" still starts a new line). Restores the old mode on drop.
pub struct RawStdin {
    saved: libc::termios,
}

impl RawStdin {
    /// `None` when standard input is not a terminal.
    pub fn enter() -> Option<Self> {
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(libc::STDIN_FILENO) } != 1 {
            return None;
        }
        // SAFETY: termios is plain data; tcgetattr fills it and we check
        // the result before using it.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid, writable termios.
        if unsafe { libc::tcgetattr(libc::STDIN_FILENO, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        raw.c_iflag &= !(libc::ICRNL | libc::IXON | libc::INLCR | libc::IGNCR);
        raw.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG | libc::IEXTEN);
        raw.c_cc[libc::VMIN] = 1;
        raw.c_cc[libc::VTIME] = 0;
        // SAFETY: `raw` is a valid termios derived from the current one.
        if unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(RawStdin { saved })
    }
}

impl Drop for RawStdin {
    fn drop(&mut self) {
        // SAFETY: restores the termios read in `enter` on the same fd.
        unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &self.saved) };
    }
}

/// The size (columns, rows) of the terminal on standard input; `None`
/// if it is not a terminal or says 0x0.
pub fn stdin_terminal_size() -> Option<(u16, u16)> {
    // SAFETY: winsize is plain data.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one winsize into `size`, which is valid
    // and writable; the result is checked before `size` is used.
    if unsafe { libc::ioctl(libc::STDIN_FILENO, libc::TIOCGWINSZ, &mut size) } != 0 {
        return None;
    }
    (size.ws_col > 0 && size.ws_row > 0).then_some((size.ws_col, size.ws_row))
}

/// The host CPUs the calling thread may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most `size_of::<cpu_set_t>()` bytes
    // into `set`, which is that large.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE, within the set.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Keeps the calling thread on host CPU `cpu`.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: an all-zero cpu_set_t is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the kernel reads `size_of::<cpu_set_t>()` bytes of `set`.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The host CPU the calling thread runs on now.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu takes nothing and returns a number or -1.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

/// The host CPU time the calling thread has had (user and system,
/// a vCPU thread's time in the guest included), if the host tells.
pub fn thread_cpu_time() -> Option<std::time::Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given, which
    // lives on this frame.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return None;
    }
    Some(std::time::Duration::new(
        u64::try_from(ts.tv_sec).ok()?,
        u32::try_from(ts.tv_nsec).ok()?,
    ))
}

/// A thread of this process that can be sent a signal (to make its
/// `KVM_RUN` return): the thread that ran [`ThreadHandle::current`].
#[derive(Clone, Copy, Debug)]
pub struct ThreadHandle(libc::pthread_t);

impl ThreadHandle {
    /// The calling thread.
    pub fn current() -> Self {
        // SAFETY: pthread_self takes nothing and cannot fail.
        ThreadHandle(unsafe { libc::pthread_self() })
    }

    /// Sends `signal` to the thread. The caller guarantees the thread has
    /// not exited (the kicker that holds the handle is stopped and joined
    /// before the thread it kicks returns).
    pub fn signal(&self, signal: libc::c_int) -> io::Result<()> {
        // SAFETY: the thread is alive (see above); pthread_kill only
        // queues a signal, whose handler does nothing.
        let rc = unsafe { libc::pthread_kill(self.0, signal) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
}

/// Has this process ignore SIGINT from now on: the terminal's interrupt
/// key is for another program of the session (a debugger run as a child).
pub fn ignore_sigint() {
    // SAFETY: sets the disposition of SIGINT to SIG_IGN; no handler runs.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
}

/// Has the kernel kill this process (SIGKILL) when the thread that
/// started it ends, and checks that its starter, process `parent`, has
/// not already ended: a worker process never outlives the command it
/// works for, however that command ends.
pub fn end_with_parent(parent: u32) -> io::Result<()> {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and no memory.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // Checked after the request: an end before it is seen here.
    if std::os::unix::process::parent_id() != parent {
        return Err(io::Error::other(format!(
            "the process that started this one (pid {parent}) has ended"
        )));
    }
    Ok(())
}

/// Set by SIGINT or SIGTERM once [`catch_interrupts`] is in force.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::Release);
}

/// From now on SIGINT and SIGTERM do not end this process but set a flag
/// [`interrupted`] reads: for a command that must stop its workers and
/// say how far it got before it ends.
pub fn catch_interrupts() -> io::Result<()> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        vmm_sys_util::signal::register_signal_handler(signal, on_interrupt)
            .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    }
    Ok(())
}

/// SIGINT and SIGTERM end this process again, as they do by default.
pub fn release_interrupts() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: sets the signal's disposition back to SIG_DFL; no
        // handler of ours runs after.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
}

/// Whether SIGINT or SIGTERM came since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::Acquire)
}
