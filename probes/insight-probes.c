/*
 * libinsight-probes.so: explicit events for insight, loaded with
 * LD_PRELOAD.
 *
 * Wraps pthread_mutex_lock/trylock/timedlock/unlock/init, pthread_create,
 * pthread_join, fork, exit, _exit and _Exit, and raises an event around each call with
 * the probe ABI of insight-events.h: the event is written into a
 * page-aligned per-thread buffer, its address goes in RAX, the key
 * INSIGHT_EVENTNOTIFY in EBX, and int3 hands it to the insight guest
 * kernel, which forwards it to the hypervisor and returns without a
 * signal. Before a process's first event, SYMBOL events name its loaded
 * objects and their load bases.
 *
 * Where the process may use the event port (ioperm succeeds: it runs as
 * root), an OUT to that port replaces the int3: the same registers, one
 * VM exit straight from user mode instead of a trip through the guest
 * kernel's exception path, which a host that interprets the guest kernel
 * makes ~30 times dearer. INSIGHT_PROBES=int3 keeps the int3.
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
#include <stdlib.h>
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
static pid_t (*real_fork)(void);
static void (*real_exit)(int) __attribute__((noreturn));
static void (*real__exit)(int) __attribute__((noreturn));
static void (*real__Exit)(int) __attribute__((noreturn));

/* Whether this kernel forwards EVENTNOTIFY: decided once, at load. */
static int active;
/* Whether events go out through the event port instead of int3. */
static int use_port;
/* The process the SYMBOL events were raised for (fork makes a new one). */
static pid_t symbols_for;
static pid_t my_pid;
static int exit_raised;
static char comm[16];

static __thread struct insight_event_header *buffer;
static __thread pid_t my_lwpid;
/* Events this thread raised so far (THREADCREATE's creator_events). */
static __thread uint32_t events_raised;
/* Set while a probe runs, so that nothing it calls raises events. */
static __thread int in_probe;

static void *resolve(const char *name)
{
	void *f = dlsym(RTLD_NEXT, name);
	if (!f)
		abort(); /* no libc function to forward to: nothing sane to do */
	return f;
}

static void resolve_all(void)
{
	real_lock = resolve("pthread_mutex_lock");
	real_trylock = resolve("pthread_mutex_trylock");
	real_timedlock = resolve("pthread_mutex_timedlock");
	real_unlock = resolve("pthread_mutex_unlock");
	real_init = resolve("pthread_mutex_init");
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

__attribute__((constructor)) static void probes_init(void)
{
	resolve_all();
	const char *env = getenv("INSIGHT_PROBES");
	active = kernel_forwards_events() && !(env && strcmp(env, "off") == 0);
	use_port = active && !(env && strcmp(env, "int3") == 0) &&
		   ioperm(INSIGHT_EVENT_PORT, 4, 1) == 0;
	my_pid = getpid();
	strncpy(comm, program_invocation_short_name, sizeof(comm) - 1);
}

static void notify(struct insight_event_header *e)
{
	events_raised++;
	if (use_port)
		__asm__ volatile("outl %%eax, %%dx"
				 :
				 : "a"(e), "b"(INSIGHT_EVENTNOTIFY), "d"(INSIGHT_EVENT_PORT)
				 : "memory");
	else
		__asm__ volatile("int3" : : "a"(e), "b"(INSIGHT_EVENTNOTIFY) : "memory");
}

/* The calling thread's buffer, with the generic fields filled in. */
static struct insight_event_header *begin(uint16_t kind, uint32_t payload)
{
	if (!buffer) {
		void *p = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			return NULL;
		buffer = p;
	}
	if (!my_lwpid)
		my_lwpid = (pid_t)syscall(SYS_gettid);
	struct insight_event_header *h = buffer;
	h->magic = INSIGHT_EVENT_MAGIC;
	h->version = INSIGHT_EVENT_VERSION;
	h->kind = kind;
	h->size = (uint32_t)(sizeof(*h) + payload);
	h->pid = (uint32_t)my_pid;
	h->lwpid = (uint32_t)my_lwpid;
	h->flags = 0;
	h->timestamp = 0;
	memcpy(h->comm, comm, sizeof(h->comm));
	return h;
}

static int raise_symbol(struct dl_phdr_info *info, size_t size, void *data)
{
	(void)size;
	(void)data;
	char exe[PAGE / 2];
	const char *path = info->dlpi_name;
	if (!path || !path[0]) {
		ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
		if (n <= 0)
			return 0;
		exe[n] = '\0';
		path = exe;
	}
	if (path[0] != '/')
		return 0; /* the vDSO: nothing on disk to read */
	size_t len = strlen(path);
	if (len > PAGE / 2)
		return 0;
	struct insight_event_header *h =
		begin(INSIGHT_EV_SYMBOL, (uint32_t)(sizeof(struct insight_symbol_payload) + len));
	if (!h)
		return 0;
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
	if (!h)
		return;
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

/*
 * pthread_t -> lwpid of the threads started through us, for THREADJOIN:
 * open addressing, filled by each new thread itself, without locks (a
 * mutex here would be probed).
 */
#define THREAD_SLOTS 4096
static struct {
	pthread_t id;
	pid_t lwpid;
} thread_slots[THREAD_SLOTS];

static size_t slot_of(pthread_t id)
{
	return (size_t)((uintptr_t)id >> 12) % THREAD_SLOTS;
}

static void remember_thread(pthread_t id, pid_t lwpid)
{
	for (size_t i = slot_of(id), n = 0; n < THREAD_SLOTS; i = (i + 1) % THREAD_SLOTS, n++) {
		pthread_t expected = 0;
		if (__atomic_compare_exchange_n(&thread_slots[i].id, &expected, id, 0,
						__ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) ||
		    expected == id) {
			__atomic_store_n(&thread_slots[i].lwpid, lwpid, __ATOMIC_RELEASE);
			return;
		}
	}
}

static pid_t lwpid_of(pthread_t id)
{
	for (size_t i = slot_of(id), n = 0; n < THREAD_SLOTS; i = (i + 1) % THREAD_SLOTS, n++) {
		pthread_t seen = __atomic_load_n(&thread_slots[i].id, __ATOMIC_ACQUIRE);
		if (seen == id)
			return __atomic_load_n(&thread_slots[i].lwpid, __ATOMIC_ACQUIRE);
		if (seen == 0)
			return 0;
	}
	return 0;
}

struct start {
	void *(*routine)(void *);
	void *arg;
	pid_t parent_lwpid;
	uint32_t parent_events;
};

static void *start_thread(void *p)
{
	struct start s = *(struct start *)p;
	free(p);
	if (!my_lwpid)
		my_lwpid = (pid_t)syscall(SYS_gettid);
	remember_thread(pthread_self(), my_lwpid);
	if (enter()) {
		struct insight_event_header *h =
			begin(INSIGHT_EV_THREADCREATE, sizeof(struct insight_threadcreate_payload));
		if (h) {
			struct insight_threadcreate_payload *t = (void *)(h + 1);
			t->parent_lwpid = (uint32_t)s.parent_lwpid;
			t->creator_events = s.parent_events;
			t->start_routine = (uintptr_t)s.routine;
			notify(h);
		}
		leave();
	}
	void *r = s.routine(s.arg);
	/* The buffer dies with the thread. */
	if (buffer) {
		munmap(buffer, PAGE);
		buffer = NULL;
	}
	return r;
}

EXPORT int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*routine)(void *), void *arg)
{
	if (!active)
		return REAL(real_create)(t, a, routine, arg);
	struct start *s = malloc(sizeof(*s));
	if (!s)
		return EAGAIN;
	s->routine = routine;
	s->arg = arg;
	s->parent_lwpid = my_lwpid ? my_lwpid : (pid_t)syscall(SYS_gettid);
	s->parent_events = events_raised;
	int r = REAL(real_create)(t, a, start_thread, s);
	if (r != 0)
		free(s);
	return r;
}

EXPORT int pthread_join(pthread_t t, void **result)
{
	int r = REAL(real_join)(t, result);
	pid_t joined = r == 0 && active ? lwpid_of(t) : 0;
	if (joined && enter()) {
		struct insight_event_header *h =
			begin(INSIGHT_EV_THREADJOIN, sizeof(struct insight_threadjoin_payload));
		if (h) {
			struct insight_threadjoin_payload *j = (void *)(h + 1);
			j->joined_lwpid = (uint32_t)joined;
			j->reserved = 0;
			notify(h);
		}
		leave();
	}
	return r;
}

EXPORT pid_t fork(void)
{
	pid_t parent = my_pid;
	pid_t r = REAL(real_fork)();
	if (r == 0) {
		my_pid = getpid();
		my_lwpid = 0;
		exit_raised = 0;
		if (enter()) {
			struct insight_event_header *h =
				begin(INSIGHT_EV_FORK, sizeof(struct insight_fork_payload));
			if (h) {
				struct insight_fork_payload *f = (void *)(h + 1);
				f->parent_pid = (uint32_t)parent;
				f->reserved = 0;
				notify(h);
			}
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
	if (h) {
		struct insight_exit_payload *e = (void *)(h + 1);
		e->status = status;
		e->reserved = 0;
		notify(h);
	}
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

/* A return from main() reaches exit() inside libc, not through us. */
__attribute__((destructor)) static void probes_fini(void)
{
	raise_exit(-1);
}
