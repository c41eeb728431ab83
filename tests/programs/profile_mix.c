/*
 * profile_mix [ROUNDS [MODE]]: a program as a user writes and builds it,
 * for checking the sampling profiler where its functions interleave.
 *
 * Two threads each run ROUNDS rounds (default 40); in "mixed" mode (the
 * default) a round calls, in turn, arith() (a floating-point multiply-add
 * over a 32 KiB array), chase() (a pointer chase through a 256 KiB index
 * table) and hash() (FNV-1a over a counter, in registers). Their amounts
 * of work are read at run time, as a real program's are, so the loops
 * compare against registers.
 *
 * "arith", "chase" or "hash" runs only that function, for the same
 * rounds; "none" starts and ends the threads with no work. A function's
 * share of the mixed run is its time alone less that of "none" (in the
 * guest, whose kernel is slow, starting and ending the two threads in a
 * fresh process took 0.2-0.5 s), over the sum of the three: timing a call
 * inside the mixed run would count the other thread's time while it is
 * preempted.
 *
 * "alone" times each function alone in one run, without those costs:
 * both threads run their rounds of arith(), then (after a barrier) of
 * chase(), then of hash(), then nothing, in PASSES passes with the rounds
 * spread over them (so that a host busy for a second slows all three
 * alike). It prints "profile_mix: alone arith A ns chase C ns hash H ns
 * none E ns", each phase's time summed over the passes; E, the empty
 * phase's, is what a barrier costs each of the others (in the guest a few
 * milliseconds a phase) and is subtracted from them.
 *
 * Every mode but "alone" prints "profile_mix: MODE ROUNDS rounds NS ns
 * (result R)", NS the CLOCK_MONOTONIC time from the threads' start to
 * their end.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FP_LEN (32 * 1024 / sizeof(double))
#define CHASE_LEN (256 * 1024 / sizeof(uint32_t))

/* Work per call, read at run time: about 40 / 35 / 25 % of the time natively. */
static volatile long arith_passes = 1870;
static volatile long chase_steps = 1300000;
static volatile uint64_t hash_rounds = 2600000;

#define PASSES 5

static int rounds = 40;
static int run_arith, run_chase, run_hash, alone;
static pthread_barrier_t phase_barrier;
/* When each phase ended (alone): [0] the start, then arith, chase, hash
 * and the empty phase of each pass. */
static uint64_t phase_end[1 + 4 * PASSES];
static uint32_t next_slot[CHASE_LEN];

struct worker {
	double a[FP_LEN];
	uint64_t result;
};

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

__attribute__((noinline)) static double arith(double *a, long passes)
{
	double s = 0;
	for (long r = 0; r < passes; r++)
		for (size_t i = 0; i < FP_LEN; i++) {
			a[i] = a[i] * 0.999999 + 0.000001;
			s += a[i];
		}
	return s;
}

__attribute__((noinline)) static uint32_t chase(uint32_t at, long steps)
{
	while (steps-- > 0)
		at = next_slot[at];
	return at;
}

/* FNV-1a over the round's counter. */
__attribute__((noinline)) static uint64_t hash(uint64_t h, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++) {
		h ^= i;
		h *= 1099511628211u;
	}
	return h;
}

/* Both threads at the end of phase `p` (alone): the time it ended. */
static void next_phase(int p)
{
	if (pthread_barrier_wait(&phase_barrier) == PTHREAD_BARRIER_SERIAL_THREAD)
		phase_end[p] = now_ns();
	pthread_barrier_wait(&phase_barrier);
}

static void *work(void *arg)
{
	struct worker *w = arg;
	uint64_t h = 1469598103934665603u ^ (uintptr_t)w;
	uint32_t at = (uint32_t)((uintptr_t)w % CHASE_LEN);
	double s = 0;
	for (size_t i = 0; i < FP_LEN; i++)
		w->a[i] = (double)i * 0.5;
	if (alone) {
		next_phase(0);
		for (int pass = 0; pass < PASSES; pass++) {
			int n = rounds / PASSES + (pass < rounds % PASSES);
			for (int r = 0; r < n; r++)
				s += arith(w->a, arith_passes);
			next_phase(1 + 4 * pass);
			for (int r = 0; r < n; r++)
				at = chase(at, chase_steps);
			next_phase(2 + 4 * pass);
			for (int r = 0; r < n; r++)
				h = hash(h, hash_rounds);
			next_phase(3 + 4 * pass);
			next_phase(4 + 4 * pass);
		}
	}
	for (int r = 0; r < rounds && !alone; r++) {
		if (run_arith)
			s += arith(w->a, arith_passes);
		if (run_chase)
			at = chase(at, chase_steps);
		if (run_hash)
			h = hash(h, hash_rounds);
	}
	w->result = h ^ at ^ (uint64_t)s;
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc > 1)
		rounds = atoi(argv[1]);
	const char *mode = argc > 2 ? argv[2] : "mixed";
	int mixed = !strcmp(mode, "mixed");
	alone = !strcmp(mode, "alone");
	run_arith = mixed || !strcmp(mode, "arith");
	run_chase = mixed || !strcmp(mode, "chase");
	run_hash = mixed || !strcmp(mode, "hash");
	int known = alone || run_arith || run_chase || run_hash || !strcmp(mode, "none");
	if (!known || rounds < PASSES || argc > 3) {
		fprintf(stderr, "usage: profile_mix [ROUNDS [mixed|arith|chase|hash|none|alone]]\n");
		return 2;
	}
	/* One cycle through every slot, in a shuffled order (Sattolo). */
	for (uint32_t i = 0; i < CHASE_LEN; i++)
		next_slot[i] = i;
	uint64_t x = 88172645463325252u;
	for (uint32_t i = CHASE_LEN - 1; i > 0; i--) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		uint32_t j = (uint32_t)(x % i), t = next_slot[i];
		next_slot[i] = next_slot[j], next_slot[j] = t;
	}
	static struct worker workers[2];
	pthread_t tid[2];
	if (pthread_barrier_init(&phase_barrier, NULL, 2)) {
		fprintf(stderr, "profile_mix: pthread_barrier_init failed\n");
		return 1;
	}
	uint64_t start = now_ns();
	for (int i = 0; i < 2; i++)
		if (pthread_create(&tid[i], NULL, work, &workers[i])) {
			fprintf(stderr, "profile_mix: pthread_create failed\n");
			return 1;
		}
	for (int i = 0; i < 2; i++)
		pthread_join(tid[i], NULL);
	uint64_t ns = now_ns() - start;
	if (alone) {
		unsigned long long sum[4] = {0, 0, 0, 0};
		for (int pass = 0; pass < PASSES; pass++)
			for (int f = 0; f < 4; f++)
				sum[f] += phase_end[1 + 4 * pass + f] - phase_end[4 * pass + f];
		printf("profile_mix: alone arith %llu ns chase %llu ns hash %llu ns none %llu ns\n",
		       sum[0], sum[1], sum[2], sum[3]);
		return 0;
	}
	printf("profile_mix: %s %d rounds %llu ns (result %llx)\n", mode, rounds,
	       (unsigned long long)ns, (unsigned long long)(workers[0].result ^ workers[1].result));
	return 0;
}
