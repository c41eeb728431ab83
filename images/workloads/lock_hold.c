/*
 * lock_hold [ROUNDS [HOLD_US]]: takes a mutex ROUNDS times (default 40)
 * and holds it each time for a busy loop of HOLD_US microseconds of
 * user-mode work (default 8000; calibrated below) with no system call
 * inside, then sleeps a millisecond.
 * It reads its clock just before each request and just after each
 * release, never while holding the lock, and prints the average of those
 * spans less what two clock readings in a row take ("lock_hold: rounds R
 * hold_avg_ns N read_ns C"): the lock is never contended, so that is the
 * hold time plus the lock calls' own few microseconds. A clock reading
 * costs a system call, which the guest kernel makes slow (C, the least
 * of 20 pairs: from one reading's value to the next's, the return from
 * the first call and the entry into the second). The loop runs alone on
 * the guest's CPU and makes no system call, so while the lock is held no
 * deterministic exit happens (a timer interrupt now and then, whose
 * handling the hold then includes): what a lock tool says of the hold
 * time shows how it times events raised between exits.
 *
 * Then prints each round's span, from the reading before the request to
 * the one after the release, as it was ("lock_hold: round R ns N"). A
 * lock tool times the request at the first reading (an exit) or later and
 * the release before the second: its hold is never longer than the span.
 * The spans also hold what the second reading costs (its entry into the
 * kernel, which the least of back-to-back pairs underestimates) and any
 * timer interrupt delivered at that entry; the hold is never shorter
 * than HOLD_US, the loop's own work. On a loaded host the guest kernel's
 * work around the readings can take longer than the hold itself.
 *
 * One untimed lock and unlock come first: a probe library's first call on
 * a thread sets itself up (finding the thread's stack reads
 * /proc/self/maps), which a timed round would count as holding.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static volatile uint64_t sink;

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void spin(uint64_t iterations)
{
	for (uint64_t i = 0; i < iterations; i++)
		sink += i;
}

/*
 * Iterations of spin() for HOLD_US microseconds of user-mode work: from
 * the fastest of ten runs of about 10 ms each, less a clock reading's
 * cost. An interrupt the guest kernel takes during a run (milliseconds of
 * work on a host that interprets the guest's kernel, more when the host
 * is loaded and the guest's timers fall behind) makes that run look
 * slower; calibrated from one such run, the loop was a third of HOLD_US
 * long and the rounds' spans mostly the kernel's work around the clock
 * readings.
 */
static uint64_t calibrate(uint64_t hold_us, uint64_t read_ns)
{
	uint64_t n = 1000, took;
	for (;;) {
		uint64_t t0 = now_ns();
		spin(n);
		took = now_ns() - t0;
		if (took >= 10000000u)
			break;
		n *= 2;
	}
	for (int i = 0; i < 10; i++) {
		uint64_t t0 = now_ns();
		spin(n);
		uint64_t t = now_ns() - t0;
		if (t < took)
			took = t;
	}
	if (took > 2 * read_ns)
		took -= read_ns;
	return n * hold_us * 1000 / took;
}

int main(int argc, char **argv)
{
	long rounds = argc > 1 ? atol(argv[1]) : 40;
	long hold_us = argc > 2 ? atol(argv[2]) : 8000;
	const struct timespec pause = {0, 1000000};
	uint64_t total = 0;

	if (rounds < 1 || hold_us < 1) {
		fprintf(stderr, "usage: lock_hold [ROUNDS [HOLD_US]]\n");
		return 2;
	}
	uint64_t read_ns = UINT64_MAX;
	for (int i = 0; i < 20; i++) {
		uint64_t a = now_ns(), b = now_ns();
		if (b - a < read_ns)
			read_ns = b - a;
	}
	uint64_t iterations = calibrate((uint64_t)hold_us, read_ns);
	uint64_t *spans = calloc((size_t)rounds, sizeof *spans);
	if (!spans) {
		perror("lock_hold: calloc");
		return 1;
	}
	pthread_mutex_lock(&lock);
	pthread_mutex_unlock(&lock);
	for (long r = 0; r < rounds; r++) {
		uint64_t t0 = now_ns();
		pthread_mutex_lock(&lock);
		spin(iterations);
		pthread_mutex_unlock(&lock);
		spans[r] = now_ns() - t0;
		total += spans[r];
		nanosleep(&pause, NULL);
	}
	uint64_t avg = total / (uint64_t)rounds;
	printf("lock_hold: rounds %ld hold_avg_ns %llu read_ns %llu\n", rounds,
	       (unsigned long long)(avg > read_ns ? avg - read_ns : 0),
	       (unsigned long long)read_ns);
	for (long r = 0; r < rounds; r++)
		printf("lock_hold: round %ld ns %llu\n", r, (unsigned long long)spans[r]);
	free(spans);
	return 0;
}
