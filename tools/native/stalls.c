/*
 * The time a CPU-bound user-mode loop does not run, by the TSC: every gap
 * of over 5 us between two consecutive reads is time the task was stopped
 * (the host's own preemption, a guest interrupt, a hypervisor's kick).
 *
 *   stalls SECONDS
 *
 * prints "stalls: N gaps in S s, mean M us, total T ms" and a histogram.
 * User-mode RDTSC is not trapped on the hosts this measures, so each read
 * costs nanoseconds. TSC values are kept with bit 63 flipped: insight's
 * recorder declines to stop a task whose registers hold a TSC value (no
 * replay would find it again), and such a loop would be kicked again and
 * again while an interrupt waits.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* The TSC with bit 63 flipped; no register holds the raw value after. */
static inline uint64_t tsc(void)
{
	uint64_t r;
	__asm__ volatile("rdtsc; shl $32, %%rdx; or %%rdx, %%rax; btc $63, %%rax; xor %%edx, %%edx"
			 : "=&a"(r)
			 :
			 : "rdx", "cc");
	return r;
}

/* TSC ticks a nanosecond, over 50 ms of the clock. */
__attribute__((noinline)) static double ticks_per_ns(void)
{
	uint64_t c0 = now_ns(), t0 = tsc();
	while (now_ns() - c0 < 50000000)
		;
	return (double)(tsc() - t0) / (double)(now_ns() - c0);
}

int main(int argc, char **argv)
{
	static const double bounds_us[] = {20, 40, 60, 80, 100, 200, 1000};
	enum { BINS = sizeof(bounds_us) / sizeof(bounds_us[0]) + 1 };
	double secs = argc > 1 ? atof(argv[1]) : 2;
	if (secs <= 0 || secs > 600) {
		fprintf(stderr, "usage: stalls SECONDS (0 < SECONDS <= 600)\n");
		return 2;
	}
	double ghz = ticks_per_ns();
	uint64_t threshold = (uint64_t)(5000 * ghz);
	uint64_t end = tsc() + (uint64_t)(secs * 1e9 * ghz);
	uint64_t prev = tsc(), gaps = 0, total = 0, longest = 0, hist[BINS] = {0}, h = 1;
	while (prev < end) {
		/* A few hundred nanoseconds of work between reads. */
		for (int k = 0; k < 200; k++) {
			h = h * 6364136223846793005ull + 1442695040888963407ull;
			h ^= h >> 29;
		}
		__asm__ volatile("" : : "r"(h));
		uint64_t t = tsc(), gap = t - prev;
		prev = t;
		if (gap <= threshold)
			continue;
		gaps++;
		total += gap;
		if (gap > longest)
			longest = gap;
		int bin = 0;
		while (bin < BINS - 1 && gap / ghz / 1000 >= bounds_us[bin])
			bin++;
		hist[bin]++;
	}
	printf("stalls: %lu gaps in %.1f s, mean %.1f us, longest %.1f us, total %.2f ms;",
	       (unsigned long)gaps, secs, gaps ? total / ghz / (double)gaps / 1000 : 0,
	       longest / ghz / 1000, total / ghz / 1e6);
	for (int i = 0; i < BINS; i++) {
		if (i < BINS - 1)
			printf(" <%.0f us %lu", bounds_us[i], (unsigned long)hist[i]);
		else
			printf(" longer %lu", (unsigned long)hist[i]);
	}
	printf("\n");
	return 0;
}
