/*
 * compute_pair [SECONDS [WINDOW_MS]]: two threads compute without any
 * system call for about SECONDS (default 6) of CPU time between them,
 * printing a progress line per chunk of work, while a monitor thread
 * samples both threads' progress every 100 ms and prints, for each window
 * of WINDOW_MS (default 2000) of guest time, the share of the work each
 * thread did: on one CPU, the share of the CPU each got. The computation's
 * result is printed at the end, so a replay that ran a different
 * computation prints something else.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* Iterations per published progress step, and steps per progress line. */
#define STEP 4096
#define LINE_STEPS 100000

static _Atomic uint64_t steps[2];
static atomic_int done;
static uint64_t result[2];
static uint64_t target_steps;

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void *worker(void *arg)
{
	int id = (int)(intptr_t)arg;
	uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t)(id + 1);
	uint64_t n = 0;

	while (n < target_steps) {
		for (int i = 0; i < STEP; i++) {
			/* xorshift: no memory, no calls */
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
		}
		n++;
		atomic_store_explicit(&steps[id], n, memory_order_relaxed);
		if (n % LINE_STEPS == 0) {
			printf("thread %d: %llu steps, x=%016llx\n", id,
			       (unsigned long long)n, (unsigned long long)x);
			fflush(stdout);
		}
	}
	result[id] = x;
	atomic_fetch_add(&done, 1);
	return NULL;
}

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 6;
	uint64_t window_ms = argc > 2 ? strtoull(argv[2], NULL, 10) : 2000;
	pthread_t t[2];

	/* Calibrate: how many steps one thread does in a second alone (the
	 * clock is read around the loop only: it may be a system call). */
	uint64_t x = 1, start = now_ms(), cal = 20000;
	for (uint64_t n = 0; n < cal; n++) {
		for (int i = 0; i < STEP; i++) {
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
		}
	}
	uint64_t elapsed = now_ms() - start;
	uint64_t per_second = cal * 1000 / (elapsed ? elapsed : 1);
	target_steps = (uint64_t)(per_second * seconds / 2) + (x & 1);
	for (int i = 0; i < 2; i++)
		pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);

	uint64_t window_start = now_ms(), base[2] = { 0, 0 };
	int windows = 0, unfair = 0;
	while (atomic_load(&done) < 2) {
		usleep(100000);
		uint64_t now = now_ms();
		if (now - window_start < window_ms)
			continue;
		uint64_t s[2] = { atomic_load(&steps[0]), atomic_load(&steps[1]) };
		uint64_t d0 = s[0] - base[0], d1 = s[1] - base[1];
		/* Only windows in which both threads still had work. */
		if (s[0] < target_steps && s[1] < target_steps && d0 + d1 > 0) {
			double share = 100.0 * (double)d0 / (double)(d0 + d1);
			printf("window %d: thread 0 %.1f%%, thread 1 %.1f%%\n", windows,
			       share, 100.0 - share);
			windows++;
			if (share < 35 || share > 65)
				unfair++;
		}
		base[0] = s[0];
		base[1] = s[1];
		window_start = now;
	}
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	printf("compute_pair: results %016llx %016llx, %d windows, %d unfair\n",
	       (unsigned long long)result[0], (unsigned long long)result[1],
	       windows, unfair);
	return 0;
}
