/*
 * tick_count THREADS ROUNDS: THREADS threads (1 or more) each run ROUNDS
 * rounds of a register-only hash, with no system call in the loop, and the
 * program counts what the guest kernel's timer did meanwhile. It prints
 *
 *   tick_count: threads T ns NS timer IRQS user U system S
 *
 * NS is the CLOCK_MONOTONIC time from the start of the threads to the end
 * of the last, IRQS the timer interrupts counted in /proc/interrupts (IRQ
 * 0) over it, U and S the process's user and system time in clock ticks
 * (/proc/self/stat, all threads). On a kernel that stops its tick while a
 * single task runs in user mode, one thread sees few timer interrupts and
 * is still charged its whole run as user time; two threads keep the tick.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "self_measure.h"

static uint64_t rounds;
static uint64_t results[64];

static void *hash(void *arg)
{
	uint64_t id = (uint64_t)(uintptr_t)arg;
	uint64_t h = 1469598103934665603u ^ id;
	for (uint64_t i = 0; i < rounds; i++) {
		h ^= i;
		h *= 1099511628211u;
		h = (h << 7) | (h >> 57);
	}
	results[id] = h;
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: tick_count THREADS ROUNDS\n");
		return 2;
	}
	int threads = atoi(argv[1]);
	rounds = strtoull(argv[2], NULL, 10);
	if (threads < 1 || threads > 64) {
		fprintf(stderr, "tick_count: THREADS must be 1 to 64\n");
		return 2;
	}
	pthread_t tid[64];
	long u0, s0, u1, s1;
	/*
	 * The interrupts are counted over the timed run only: reading
	 * /proc takes system calls, and the kernel's tick runs while they do
	 * (much longer on a loaded host), which would count interrupts the
	 * run's time does not include.
	 */
	cpu_ticks(&u0, &s0);
	long t0 = timer_irqs();
	uint64_t start = now_ns();
	/* One thread runs in main, so THREADS=1 is a single task. */
	for (int i = 1; i < threads; i++)
		if (pthread_create(&tid[i], NULL, hash, (void *)(uintptr_t)i)) {
			fprintf(stderr, "tick_count: pthread_create failed\n");
			return 1;
		}
	hash((void *)0);
	for (int i = 1; i < threads; i++)
		pthread_join(tid[i], NULL);
	uint64_t ns = now_ns() - start;
	long t1 = timer_irqs();
	cpu_ticks(&u1, &s1);
	uint64_t all = 0;
	for (int i = 0; i < threads; i++)
		all ^= results[i];
	printf("tick_count: threads %d ns %llu timer %ld user %ld system %ld (result %llx)\n",
	       threads, (unsigned long long)ns, t0 < 0 || t1 < 0 ? -1 : t1 - t0, u1 - u0, s1 - s0,
	       (unsigned long long)all);
	return 0;
}
