/*
 * The insight probe ABI, version 1: the layout of an event in a probe's
 * buffer. docs/events.md is the reference; the hypervisor's parser
 * (crates/events) and the guest kernel's patch use the same layout.
 *
 * All fields are little-endian. A probe writes an event into a buffer that
 * does not cross a page boundary, puts the buffer's address in RAX and
 * calls the probe gate (below). Where there is no gate, it also puts
 * INSIGHT_EVENTNOTIFY in EBX and executes int3 -- or, when the guest
 * kernel granted it the port (ioperm), a 32-bit OUT to INSIGHT_EVENT_PORT,
 * which reaches the hypervisor without entering the guest kernel.
 */
#ifndef INSIGHT_EVENTS_H
#define INSIGHT_EVENTS_H

#include <stdint.h>

#define INSIGHT_EVENTNOTIFY 0x54564e45u /* "ENVT" */
#define INSIGHT_EVENT_MAGIC 0x45534e49u /* "INSE" */
#define INSIGHT_EVENT_VERSION 1
#define INSIGHT_EVENT_PORT 0xf04

/*
 * The probe gate (docs/events.md): the hypervisor keeps this header at
 * INSIGHT_GATE_HEADER_OFFSET in the code page of the [insight] mapping,
 * and the gate's code at code_offset: call it with the event's address in
 * RAX. It returns at once while recording and leaves the guest at replay;
 * it changes no register and no flag.
 */
#define INSIGHT_GATE_MAGIC 0x47534e49u /* "INSG" */
#define INSIGHT_GATE_VERSION 1
#define INSIGHT_GATE_HEADER_OFFSET 0xfc0
/* The [insight] mapping: code, data and exit pages. */
#define INSIGHT_GATE_MAPPING_PAGES 3

struct insight_gate {
	uint32_t magic;
	uint32_t version;
	uint32_t code_offset; /* from the start of the page */
	/* The heap gate's code, for the heap events (ALLOC, FREE, HEAPCALL):
	 * it leaves the guest only in replays that collect them. 0 when the
	 * hypervisor offers none: then no heap event is raised. */
	uint32_t heap_code_offset;
};

enum insight_event_kind {
	INSIGHT_EV_LOCK = 1,
	INSIGHT_EV_LOCK_RET = 2,
	INSIGHT_EV_TRYLOCK = 3,
	INSIGHT_EV_TRYLOCK_RET = 4,
	INSIGHT_EV_TIMEDLOCK = 5,
	INSIGHT_EV_TIMEDLOCK_RET = 6,
	INSIGHT_EV_UNLOCK = 7,
	INSIGHT_EV_LOCKINIT = 8,
	INSIGHT_EV_THREADCREATE = 9,
	INSIGHT_EV_FORK = 10,
	INSIGHT_EV_EXIT = 11,
	INSIGHT_EV_SYMBOL = 12,
	INSIGHT_EV_CONTEXTSWITCH = 13, /* from the guest kernel's switch ring */
	INSIGHT_EV_SAMPLE = 14, /* the host's */
	INSIGHT_EV_THREADJOIN = 15,
	INSIGHT_EV_THREADSPAWN = 16,
	INSIGHT_EV_MEMACCESS = 17, /* the host's */
	INSIGHT_EV_HEAPCALL = 18,
	INSIGHT_EV_ALLOC = 19,
	INSIGHT_EV_FREE = 20,
	INSIGHT_EV_PROBE = 21, /* the host's */
	INSIGHT_EV_PROBE_RET = 22, /* the host's */
	/* Synchronisation other than mutexes (struct insight_sync_payload). */
	INSIGHT_EV_CONDWAIT = 23, /* cond_wait/timedwait/clockwait called */
	INSIGHT_EV_CONDWAIT_RET = 24, /* ... returned: the mutex is held again */
	INSIGHT_EV_CONDSIGNAL = 25,
	INSIGHT_EV_CONDBROADCAST = 26,
	INSIGHT_EV_BARRIER = 27, /* pthread_barrier_wait called */
	INSIGHT_EV_BARRIER_RET = 28,
	INSIGHT_EV_RWLOCK = 29, /* a read or write lock asked for (flags) */
	INSIGHT_EV_RWLOCK_RET = 30,
	INSIGHT_EV_RWUNLOCK = 31,
	INSIGHT_EV_SEMWAIT = 32, /* sem_wait, sem_trywait, sem_timedwait (flags) */
	INSIGHT_EV_SEMWAIT_RET = 33,
	INSIGHT_EV_SEMPOST = 34,
};

/* How a sync call asks (insight_sync_payload.flags). */
enum insight_sync_flags {
	INSIGHT_SYNC_WRITE = 1, /* RWLOCK: a write lock (else a read lock) */
	INSIGHT_SYNC_TRY = 2, /* never waits: trylock, trywait */
	INSIGHT_SYNC_TIMED = 4, /* gives up at a deadline */
};

/* Which allocation function a heap event is about. */
enum insight_heap_function {
	INSIGHT_HEAP_MALLOC = 1,
	INSIGHT_HEAP_CALLOC = 2,
	INSIGHT_HEAP_REALLOC = 3,
	INSIGHT_HEAP_FREE = 4,
	INSIGHT_HEAP_MMAP = 5,
	INSIGHT_HEAP_MUNMAP = 6,
	INSIGHT_HEAP_MEMALIGN = 7, /* posix_memalign, aligned_alloc, memalign */
};

struct insight_event_header {
	uint32_t magic;
	uint16_t version;
	uint16_t kind;
	uint32_t size; /* header and payload, bytes */
	uint32_t pid;
	uint32_t lwpid;
	uint32_t flags; /* 0 */
	uint64_t timestamp; /* 0: the hypervisor assigns it */
	char comm[16];
};

/* LOCK .. LOCKINIT */
struct insight_lock_payload {
	uint64_t lock; /* the mutex's address */
	uint64_t caller; /* return address into the caller */
	int32_t result; /* the *_RET events: the call's return value */
	uint32_t reserved;
};

/*
 * CONDWAIT .. SEMPOST. The object is the condition variable, barrier,
 * read-write lock or semaphore; CONDWAIT and CONDWAIT_RET also name the
 * mutex the wait releases and takes again (pthread_cond_wait returns with
 * it held, whatever its result). A request (CONDWAIT, BARRIER, RWLOCK,
 * SEMWAIT) is followed in its thread by its *_RET, with the result.
 */
struct insight_sync_payload {
	uint64_t object;
	uint64_t caller; /* return address into the caller */
	uint64_t mutex; /* CONDWAIT, CONDWAIT_RET; else 0 */
	int32_t result; /* the *_RET events: the call's return value */
	uint32_t flags; /* enum insight_sync_flags */
};

struct insight_threadcreate_payload {
	uint32_t parent_lwpid;
	/* Events the creator had raised when it called pthread_create: where
	 * the creation lies in its stream of events. */
	uint32_t creator_events;
	uint64_t start_routine;
};

/* Raised by the creator as it calls pthread_create (the new thread's
 * THREADCREATE names the creator's event count right after it). */
struct insight_threadspawn_payload {
	uint64_t start_routine;
	uint64_t caller; /* return address into pthread_create's caller */
};

struct insight_threadjoin_payload {
	uint32_t joined_lwpid;
	uint32_t reserved;
};

struct insight_fork_payload {
	uint32_t parent_pid;
	uint32_t reserved;
};

struct insight_exit_payload {
	int32_t status;
	uint32_t reserved;
};

/*
 * HEAPCALL, raised through the heap gate as an allocation function is
 * called, and ALLOC or FREE as it returns: every HEAPCALL is followed in
 * its thread by the ALLOC or FREE that ends the call (a realloc that
 * returned a block: FREE of the old one, if any, then ALLOC of the new).
 * The memory accesses between them are the allocator's own.
 */
struct insight_heap_payload {
	/* ALLOC: the block (0: the call failed); FREE: the block freed (0:
	 * the call failed); HEAPCALL: realloc's, free's or munmap's pointer */
	uint64_t addr;
	/* ALLOC and HEAPCALL: the bytes asked for; FREE: munmap's length,
	 * else 0 */
	uint64_t size;
	uint64_t caller; /* return address into the caller */
	uint32_t function; /* enum insight_heap_function */
	uint32_t reserved;
};

/* One loaded object: its load base and path (path_len bytes, no NUL). */
struct insight_symbol_payload {
	uint64_t base;
	uint32_t path_len;
	uint32_t reserved;
	char path[];
};

#endif
