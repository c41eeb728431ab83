/*
 * probe_abuse: raises malformed events, as a buggy or hostile probe would,
 * to check that insight counts them and carries on.
 *
 *   probe_abuse
 *
 * In order: a buffer address that is not mapped; an event that crosses a
 * page boundary; an unknown event kind; a kernel address as the buffer;
 * an int3 whose EBX is not EVENTNOTIFY (an ordinary breakpoint: the
 * program gets SIGTRAP and counts it); then one valid LOCKINIT event.
 * Prints what it did; the events themselves are only visible at replay.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "insight-events.h"

static volatile sig_atomic_t traps;

static void on_trap(int sig)
{
	(void)sig;
	traps++;
}

static void raise_at(void *buf, unsigned key)
{
	__asm__ volatile("int3" : : "a"(buf), "b"(key) : "memory");
}

static void fill(struct insight_event_header *h, unsigned kind, unsigned size)
{
	memset(h, 0, sizeof(*h));
	h->magic = INSIGHT_EVENT_MAGIC;
	h->version = INSIGHT_EVENT_VERSION;
	h->kind = (uint16_t)kind;
	h->size = size;
	h->pid = (uint32_t)getpid();
	h->lwpid = (uint32_t)syscall(SYS_gettid);
	strcpy(h->comm, "probe_abuse");
}

int main(void)
{
	signal(SIGTRAP, on_trap);
	char *pages = mmap(NULL, 2 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (pages == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	pages[0] = pages[4096] = 0;
	const unsigned lock_size =
		sizeof(struct insight_event_header) + sizeof(struct insight_lock_payload);

	/* 1. Not mapped (below mmap_min_addr). */
	raise_at((void *)0x100, INSIGHT_EVENTNOTIFY);
	/* 2. Crosses into the next page. */
	struct insight_event_header *h = (void *)(pages + 4096 - 40);
	fill(h, INSIGHT_EV_LOCK, lock_size);
	raise_at(h, INSIGHT_EVENTNOTIFY);
	/* 3. Unknown kind. */
	h = (void *)pages;
	fill(h, 999, lock_size);
	raise_at(h, INSIGHT_EVENTNOTIFY);
	/* 4. A kernel address. */
	raise_at((void *)0xffffffff81000000UL, INSIGHT_EVENTNOTIFY);
	/* 5. Garbage in EBX: a plain breakpoint. */
	raise_at(h, 0x12345678);
	/* 6. A valid event. */
	fill(h, INSIGHT_EV_LOCKINIT, lock_size);
	struct insight_lock_payload *p = (void *)(h + 1);
	memset(p, 0, sizeof(*p));
	p->lock = 0x1234;
	raise_at(h, INSIGHT_EVENTNOTIFY);

	printf("probe_abuse: 4 malformed events and 1 valid one raised; plain breakpoints trapped: %d\n", (int)traps);
	return traps == 1 ? 0 : 1;
}
