/*
 * clock_sleep: prints clock_gettime and gettimeofday readings around
 * sleeps, and checks that time moves forward by at least the sleep.
 *
 *   clock_sleep [ROUNDS]
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long ns(clockid_t clock)
{
	struct timespec ts;
	clock_gettime(clock, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 5;
	int bad = 0;

	for (int i = 0; i < rounds; i++) {
		long sleep_ms = 10L << (i % 4);
		struct timeval tv0, tv1;
		long long m0 = ns(CLOCK_MONOTONIC), r0 = ns(CLOCK_REALTIME);
		gettimeofday(&tv0, NULL);
		struct timespec req = { 0, sleep_ms * 1000000L };
		nanosleep(&req, NULL);
		long long m1 = ns(CLOCK_MONOTONIC), r1 = ns(CLOCK_REALTIME);
		gettimeofday(&tv1, NULL);
		long long tv_us = (tv1.tv_sec - tv0.tv_sec) * 1000000LL + (tv1.tv_usec - tv0.tv_usec);
		printf("clock_sleep: slept %ld ms: monotonic %lld.%09lld -> +%lld ns, realtime %lld.%09lld -> +%lld ns, gettimeofday +%lld us\n",
		       sleep_ms, m0 / 1000000000LL, m0 % 1000000000LL, m1 - m0,
		       r0 / 1000000000LL, r0 % 1000000000LL, r1 - r0, tv_us);
		if (m1 - m0 < sleep_ms * 1000000LL)
			bad++;
	}
	printf("clock_sleep: %s\n", bad ? "TIME WENT BACKWARDS OR TOO SLOW" : "time advanced by at least every sleep");
	return bad ? 1 : 0;
}
