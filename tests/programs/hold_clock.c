/*
 * hold_clock [ROUNDS]: two threads each take a lock ROUNDS times (default
 * 40), hold it while spinning until their own clock says 2 ms passed
 * (reading CLOCK_MONOTONIC every 2000 iterations), then sleep 1 ms; the
 * time each hold measured from the first clock read after the lock to the
 * last before the unlock is what the program calls its hold. Prints
 * "hold_clock: holds N avg_ns A max_ns M", then each hold's first and last
 * reading, "hold START END", in the order they were taken.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static pthread_mutex_t held = PTHREAD_MUTEX_INITIALIZER;
static uint64_t total_ns, max_ns;
static long holds, rounds = 40;
static uint64_t hold_start[200000], hold_end[200000];

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void *worker(void *arg)
{
	(void)arg;
	for (long r = 0; r < rounds; r++) {
		pthread_mutex_lock(&held);
		uint64_t start = now_ns(), end = start;
		volatile unsigned long spin = 0;
		while (end - start < 2000000) {
			for (int i = 0; i < 2000; i++)
				spin += i;
			end = now_ns();
		}
		total_ns += end - start;
		if (end - start > max_ns)
			max_ns = end - start;
		hold_start[holds] = start;
		hold_end[holds] = end;
		holds++;
		pthread_mutex_unlock(&held);
		struct timespec pause = { 0, 1000000 };
		nanosleep(&pause, NULL);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc > 1)
		rounds = strtol(argv[1], NULL, 10);
	if (rounds < 1 || rounds > 100000)
		return 2;
	pthread_t t[2];
	for (int i = 0; i < 2; i++)
		pthread_create(&t[i], NULL, worker, NULL);
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	printf("hold_clock: holds %ld avg_ns %llu max_ns %llu\n", holds,
	       (unsigned long long)(total_ns / (uint64_t)holds), (unsigned long long)max_ns);
	for (long i = 0; i < holds; i++)
		printf("hold %llu %llu\n", (unsigned long long)hold_start[i],
		       (unsigned long long)hold_end[i]);
	return 0;
}
