/*
 * libinsight-probes.so: explicit events for insight, loaded with
 * LD_PRELOAD.
 *
 * Wraps pthread_mutex_lock/trylock/timedlock/unlock/init, the condition
 * variables' waits, signals and broadcasts, pthread_barrier_wait, the
 * read-write locks, the semaphores' waits and posts, pthread_create,
 * pthread_join, fork, exit, _exit and _Exit, and the allocation functions
 * (malloc, calloc, realloc, free, posix_memalign, aligned_alloc, memalign,
 * mmap, munmap), and raises an event around each call with
 * the probe ABI of insight-events.h: the event is written into a
 * page-aligned per-thread buffer, its address goes in RAX, the key
 * INSIGHT_EVENTNOTIFY in EBX, and int3 hands it to the insight guest
 * kernel, which forwards it to the hypervisor and returns without a
 * signal. Before a process's first event, SYMBOL events name its loaded
 * objects and their load bases.
 *
 * Under insight the notification goes through the probe gate instead
 * (docs/events.md, "The gate"): a call into a few bytes the hypervisor
 * keeps at the end of the [insight] code page the guest kernel maps into
 * every process. While recording the gate is a bare `ret`, so an event
 * costs no VM exit; at replay it stores RAX to a page that is not RAM,
 * and the hypervisor captures the event at that exit. The call changes
 * no register, no flag and no memory the program can read in either
 * mode (its return address goes below the red zone in both).
 *
 * The heap events (HEAPCALL, ALLOC, FREE) go through a gate of their own,
 * which leaves the guest only in replays that collect them (`insight
 * replay --heap-events`, `--trace-process`): a program that allocates a
 * million times costs other replays no exit for it. They are raised only
 * through a gate; INSIGHT_PROBES=noheap leaves them out.
 *
 * Without a gate (an older hypervisor), or with INSIGHT_PROBES=port or
 * int3, every event is a VM exit in every mode: an OUT to the event port
 * where the process may use it (ioperm succeeds: it runs as root), else
 * int3 through the guest kernel's exception path.
 *
 * Outside insight (no "insight.platform" on the kernel command line) the
 * wrappers only call the real functions: one predictable branch per call.
 * INSIGHT_PROBES=off disables them under insight too.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/auxv.h>
#include <string.h>
#include <sys/io.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "insight-events.h"

#define EXPORT __attribute__((visibility("default")))
#define PAGE 4096

static int (*real_lock)(pthread_mutex_t *);
static int (*real_trylock)(pthread_mutex_t *);
static int (*real_timedlock)(pthread_mutex_t *, const struct timespec *);
static int (*real_unlock)(pthread_mutex_t *);
static int (*real_init)(pthread_mutex_t *, const pthread_mutexattr_t *);
static int (*real_create)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
static int (*real_join)(pthread_t, void **);
static int (*real_cond_wait)(pthread_cond_t *, pthread_mutex_t *);
static int (*real_cond_timedwait)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
static int (*real_cond_clockwait)(pthread_cond_t *, pthread_mutex_t *, clockid_t,
				  const struct timespec *);
static int (*real_cond_signal)(pthread_cond_t *);
static int (*real_cond_broadcast)(pthread_cond_t *);
static int (*real_barrier_wait)(pthread_barrier_t *);
static int (*real_rdlock)(pthread_rwlock_t *);
static int (*real_wrlock)(pthread_rwlock_t *);
static int (*real_tryrdlock)(pthread_rwlock_t *);
static int (*real_trywrlock)(pthread_rwlock_t *);
static int (*real_timedrdlock)(pthread_rwlock_t *, const struct timespec *);
static int (*real_timedwrlock)(pthread_rwlock_t *, const struct timespec *);
static int (*real_clockrdlock)(pthread_rwlock_t *, clockid_t, const struct timespec *);
static int (*real_clockwrlock)(pthread_rwlock_t *, clockid_t, const struct timespec *);
static int (*real_rwunlock)(pthread_rwlock_t *);
static int (*real_sem_wait)(sem_t *);
static int (*real_sem_trywait)(sem_t *);
static int (*real_sem_timedwait)(sem_t *, const struct timespec *);
static int (*real_sem_clockwait)(sem_t *, clockid_t, const struct timespec *);
static int (*real_sem_post)(sem_t *);
static pid_t (*real_fork)(void);
static void (*real_exit)(int) __attribute__((noreturn));
static void (*real__exit)(int) __attribute__((noreturn));
static void (*real__Exit)(int) __attribute__((noreturn));
static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void (*real_free)(void *);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void *(*real_memalign)(size_t, size_t);
static void *(*real_mmap)(void *, size_t, int, int, int, off_t);
static int (*real_munmap)(void *, size_t);

/* Whether this kernel forwards EVENTNOTIFY: decided once, at load. */
static int active;
/* How events reach the hypervisor. */
static enum { NOTIFY_INT3, NOTIFY_PORT, NOTIFY_GATE } notify_by;
/* The probe gate's code, when notify_by is NOTIFY_GATE. */
static void *gate;
/* The heap gate's code: NULL when heap events are not raised. */
static void *heap_gate;
/* The process the SYMBOL events were raised for (fork makes a new one). */
static pid_t symbols_for;
static pid_t my_pid;
static int exit_raised;
static char comm[16];

/*
 * Per-thread state, in the static TLS block glibc gives a preloaded
 * library (initial-exec: no __tls_get_addr call per access). The event
 * buffer is there too, aligned so that an event never crosses a page: no
 * system call per thread for it, which the interpreted guest kernel makes
 * dear.
 */
#define TLS __thread __attribute__((tls_model("initial-exec")))
static TLS union {
	struct insight_event_header header;
	char bytes[PAGE];
} buffer __attribute__((aligned(PAGE)));
static TLS pid_t my_lwpid;

/*
 * The buffer page's last 8 bytes tell the gate how far up the thread's
 * stack it may copy at replay (docs/events.md, "The event ring"): an
 * address no frame of the thread lies above and up to which the stack is
 * mapped; 0 where unknown (the gate then copies to the end of the stack
 * pointer's page). Events never reach these bytes (paths are capped at
 * half a page). call_gate sets them at every event, from the thread's
 * stack [stack_lo, stack_hi): 0 when the stack pointer lies elsewhere (a
 * signal stack, a coroutine's), whose end the library does not know.
 */
#define STACK_TOP_AT (PAGE - 8)
/* How many bytes above its stack pointer the gate copies at most. */
#define STACK_WINDOW 4096
/* The main thread's stack: at most this far below its arguments. */
#define MAIN_STACK_SPAN ((uintptr_t)64 << 20)
extern void *__libc_stack_end;
static TLS uintptr_t stack_lo;
static TLS uintptr_t stack_hi;

/* Events this thread raised so far (THREADCREATE's creator_events). */
static TLS uint32_t events_raised;
/* Set while a probe runs, so that nothing it calls raises events. */
static TLS int in_probe;

static void *resolve(const char *name)
{
	void *f = dlsym(RTLD_NEXT, name);
	if (!f)
		abort(); /* no libc function to forward to: nothing sane to do */
	return f;
}

/*
 * The condition variables' functions come in two versions; a program
 * built on this glibc calls the current one (an unversioned definition
 * here stands for every version), whose layout the real call must match.
 */
static void *resolve_cond(const char *name)
{
	void *f = dlvsym(RTLD_NEXT, name, "GLIBC_2.3.2");
	return f ? f : resolve(name);
}

/*
 * What dlsym allocates while the real allocation functions are being
 * looked up: a static arena, never freed (glibc's dlsym may call calloc).
 */
#define BOOT_HEAP 4096
static char boot_heap[BOOT_HEAP] __attribute__((aligned(16)));
static size_t boot_used;
static int resolving;

static void *boot_alloc(size_t n)
{
	n = (n + 15) & ~(size_t)15;
	if (n > BOOT_HEAP - boot_used)
		return NULL;
	void *p = boot_heap + boot_used;
	boot_used += n;
	return p;
}

static int is_boot(const void *p)
{
	return (const char *)p >= boot_heap && (const char *)p < boot_heap + BOOT_HEAP;
}

static void resolve_all(void)
{
	resolving = 1;
	real_malloc = resolve("malloc");
	real_calloc = resolve("calloc");
	real_realloc = resolve("realloc");
	real_free = resolve("free");
	real_posix_memalign = resolve("posix_memalign");
	real_aligned_alloc = resolve("aligned_alloc");
	real_memalign = resolve("memalign");
	real_mmap = resolve("mmap");
	real_munmap = resolve("munmap");
	resolving = 0;
	real_lock = resolve("pthread_mutex_lock");
	real_trylock = resolve("pthread_mutex_trylock");
	real_timedlock = resolve("pthread_mutex_timedlock");
	real_unlock = resolve("pthread_mutex_unlock");
	real_init = resolve("pthread_mutex_init");
	real_cond_wait = resolve_cond("pthread_cond_wait");
	real_cond_timedwait = resolve_cond("pthread_cond_timedwait");
	real_cond_clockwait = resolve("pthread_cond_clockwait");
	real_cond_signal = resolve_cond("pthread_cond_signal");
	real_cond_broadcast = resolve_cond("pthread_cond_broadcast");
	real_barrier_wait = resolve("pthread_barrier_wait");
	real_rdlock = resolve("pthread_rwlock_rdlock");
	real_wrlock = resolve("pthread_rwlock_wrlock");
	real_tryrdlock = resolve("pthread_rwlock_tryrdlock");
	real_trywrlock = resolve("pthread_rwlock_trywrlock");
	real_timedrdlock = resolve("pthread_rwlock_timedrdlock");
	real_timedwrlock = resolve("pthread_rwlock_timedwrlock");
	real_clockrdlock = resolve("pthread_rwlock_clockrdlock");
	real_clockwrlock = resolve("pthread_rwlock_clockwrlock");
	real_rwunlock = resolve("pthread_rwlock_unlock");
	real_sem_wait = resolve("sem_wait");
	real_sem_trywait = resolve("sem_trywait");
	real_sem_timedwait = resolve("sem_timedwait");
	real_sem_clockwait = resolve("sem_clockwait");
	real_sem_post = resolve("sem_post");
	real_create = resolve("pthread_create");
	real_join = resolve("pthread_join");
	real_fork = resolve("fork");
	real_exit = resolve("exit");
	real__exit = resolve("_exit");
	real__Exit = resolve("_Exit");
}

/* The wrappers may run before the constructor (other libraries' ones). */
#define REAL(f) (__builtin_expect(f == NULL, 0) ? (resolve_all(), f) : f)

static int kernel_forwards_events(void)
{
	char line[4096];
	int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, line, sizeof(line) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	line[n] = '\0';
	for (char *p = line; (p = strstr(p, "insight.platform")) != NULL; p++) {
		char after = p[strlen("insight.platform")];
		if ((p == line || p[-1] == ' ') && (after == ' ' || after == '\n' ||
						    after == '=' || after == '\0'))
			return 1;
	}
	return 0;
}

/*
 * The gate in the [insight] mapping at @start, if the header is there,
 * and the heap gate in *heap (NULL if the hypervisor offers none).
 */
static void *gate_at(unsigned long start, void **heap)
{
	const struct insight_gate *g = (const void *)(start + INSIGHT_GATE_HEADER_OFFSET);
	if (g->magic != INSIGHT_GATE_MAGIC || g->version != INSIGHT_GATE_VERSION ||
	    g->code_offset <= INSIGHT_GATE_HEADER_OFFSET || g->code_offset >= PAGE)
		return NULL;
	if (g->heap_code_offset > INSIGHT_GATE_HEADER_OFFSET && g->heap_code_offset < PAGE)
		*heap = (void *)(start + g->heap_code_offset);
	return (void *)(start + g->code_offset);
}

/*
 * The insight kernel maps the trampoline pages right below the
 * executable's first page when there is room: found there with one system
 * call (msync fails on a range that is not all mapped), where reading
 * /proc/self/maps costs a tenth of a second of interpreted guest kernel.
 */
static void *gate_below_executable(void **heap)
{
	const ElfW(Phdr) *ph = (const void *)getauxval(AT_PHDR);
	unsigned long n = getauxval(AT_PHNUM), bias = 0, low = ~0UL;
	if (!ph)
		return NULL;
	for (unsigned long i = 0; i < n; i++)
		if (ph[i].p_type == PT_PHDR)
			bias = (unsigned long)ph - ph[i].p_vaddr;
	for (unsigned long i = 0; i < n; i++)
		if (ph[i].p_type == PT_LOAD && ph[i].p_vaddr < low)
			low = ph[i].p_vaddr;
	if (low == ~0UL)
		return NULL;
	unsigned long exe = (bias + low) & ~(unsigned long)(PAGE - 1);
	if (exe < INSIGHT_GATE_MAPPING_PAGES * PAGE)
		return NULL;
	unsigned long start = exe - INSIGHT_GATE_MAPPING_PAGES * PAGE;
	if (msync((void *)start, INSIGHT_GATE_MAPPING_PAGES * PAGE, MS_ASYNC) != 0)
		return NULL;
	return gate_at(start, heap);
}

/*
 * Elsewhere: the first [insight] mapping whose code page ends with the
 * gate's header (the hypervisor wrote it); NULL when there is none.
 */
static void *gate_in_maps(void **heap)
{
	void *found = NULL;
	char line[512];
	FILE *maps = fopen("/proc/self/maps", "re");
	if (!maps)
		return NULL;
	while (!found && fgets(line, sizeof(line), maps)) {
		unsigned long start;
		size_t len = strlen(line);
		if (len >= 10 && strcmp(line + len - 10, "[insight]\n") == 0 &&
		    sscanf(line, "%lx-", &start) == 1)
			found = gate_at(start, heap);
	}
	fclose(maps);
	return found;
}

__attribute__((constructor)) static void probes_init(void)
{
	/* First: a thread's header is filled at its first event, the name
	 * with it, and the steps below could raise one once active. (The
	 * pid is asked for at that first event: a process that raises none,
	 * a shell's child that only executes another program, pays no
	 * system call for it.) */
	strncpy(comm, program_invocation_short_name, sizeof(comm) - 1);
	resolve_all();
	const char *env = getenv("INSIGHT_PROBES");
	int off = env && strcmp(env, "off") == 0;
	int exits = env && (strcmp(env, "int3") == 0 || strcmp(env, "port") == 0);
	void *heap = NULL;
	/* A gate the hypervisor wrote is proof enough of an insight kernel. */
	gate = off || exits ? NULL : gate_below_executable(&heap);
	active = !off && (gate || kernel_forwards_events());
	if (active && !exits && !gate)
		gate = gate_in_maps(&heap);
	if (gate && !(env && strcmp(env, "noheap") == 0))
		heap_gate = heap;
	if (gate)
		notify_by = NOTIFY_GATE;
	else if (active && !(env && strcmp(env, "int3") == 0) &&
		 ioperm(INSIGHT_EVENT_PORT, 4, 1) == 0)
		notify_by = NOTIFY_PORT;
	else
		notify_by = NOTIFY_INT3;
}

/*
 * Calls the gate @g with the event @e (the calling thread's buffer).
 *
 * The replay's gate copies the stack from its stack pointer up to the top
 * given in the buffer page, at most STACK_WINDOW bytes; the recording's
 * reads none of it. A page of that window the thread never touched (in a
 * caller's large local array that was never written) would fault at
 * replay only, and the replay would diverge: so in both modes, before
 * the call, the last byte the copy will read is read here (the call's
 * own push touches the first page; the window spans at most two).
 */
static inline void call_gate(struct insight_event_header *e, void *g)
{
	uintptr_t sp;
	__asm__("mov %%rsp, %0" : "=r"(sp));
	uintptr_t top = sp >= stack_lo && sp < stack_hi ? stack_hi : 0;
	memcpy(buffer.bytes + STACK_TOP_AT, &top, sizeof(top));
	/* Past the red zone, where the compiler may keep locals. LEA leaves
	 * the flags alone; the gate's stack pointer is RSP - 8 at the call. */
	__asm__ volatile("lea -128(%%rsp), %%rsp\n\t"
			 "lea -8(%%rsp), %%rcx\n\t"
			 "mov %[top], %%rsi\n\t"
			 "sub %%rcx, %%rsi\n\t"
			 "jbe 1f\n\t" /* no top above it: the copy ends in RSP's page */
			 "cmp %[window], %%rsi\n\t"
			 "jbe 2f\n\t"
			 "mov %[window], %%rsi\n"
			 "2:\n\t"
			 "and $-8, %%rsi\n\t"
			 "jz 1f\n\t"
			 "movzbl -1(%%rcx,%%rsi), %%esi\n"
			 "1:\n\t"
			 "call *%[g]\n\t"
			 "lea 128(%%rsp), %%rsp"
			 :
			 : "a"(e), [g] "r"(g), [top] "r"(top), [window] "i"(STACK_WINDOW)
			 : "rcx", "rsi", "cc", "memory");
}

static void notify(struct insight_event_header *e)
{
	events_raised++;
	if (notify_by == NOTIFY_GATE)
		call_gate(e, gate);
	else if (notify_by == NOTIFY_PORT)
		__asm__ volatile("outl %%eax, %%dx"
				 :
				 : "a"(e), "b"(INSIGHT_EVENTNOTIFY), "d"(INSIGHT_EVENT_PORT)
				 : "memory");
	else
		__asm__ volatile("int3" : : "a"(e), "b"(INSIGHT_EVENTNOTIFY) : "memory");
}

/* The process the calling thread's buffer header was filled in for. */
static TLS pid_t header_for;

/* Fills in the header fields every event of the calling thread shares. */
static __attribute__((noinline, cold)) void fill_header(void)
{
	if (!my_pid)
		my_pid = getpid();
	if (!my_lwpid) {
		my_lwpid = (pid_t)syscall(SYS_gettid);
		/* The main thread's frames all lie below its arguments. A
		 * child forked by another thread keeps that thread's top. */
		uintptr_t end = (uintptr_t)__libc_stack_end & ~(uintptr_t)7;
		uintptr_t here = (uintptr_t)__builtin_frame_address(0);
		if (my_lwpid == my_pid && !stack_hi && here < end && end - here < MAIN_STACK_SPAN) {
			stack_lo = end - MAIN_STACK_SPAN;
			stack_hi = end;
		}
	}
	struct insight_event_header *h = &buffer.header;
	h->magic = INSIGHT_EVENT_MAGIC;
	h->version = INSIGHT_EVENT_VERSION;
	h->pid = (uint32_t)my_pid;
	h->lwpid = (uint32_t)my_lwpid;
	h->flags = 0;
	h->timestamp = 0;
	memcpy(h->comm, comm, sizeof(h->comm));
	header_for = my_pid;
}

/*
 * The calling thread's buffer, with the generic fields filled in (never
 * NULL). Those every event of the thread shares are written at its first
 * event (and again in a forked child), only the kind and size at each: a
 * program that allocates millions of times raises two heap events a call,
 * and the allocator's own fast path is not much longer than the header.
 */
static struct insight_event_header *begin(uint16_t kind, uint32_t payload)
{
	if (__builtin_expect(!my_pid || header_for != my_pid, 0))
		fill_header();
	struct insight_event_header *h = &buffer.header;
	h->kind = kind;
	h->size = (uint32_t)(sizeof(*h) + payload);
	return h;
}

static int raise_symbol(struct dl_phdr_info *info, size_t size, void *data)
{
	(void)size;
	(void)data;
	char exe[PAGE / 2];
	const char *path = info->dlpi_name;
	if (!path || !path[0]) {
		/* The executable: by the absolute path it was executed by, when
		 * it was (no system call); else as the kernel resolved it. */
		const char *execfn = (const char *)getauxval(AT_EXECFN);
		if (execfn && execfn[0] == '/') {
			path = execfn;
		} else {
			ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
			if (n <= 0)
				return 0;
			exe[n] = '\0';
			path = exe;
		}
	}
	if (path[0] != '/')
		return 0; /* the vDSO: nothing on disk to read */
	size_t len = strlen(path);
	if (len > PAGE / 2)
		return 0;
	struct insight_event_header *h =
		begin(INSIGHT_EV_SYMBOL, (uint32_t)(sizeof(struct insight_symbol_payload) + len));
	struct insight_symbol_payload *s = (void *)(h + 1);
	s->base = info->dlpi_addr;
	s->path_len = (uint32_t)len;
	s->reserved = 0;
	memcpy(s->path, path, len);
	notify(h);
	return 0;
}

/* Common entry of every probe: 0 when no event must be raised. */
static int enter(void)
{
	if (!active || in_probe)
		return 0;
	in_probe = 1;
	if (!my_pid)
		my_pid = getpid();
	if (symbols_for != my_pid) {
		symbols_for = my_pid;
		dl_iterate_phdr(raise_symbol, NULL);
	}
	return 1;
}

static void leave(void)
{
	in_probe = 0;
}

static void raise_lock_event(uint16_t kind, pthread_mutex_t *m, void *caller, int result)
{
	struct insight_event_header *h = begin(kind, sizeof(struct insight_lock_payload));
	struct insight_lock_payload *p = (void *)(h + 1);
	p->lock = (uintptr_t)m;
	p->caller = (uintptr_t)caller;
	p->result = result;
	p->reserved = 0;
	notify(h);
}

/* One acquisition call: REQ before it, RET with its result after. */
#define LOCK_PROBE(req, ret, call)                                        \
	do {                                                              \
		void *caller = __builtin_return_address(0);               \
		if (!enter())                                             \
			return call;                                      \
		raise_lock_event(req, m, caller, 0);                      \
		leave();                                                  \
		int r = call;                                             \
		if (enter()) {                                            \
			raise_lock_event(ret, m, caller, r);              \
			leave();                                          \
		}                                                         \
		return r;                                                 \
	} while (0)

EXPORT int pthread_mutex_lock(pthread_mutex_t *m)
{
	LOCK_PROBE(INSIGHT_EV_LOCK, INSIGHT_EV_LOCK_RET, REAL(real_lock)(m));
}

EXPORT int pthread_mutex_trylock(pthread_mutex_t *m)
{
	LOCK_PROBE(INSIGHT_EV_TRYLOCK, INSIGHT_EV_TRYLOCK_RET, REAL(real_trylock)(m));
}

EXPORT int pthread_mutex_timedlock(pthread_mutex_t *m, const struct timespec *t)
{
	LOCK_PROBE(INSIGHT_EV_TIMEDLOCK, INSIGHT_EV_TIMEDLOCK_RET, REAL(real_timedlock)(m, t));
}

EXPORT int pthread_mutex_unlock(pthread_mutex_t *m)
{
	/* Raised while the lock is still held, so no other thread's
	 * acquisition can appear before the release. */
	if (enter()) {
		raise_lock_event(INSIGHT_EV_UNLOCK, m, __builtin_return_address(0), 0);
		leave();
	}
	return REAL(real_unlock)(m);
}

EXPORT int pthread_mutex_init(pthread_mutex_t *m, const pthread_mutexattr_t *a)
{
	int r = REAL(real_init)(m, a);
	if (enter()) {
		raise_lock_event(INSIGHT_EV_LOCKINIT, m, __builtin_return_address(0), r);
		leave();
	}
	return r;
}

static void raise_sync_event(uint16_t kind, const void *object, const void *mutex, void *caller,
			     int result, uint32_t flags)
{
	struct insight_event_header *h = begin(kind, sizeof(struct insight_sync_payload));
	struct insight_sync_payload *p = (void *)(h + 1);
	p->object = (uintptr_t)object;
	p->caller = (uintptr_t)caller;
	p->mutex = (uintptr_t)mutex;
	p->result = result;
	p->flags = flags;
	notify(h);
}

/*
 * One call that may wait: REQ before it, RET with its result after. errno
 * is the call's own afterwards (the semaphores report through it).
 */
#define SYNC_PROBE(req, ret, object, mutex, flags, call)                     \
	do {                                                                 \
		void *caller = __builtin_return_address(0);                  \
		if (!enter())                                                \
			return call;                                         \
		raise_sync_event(req, object, mutex, caller, 0, flags);      \
		leave();                                                     \
		int r = call;                                                \
		if (enter()) {                                               \
			int saved = errno;                                   \
			raise_sync_event(ret, object, mutex, caller, r, flags); \
			errno = saved;                                       \
			leave();                                             \
		}                                                            \
		return r;                                                    \
	} while (0)

/* A call that never waits: one event before it. */
#define SYNC_NOTE(kind, object, call)                                               \
	do {                                                                        \
		if (enter()) {                                                      \
			raise_sync_event(kind, object, NULL, __builtin_return_address(0), 0, 0); \
			leave();                                                    \
		}                                                                   \
		return call;                                                        \
	} while (0)

/*
 * A condition variable's wait releases the mutex and takes it again
 * inside glibc, where the mutex wrappers do not see it: CONDWAIT is the
 * release (raised while the mutex is still held, as UNLOCK is), CONDWAIT_RET
 * the thread holding it again.
 */
EXPORT int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
{
	SYNC_PROBE(INSIGHT_EV_CONDWAIT, INSIGHT_EV_CONDWAIT_RET, c, m, 0,
		   REAL(real_cond_wait)(c, m));
}

EXPORT int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *t)
{
	SYNC_PROBE(INSIGHT_EV_CONDWAIT, INSIGHT_EV_CONDWAIT_RET, c, m, INSIGHT_SYNC_TIMED,
		   REAL(real_cond_timedwait)(c, m, t));
}

EXPORT int pthread_cond_clockwait(pthread_cond_t *c, pthread_mutex_t *m, clockid_t clock,
				  const struct timespec *t)
{
	SYNC_PROBE(INSIGHT_EV_CONDWAIT, INSIGHT_EV_CONDWAIT_RET, c, m, INSIGHT_SYNC_TIMED,
		   REAL(real_cond_clockwait)(c, m, clock, t));
}

EXPORT int pthread_cond_signal(pthread_cond_t *c)
{
	SYNC_NOTE(INSIGHT_EV_CONDSIGNAL, c, REAL(real_cond_signal)(c));
}

EXPORT int pthread_cond_broadcast(pthread_cond_t *c)
{
	SYNC_NOTE(INSIGHT_EV_CONDBROADCAST, c, REAL(real_cond_broadcast)(c));
}

EXPORT int pthread_barrier_wait(pthread_barrier_t *b)
{
	SYNC_PROBE(INSIGHT_EV_BARRIER, INSIGHT_EV_BARRIER_RET, b, NULL, 0, REAL(real_barrier_wait)(b));
}

#define RW_PROBE(flags, call) \
	SYNC_PROBE(INSIGHT_EV_RWLOCK, INSIGHT_EV_RWLOCK_RET, l, NULL, flags, call)

EXPORT int pthread_rwlock_rdlock(pthread_rwlock_t *l)
{
	RW_PROBE(0, REAL(real_rdlock)(l));
}

EXPORT int pthread_rwlock_wrlock(pthread_rwlock_t *l)
{
	RW_PROBE(INSIGHT_SYNC_WRITE, REAL(real_wrlock)(l));
}

EXPORT int pthread_rwlock_tryrdlock(pthread_rwlock_t *l)
{
	RW_PROBE(INSIGHT_SYNC_TRY, REAL(real_tryrdlock)(l));
}

EXPORT int pthread_rwlock_trywrlock(pthread_rwlock_t *l)
{
	RW_PROBE(INSIGHT_SYNC_WRITE | INSIGHT_SYNC_TRY, REAL(real_trywrlock)(l));
}

EXPORT int pthread_rwlock_timedrdlock(pthread_rwlock_t *l, const struct timespec *t)
{
	RW_PROBE(INSIGHT_SYNC_TIMED, REAL(real_timedrdlock)(l, t));
}

EXPORT int pthread_rwlock_timedwrlock(pthread_rwlock_t *l, const struct timespec *t)
{
	RW_PROBE(INSIGHT_SYNC_WRITE | INSIGHT_SYNC_TIMED, REAL(real_timedwrlock)(l, t));
}

EXPORT int pthread_rwlock_clockrdlock(pthread_rwlock_t *l, clockid_t clock, const struct timespec *t)
{
	RW_PROBE(INSIGHT_SYNC_TIMED, REAL(real_clockrdlock)(l, clock, t));
}

EXPORT int pthread_rwlock_clockwrlock(pthread_rwlock_t *l, clockid_t clock, const struct timespec *t)
{
	RW_PROBE(INSIGHT_SYNC_WRITE | INSIGHT_SYNC_TIMED, REAL(real_clockwrlock)(l, clock, t));
}

EXPORT int pthread_rwlock_unlock(pthread_rwlock_t *l)
{
	/* Raised while the lock is still held, as UNLOCK is. */
	SYNC_NOTE(INSIGHT_EV_RWUNLOCK, l, REAL(real_rwunlock)(l));
}

#define SEM_PROBE(flags, call) \
	SYNC_PROBE(INSIGHT_EV_SEMWAIT, INSIGHT_EV_SEMWAIT_RET, s, NULL, flags, call)

EXPORT int sem_wait(sem_t *s)
{
	SEM_PROBE(0, REAL(real_sem_wait)(s));
}

EXPORT int sem_trywait(sem_t *s)
{
	SEM_PROBE(INSIGHT_SYNC_TRY, REAL(real_sem_trywait)(s));
}

EXPORT int sem_timedwait(sem_t *s, const struct timespec *t)
{
	SEM_PROBE(INSIGHT_SYNC_TIMED, REAL(real_sem_timedwait)(s, t));
}

EXPORT int sem_clockwait(sem_t *s, clockid_t clock, const struct timespec *t)
{
	SEM_PROBE(INSIGHT_SYNC_TIMED, REAL(real_sem_clockwait)(s, clock, t));
}

EXPORT int sem_post(sem_t *s)
{
	SYNC_NOTE(INSIGHT_EV_SEMPOST, s, REAL(real_sem_post)(s));
}

/*
 * pthread_t -> lwpid of the threads started through us, for THREADJOIN:
 * filled by each new thread itself, in the order they start, without
 * locks (a mutex here would be probed). Kept dense so that a program with
 * a few threads touches one page of it, not one page per thread: every
 * first touch is a page fault of the interpreted guest kernel.
 */
#define THREAD_SLOTS 4096
static struct {
	pthread_t id;
	pid_t lwpid;
} thread_slots[THREAD_SLOTS];
static unsigned thread_slots_used;

static unsigned slots_in_use(void)
{
	unsigned n = __atomic_load_n(&thread_slots_used, __ATOMIC_ACQUIRE);
	return n < THREAD_SLOTS ? n : THREAD_SLOTS;
}

static void remember_thread(pthread_t id, pid_t lwpid)
{
	/* glibc reuses a finished thread's descriptor, and with it its id. */
	for (unsigned i = 0, n = slots_in_use(); i < n; i++)
		if (__atomic_load_n(&thread_slots[i].id, __ATOMIC_ACQUIRE) == id) {
			__atomic_store_n(&thread_slots[i].lwpid, lwpid, __ATOMIC_RELEASE);
			return;
		}
	unsigned i = __atomic_fetch_add(&thread_slots_used, 1, __ATOMIC_ACQ_REL);
	if (i >= THREAD_SLOTS)
		return; /* its THREADJOIN will name no thread */
	__atomic_store_n(&thread_slots[i].lwpid, lwpid, __ATOMIC_RELEASE);
	__atomic_store_n(&thread_slots[i].id, id, __ATOMIC_RELEASE);
}

static pid_t lwpid_of(pthread_t id)
{
	for (unsigned i = slots_in_use(); i-- > 0;)
		if (__atomic_load_n(&thread_slots[i].id, __ATOMIC_ACQUIRE) == id)
			return __atomic_load_n(&thread_slots[i].lwpid, __ATOMIC_ACQUIRE);
	return 0;
}

struct start {
	void *(*routine)(void *);
	void *arg;
	pid_t parent_lwpid;
	uint32_t parent_events;
};

/*
 * Where pthread_create hands a new thread its start: a slot of a static
 * pool while one is free, else the heap. The pool spares each thread the
 * malloc arena glibc would set up for its first free(): system calls and
 * page faults of the interpreted guest kernel.
 */
#define START_SLOTS 64
static struct start start_pool[START_SLOTS];
static int start_taken[START_SLOTS];

static struct start *start_alloc(void)
{
	for (int i = 0; i < START_SLOTS; i++)
		if (!__atomic_exchange_n(&start_taken[i], 1, __ATOMIC_ACQUIRE))
			return &start_pool[i];
	return malloc(sizeof(struct start));
}

static void start_free(struct start *s)
{
	if (s >= start_pool && s < start_pool + START_SLOTS)
		__atomic_store_n(&start_taken[s - start_pool], 0, __ATOMIC_RELEASE);
	else
		free(s);
}

/*
 * The calling thread's stack: from its lowest address, which its
 * attributes give, to @top. The attributes cost a system call (glibc adds
 * the CPU affinity) and a malloc, which raises no event. Not inlined: the
 * caller keeps its tail call.
 */
static __attribute__((noinline)) void set_thread_stack(uintptr_t top)
{
	pthread_attr_t attr;
	in_probe = 1;
	if (pthread_getattr_np(pthread_self(), &attr) == 0) {
		void *lo;
		size_t size;
		if (pthread_attr_getstack(&attr, &lo, &size) == 0 && (uintptr_t)lo < top) {
			stack_lo = (uintptr_t)lo;
			stack_hi = top;
		}
		pthread_attr_destroy(&attr);
	}
	in_probe = 0;
}

static void *start_thread(void *p)
{
	struct start s = *(struct start *)p;
	start_free(p);
	if (!my_lwpid)
		my_lwpid = (pid_t)syscall(SYS_gettid);
	/* Every frame the thread's events see lies below this one's saved
	 * frame pointer and return address (which the start routine's frame
	 * takes over: it is called as a tail call). */
	set_thread_stack(((uintptr_t)__builtin_frame_address(0) + 16) & ~(uintptr_t)7);
	remember_thread(pthread_self(), my_lwpid);
	if (enter()) {
		struct insight_event_header *h =
			begin(INSIGHT_EV_THREADCREATE, sizeof(struct insight_threadcreate_payload));
		struct insight_threadcreate_payload *t = (void *)(h + 1);
		t->parent_lwpid = (uint32_t)s.parent_lwpid;
		t->creator_events = s.parent_events;
		t->start_routine = (uintptr_t)s.routine;
		notify(h);
		leave();
	}
	return s.routine(s.arg);
}

EXPORT int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*routine)(void *), void *arg)
{
	if (!active)
		return REAL(real_create)(t, a, routine, arg);
	struct start *s = start_alloc();
	if (!s)
		return EAGAIN;
	s->routine = routine;
	s->arg = arg;
	if (enter()) {
		struct insight_event_header *h =
			begin(INSIGHT_EV_THREADSPAWN, sizeof(struct insight_threadspawn_payload));
		struct insight_threadspawn_payload *p = (void *)(h + 1);
		p->start_routine = (uintptr_t)routine;
		p->caller = (uintptr_t)__builtin_return_address(0);
		notify(h);
		leave();
	}
	s->parent_lwpid = my_lwpid ? my_lwpid : (pid_t)syscall(SYS_gettid);
	/* After the THREADSPAWN: the count says which event it was. */
	s->parent_events = events_raised;
	int r = REAL(real_create)(t, a, start_thread, s);
	if (r != 0)
		start_free(s);
	return r;
}

EXPORT int pthread_join(pthread_t t, void **result)
{
	int r = REAL(real_join)(t, result);
	pid_t joined = r == 0 && active ? lwpid_of(t) : 0;
	if (joined && enter()) {
		struct insight_event_header *h =
			begin(INSIGHT_EV_THREADJOIN, sizeof(struct insight_threadjoin_payload));
		struct insight_threadjoin_payload *j = (void *)(h + 1);
		j->joined_lwpid = (uint32_t)joined;
		j->reserved = 0;
		notify(h);
		leave();
	}
	return r;
}

EXPORT pid_t fork(void)
{
	pid_t parent = my_pid ? my_pid : getpid();
	pid_t r = REAL(real_fork)();
	if (r == 0) {
		my_pid = getpid();
		my_lwpid = 0;
		exit_raised = 0;
		if (enter()) {
			struct insight_event_header *h =
				begin(INSIGHT_EV_FORK, sizeof(struct insight_fork_payload));
			struct insight_fork_payload *f = (void *)(h + 1);
			f->parent_pid = (uint32_t)parent;
			f->reserved = 0;
			notify(h);
			leave();
		}
	}
	return r;
}

static void raise_exit(int status)
{
	if (exit_raised || !enter())
		return;
	exit_raised = 1;
	struct insight_event_header *h = begin(INSIGHT_EV_EXIT, sizeof(struct insight_exit_payload));
	struct insight_exit_payload *e = (void *)(h + 1);
	e->status = status;
	e->reserved = 0;
	notify(h);
	leave();
}

EXPORT void exit(int status)
{
	raise_exit(status);
	REAL(real_exit)(status);
}

EXPORT void _exit(int status)
{
	raise_exit(status);
	REAL(real__exit)(status);
}

EXPORT void _Exit(int status)
{
	raise_exit(status);
	REAL(real__Exit)(status);
}

/*
 * The heap events. A wrapper raises HEAPCALL, calls the real function
 * with in_probe set (so that nothing it calls raises events: a HEAPCALL is
 * always closed by its own call's ALLOC or FREE), then ALLOC or FREE. They
 * do not count in events_raised: THREADCREATE's position is among the
 * other events, which every replay collects.
 */
static void raise_heap(uint16_t kind, uint32_t function, const void *addr, size_t size,
		       const void *caller)
{
	struct insight_event_header *h = begin(kind, sizeof(struct insight_heap_payload));
	struct insight_heap_payload *p = (void *)(h + 1);
	p->addr = (uintptr_t)addr;
	p->size = size;
	p->caller = (uintptr_t)caller;
	p->function = function;
	p->reserved = 0;
	call_gate(h, heap_gate);
}

/* Raises HEAPCALL: 0 when no heap event must be raised. in_probe stays set
 * until heap_return. */
static int heap_call(uint32_t function, const void *addr, size_t size, const void *caller)
{
	if (!heap_gate || !enter())
		return 0;
	raise_heap(INSIGHT_EV_HEAPCALL, function, addr, size, caller);
	return 1;
}

static void heap_return(uint16_t kind, uint32_t function, const void *addr, size_t size,
			const void *caller)
{
	raise_heap(kind, function, addr, size, caller);
	leave();
}

/* Resolves the real functions unless dlsym itself is allocating: 0 then. */
#define HEAP_REAL(f) (__builtin_expect(f == NULL, 0) && (resolving || (resolve_all(), 0)) ? 0 : 1)

EXPORT void *malloc(size_t n)
{
	if (!HEAP_REAL(real_malloc))
		return boot_alloc(n);
	const void *caller = __builtin_return_address(0);
	if (!heap_call(INSIGHT_HEAP_MALLOC, NULL, n, caller))
		return real_malloc(n);
	void *p = real_malloc(n);
	heap_return(INSIGHT_EV_ALLOC, INSIGHT_HEAP_MALLOC, p, n, caller);
	return p;
}

EXPORT void *calloc(size_t count, size_t n)
{
	if (!HEAP_REAL(real_calloc)) {
		if (n && count > (size_t)-1 / n)
			return NULL;
		return boot_alloc(count * n); /* the arena is zeroed and never reused */
	}
	const void *caller = __builtin_return_address(0);
	size_t bytes = n && count > (size_t)-1 / n ? (size_t)-1 : count * n;
	if (!heap_call(INSIGHT_HEAP_CALLOC, NULL, bytes, caller))
		return real_calloc(count, n);
	void *p = real_calloc(count, n);
	heap_return(INSIGHT_EV_ALLOC, INSIGHT_HEAP_CALLOC, p, bytes, caller);
	return p;
}

EXPORT void *realloc(void *old, size_t n)
{
	if (is_boot(old)) {
		/* A block of the boot arena: copy what it can hold. */
		void *p = malloc(n);
		size_t room = (size_t)(boot_heap + BOOT_HEAP - (char *)old);
		if (p)
			memcpy(p, old, n < room ? n : room);
		return p;
	}
	if (!HEAP_REAL(real_realloc))
		return NULL;
	const void *caller = __builtin_return_address(0);
	if (!heap_call(INSIGHT_HEAP_REALLOC, old, n, caller))
		return real_realloc(old, n);
	void *p = real_realloc(old, n);
	if (p && old) {
		raise_heap(INSIGHT_EV_FREE, INSIGHT_HEAP_REALLOC, old, 0, caller);
		heap_return(INSIGHT_EV_ALLOC, INSIGHT_HEAP_REALLOC, p, n, caller);
	} else if (!p && old && n == 0) {
		heap_return(INSIGHT_EV_FREE, INSIGHT_HEAP_REALLOC, old, 0, caller); /* freed */
	} else {
		heap_return(INSIGHT_EV_ALLOC, INSIGHT_HEAP_REALLOC, p, n, caller);
	}
	return p;
}

EXPORT void free(void *p)
{
	if (!p || is_boot(p))
		return;
	if (!HEAP_REAL(real_free))
		return;
	const void *caller = __builtin_return_address(0);
	if (!heap_call(INSIGHT_HEAP_FREE, p, 0, caller)) {
		real_free(p);
		return;
	}
	real_free(p);
	heap_return(INSIGHT_EV_FREE, INSIGHT_HEAP_FREE, p, 0, caller);
}

EXPORT int posix_memalign(void **out, size_t align, size_t n)
{
	if (!HEAP_REAL(real_posix_memalign))
		return ENOMEM;
	const void *caller = __builtin_return_address(0);
	if (!heap_call(INSIGHT_HEAP_MEMALIGN, NULL, n, caller))
		return real_posix_memalign(out, align, n);
	int r = real_posix_memalign(out, align, n);
	heap_return(INSIGHT_EV_ALLOC, INSIGHT_HEAP_MEMALIGN, r == 0 ? *out : NULL, n, caller);
	return r;
}

/* aligned_alloc and memalign: the same call, two names. */
#define ALIGNED_PROBE(real)                                                                 \
	do {                                                                                \
		if (!HEAP_REAL(real))                                                       \
			return NULL;                                                        \
		const void *caller = __builtin_return_address(0);                           \
		if (!heap_call(INSIGHT_HEAP_MEMALIGN, NULL, n, caller))                     \
			return real(align, n);                                              \
		void *p = real(align, n);                                                   \
		heap_return(INSIGHT_EV_ALLOC, INSIGHT_HEAP_MEMALIGN, p, n, caller);         \
		return p;                                                                   \
	} while (0)

EXPORT void *aligned_alloc(size_t align, size_t n)
{
	ALIGNED_PROBE(real_aligned_alloc);
}

EXPORT void *memalign(size_t align, size_t n)
{
	ALIGNED_PROBE(real_memalign);
}

static void *mmap_probe(void *addr, size_t n, int prot, int flags, int fd, off_t off,
			const void *caller)
{
	if (!HEAP_REAL(real_mmap))
		return MAP_FAILED;
	if (!heap_call(INSIGHT_HEAP_MMAP, addr, n, caller))
		return real_mmap(addr, n, prot, flags, fd, off);
	void *p = real_mmap(addr, n, prot, flags, fd, off);
	heap_return(INSIGHT_EV_ALLOC, INSIGHT_HEAP_MMAP, p == MAP_FAILED ? NULL : p, n, caller);
	return p;
}

EXPORT void *mmap(void *addr, size_t n, int prot, int flags, int fd, off_t off)
{
	return mmap_probe(addr, n, prot, flags, fd, off, __builtin_return_address(0));
}

/* On x86-64 mmap64 is mmap; both names are exported. */
EXPORT void *mmap64(void *addr, size_t n, int prot, int flags, int fd, off_t off)
{
	return mmap_probe(addr, n, prot, flags, fd, off, __builtin_return_address(0));
}

EXPORT int munmap(void *addr, size_t n)
{
	if (!HEAP_REAL(real_munmap))
		return -1;
	const void *caller = __builtin_return_address(0);
	if (!heap_call(INSIGHT_HEAP_MUNMAP, addr, n, caller))
		return real_munmap(addr, n);
	int r = real_munmap(addr, n);
	heap_return(INSIGHT_EV_FREE, INSIGHT_HEAP_MUNMAP, r == 0 ? addr : NULL, n, caller);
	return r;
}

/* A return from main() reaches exit() inside libc, not through us. */
__attribute__((destructor)) static void probes_fini(void)
{
	raise_exit(-1);
}
