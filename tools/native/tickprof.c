/*
 * A program's own profile, taken inside the guest by its own kernel: a
 * preloaded library that asks for SIGVTALRM every 10 ms of the process's
 * user time (setitimer ITIMER_VIRTUAL) and notes the user-mode instruction
 * each signal interrupted. The guest kernel accounts user time by its tick
 * (CONFIG_TICK_CPU_ACCOUNTING, 100 Hz), so each signal comes from a tick
 * that found the process in user mode, and the instruction is the one that
 * tick interrupted: a sample at a random point of the process's user time,
 * taken by the guest itself. Use it in an unrecorded `insight run`: a
 * recording delivers a tick that falls due in user code at the next exit,
 * within 2 ms, which for a program making system calls that often is
 * always one, and its kernel then sees it in user mode at no tick at all.
 * Its own bias: a tick that falls due while the guest kernel runs with
 * interrupts off is taken as the kernel returns to user mode, and charged
 * to the instruction it returns to (after a system call; at an instruction
 * that faulted).
 *
 *   gcc -O2 -shared -fPIC -o tickprof.so tickprof.c
 *   LD_PRELOAD=./tickprof.so PROG ...
 *
 * When the process exits (exit(), or the return from main), it writes to
 * the stderr it started with (a copy: coreutils close stderr at exit),
 * one line each, in as few writes as it can:
 *
 *   tickprof PID COMM map START END OFFSET PATH   (its executable mappings)
 *   tickprof PID COMM pc ADDRESS COUNT            (samples at each address)
 *   tickprof PID COMM end SAMPLES LOST            (LOST: over the buffer)
 *
 * tools/bench profile turns these into a profile beside insight's. Static
 * binaries (busybox) ignore LD_PRELOAD and are not sampled. The library
 * keeps SIGVTALRM for itself: a program's sigaction() or signal() for it
 * is noted and answered as if made, not made (GNU sort catches it to
 * clean up and die); a program's own ITIMER_VIRTUAL would replace the
 * library's. A process that execs or is killed by a signal writes
 * nothing; a forked child is not sampled (interval timers are not
 * inherited) and writes its maps and no samples. Only the C library's
 * sigaction() and signal() are interposed: bsd_signal() or sigset() could
 * still take the signal.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <ucontext.h>
#include <unistd.h>

#define MAX_SAMPLES 65536

static unsigned long samples[MAX_SAMPLES];
static unsigned long taken; /* signals handled, in any thread */
static char out[65536];
static size_t used;
static int err_fd = -1; /* a copy of stderr: programs close theirs at exit */

static void on_tick(int sig, siginfo_t *info, void *context)
{
	const ucontext_t *uc = context;
	unsigned long i = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);

	(void)sig;
	(void)info;
	if (i < MAX_SAMPLES)
		samples[i] = (unsigned long)uc->uc_mcontext.gregs[REG_RIP];
}

typedef int sigaction_fn(int, const struct sigaction *, struct sigaction *);

static sigaction_fn *real_sigaction;
static struct sigaction programs; /* what the program asked SIGVTALRM to do */

int sigaction(int sig, const struct sigaction *act, struct sigaction *old)
{
	if (!real_sigaction)
		real_sigaction = (sigaction_fn *)dlsym(RTLD_NEXT, "sigaction");
	if (!real_sigaction)
		return -1;
	if (sig != SIGVTALRM)
		return real_sigaction(sig, act, old);
	if (old)
		*old = programs;
	if (act)
		programs = *act;
	return 0;
}

typedef sighandler_t signal_fn(int, sighandler_t);

sighandler_t signal(int sig, sighandler_t handler)
{
	static signal_fn *real_signal;
	sighandler_t old = programs.sa_handler;

	if (sig != SIGVTALRM) {
		if (!real_signal)
			real_signal = (signal_fn *)dlsym(RTLD_NEXT, "signal");
		return real_signal ? real_signal(sig, handler) : SIG_ERR;
	}
	memset(&programs, 0, sizeof(programs));
	programs.sa_handler = handler;
	programs.sa_flags = SA_RESTART;
	sigemptyset(&programs.sa_mask);
	return old;
}

/* A forked child starts with none of its parent's samples. */
static void forget_samples(void)
{
	__atomic_store_n(&taken, 0, __ATOMIC_RELAXED);
}

__attribute__((constructor)) static void tickprof_start(void)
{
	struct sigaction sa;
	struct itimerval every = { { 0, 10000 }, { 0, 10000 } };

	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = on_tick;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	sigemptyset(&sa.sa_mask);
	/* No copy (stderr closed at the start): nothing is written, rather
	 * than into whatever file the program opens as its fd 2. */
	err_fd = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 100);
	programs.sa_handler = SIG_DFL;
	pthread_atfork(NULL, NULL, forget_samples);
	real_sigaction = (sigaction_fn *)dlsym(RTLD_NEXT, "sigaction");
	if (!real_sigaction || real_sigaction(SIGVTALRM, &sa, NULL) != 0 ||
	    setitimer(ITIMER_VIRTUAL, &every, NULL) != 0)
		perror("tickprof: cannot start its timer");
}

/* Writes out what emit() gathered. */
static void flush(void)
{
	size_t done = 0;

	while (err_fd >= 0 && done < used) {
		ssize_t n = write(err_fd, out + done, used - done);

		if (n <= 0)
			break;
		done += (size_t)n;
	}
	used = 0;
}

/* Appends a line to out, writing out first when it would not fit. */
static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...)
{
	va_list ap;
	int n;

	for (;;) {
		va_start(ap, fmt);
		n = vsnprintf(out + used, sizeof(out) - used, fmt, ap);
		va_end(ap);
		if (n >= 0 && (size_t)n < sizeof(out) - used) {
			used += (size_t)n;
			return;
		}
		if (used == 0)
			return; /* one line longer than the buffer: left out */
		flush();
	}
}

static int by_address(const void *a, const void *b)
{
	unsigned long x = *(const unsigned long *)a, y = *(const unsigned long *)b;

	return x < y ? -1 : x > y;
}

__attribute__((destructor)) static void tickprof_stop(void)
{
	struct itimerval off = { { 0, 0 }, { 0, 0 } };
	char comm[64] = "?", line[4352];
	FILE *f;
	long pid = (long)getpid();
	unsigned long all;
	int i, j, n;

	setitimer(ITIMER_VIRTUAL, &off, NULL);
	all = __atomic_load_n(&taken, __ATOMIC_RELAXED);
	n = all < MAX_SAMPLES ? (int)all : MAX_SAMPLES;
	f = fopen("/proc/self/comm", "r");
	if (f) {
		if (fgets(comm, sizeof(comm), f))
			comm[strcspn(comm, "\n")] = 0;
		fclose(f);
	}
	f = fopen("/proc/self/maps", "r");
	if (f) {
		while (fgets(line, sizeof(line), f)) {
			unsigned long start, end, offset;
			char perms[8];
			int path = 0;

			if (sscanf(line, "%lx-%lx %7s %lx %*s %*s %n", &start, &end, perms, &offset,
				   &path) < 4 ||
			    perms[2] != 'x' || !path || line[path] != '/')
				continue;
			line[strcspn(line, "\n")] = 0;
			emit("tickprof %ld %s map %lx %lx %lx %s\n", pid, comm, start, end, offset,
			     line + path);
		}
		fclose(f);
	}
	qsort(samples, (size_t)n, sizeof(samples[0]), by_address);
	for (i = 0; i < n; i = j) {
		for (j = i; j < n && samples[j] == samples[i]; j++)
			;
		emit("tickprof %ld %s pc %lx %d\n", pid, comm, samples[i], j - i);
	}
	emit("tickprof %ld %s end %d %lu\n", pid, comm, n, all - (unsigned long)n);
	flush();
}
