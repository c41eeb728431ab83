/*
 * spin_lock [THREADS [ITERATIONS]]: THREADS (default 4) threads take a
 * pthread spin lock ITERATIONS (default 2000) times each; inside the
 * critical section they make a system call, where the guest kernel may
 * preempt the holder, so the others spin in user mode until the holder
 * runs again. Checks the shared counter at the end and prints
 * "spin_lock: ok".
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

static pthread_spinlock_t lock;
static uint64_t counter;
static uint64_t checksum;
static long iterations = 2000;

static void *worker(void *arg)
{
	uint64_t id = (uint64_t)(uintptr_t)arg;
	for (long i = 0; i < iterations; i++) {
		pthread_spin_lock(&lock);
		uint64_t before = counter;
		/* The system call inside the critical section. */
		long ppid = syscall(SYS_getppid);
		counter = before + 1;
		checksum = checksum * 31 + id + (uint64_t)(ppid > 0);
		pthread_spin_unlock(&lock);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long threads = argc > 1 ? atol(argv[1]) : 4;
	if (argc > 2)
		iterations = atol(argv[2]);
	if (threads < 1 || threads > 64 || iterations < 1) {
		fprintf(stderr, "usage: spin_lock [THREADS (1-64) [ITERATIONS]]\n");
		return 2;
	}
	pthread_t t[64];
	pthread_spin_init(&lock, PTHREAD_PROCESS_PRIVATE);
	for (long i = 0; i < threads; i++)
		pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)i);
	for (long i = 0; i < threads; i++)
		pthread_join(t[i], NULL);
	uint64_t want = (uint64_t)threads * (uint64_t)iterations;
	printf("spin_lock: %s (counter %llu of %llu, checksum %016llx)\n",
	       counter == want ? "ok" : "FAILED", (unsigned long long)counter,
	       (unsigned long long)want, (unsigned long long)checksum);
	return counter == want ? 0 : 1;
}
