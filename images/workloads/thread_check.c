/*
 * thread_check [THREADS [ITERATIONS]]: threads, thread-local storage and
 * shared data under a mutex must stay correct across preemption and
 * sched_yield. Each thread keeps a private __thread state that it re-checks
 * after every yield, and adds to shared counters under a lock; the totals
 * are checked at the end. Exits 0 and prints "thread_check: ok ..." only if
 * every check held.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static __thread uint64_t tls_seed;
static __thread char tls_name[32] = "unset";

static void thread_name(char *buf, size_t len, uintptr_t id)
{
	snprintf(buf, len, "thread-%lu", (unsigned long)id);
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t shared_sum;
static uint64_t shared_count;
static long iterations = 2000;
static int failures;

static void *worker(void *arg)
{
	uintptr_t id = (uintptr_t)arg;
	char want_name[32];

	tls_seed = 0x9e3779b97f4a7c15ULL * (id + 1);
	thread_name(tls_name, sizeof(tls_name), id);
	thread_name(want_name, sizeof(want_name), id);
	for (long i = 0; i < iterations; i++) {
		uint64_t expect = 0x9e3779b97f4a7c15ULL * (id + 1) + (uint64_t)i;
		if (tls_seed != expect || strcmp(tls_name, want_name) != 0) {
			pthread_mutex_lock(&lock);
			failures++;
			fprintf(stderr, "thread_check: thread %lu lost its TLS at %ld\n",
				(unsigned long)id, i);
			pthread_mutex_unlock(&lock);
			return NULL;
		}
		tls_seed++;
		pthread_mutex_lock(&lock);
		shared_sum += id;
		shared_count++;
		pthread_mutex_unlock(&lock);
		if (i % 16 == 0)
			sched_yield();
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long threads = argc > 1 ? strtol(argv[1], NULL, 10) : 16;
	if (argc > 2)
		iterations = strtol(argv[2], NULL, 10);
	if (threads < 1 || threads > 1024 || iterations < 1) {
		fprintf(stderr, "usage: thread_check [THREADS(1-1024) [ITERATIONS]]\n");
		return 2;
	}
	pthread_t *tids = calloc((size_t)threads, sizeof(*tids));
	if (!tids)
		return 1;
	for (long t = 0; t < threads; t++)
		if (pthread_create(&tids[t], NULL, worker, (void *)(uintptr_t)t) != 0) {
			perror("pthread_create");
			return 1;
		}
	for (long t = 0; t < threads; t++)
		pthread_join(tids[t], NULL);

	uint64_t want_sum = (uint64_t)iterations * (uint64_t)(threads * (threads - 1) / 2);
	uint64_t want_count = (uint64_t)iterations * (uint64_t)threads;
	if (failures || shared_sum != want_sum || shared_count != want_count) {
		fprintf(stderr, "thread_check: FAILED failures=%d sum=%llu/%llu count=%llu/%llu\n",
			failures, (unsigned long long)shared_sum, (unsigned long long)want_sum,
			(unsigned long long)shared_count, (unsigned long long)want_count);
		return 1;
	}
	printf("thread_check: ok threads=%ld iterations=%ld sum=%llu\n", threads,
	       iterations, (unsigned long long)shared_sum);
	return 0;
}
