/*
 * profile_split [ROUNDS [arith|chase|hash]]: a program whose profile is
 * known, for checking the sampling profiler.
 *
 * Two threads each run ROUNDS rounds (default 40); a round calls, in turn,
 * arith() (a floating-point multiply-add over a 32 KiB array), chase() (a
 * pointer chase through a 256 KiB index table) and hash() (a register-only
 * hash), each a fixed amount of work, sized for about 40 / 35 / 25 % of the
 * CPU time natively. No function makes a system call.
 *
 * Naming one function runs only that one, for the same rounds: its time
 * alone. The split the guest measures is each function's time alone over
 * the sum of the three (the truth a profile is checked against: timing a
 * function inside the mixed run would count the other thread's time while
 * it is preempted).
 *
 * "phased" runs the three in phases instead: both threads all the rounds
 * of arith(), then (after a barrier) of chase(), then of hash(); the
 * phases' lengths are each function's time alone in the very run a
 * profile is taken of, printed as "profile_split: phases arith A ns chase
 * C ns hash H ns". The rounds are run in PASSES passes of the three
 * phases, each printed as "profile_split: pass K arith A ns chase C ns
 * hash H ns" (the phases line is their sum): how much a phase's time
 * varies from pass to pass on a shared host.
 *
 * Prints "profile_split: FUNCS ROUNDS rounds NS ns (result R)", NS the
 * CLOCK_MONOTONIC time from the threads' start to their end.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FP_LEN (32 * 1024 / sizeof(double))
#define CHASE_LEN (256 * 1024 / sizeof(uint32_t))

/* Work per call: about 12 / 10.5 / 7.5 ms natively on the development hosts. */
#define ARITH_PASSES 1870
#define CHASE_STEPS 820000
#define HASH_ROUNDS 1980000

static int rounds = 40;
static int run_arith = 1, run_chase = 1, run_hash = 1;
static int phased;
static pthread_barrier_t phase_barrier;
#define PASSES 5
/* When each phase ended (phased): [0] the start, then arith, chase, hash
 * of each pass. */
static uint64_t phase_end[1 + 3 * PASSES];
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

__attribute__((noinline)) static double arith(double *a)
{
	double s = 0;
	for (int r = 0; r < ARITH_PASSES; r++)
		for (size_t i = 0; i < FP_LEN; i++) {
			a[i] = a[i] * 0.999999 + 0.000001;
			s += a[i];
		}
	return s;
}

__attribute__((noinline)) static uint32_t chase(uint32_t at)
{
	for (long i = 0; i < CHASE_STEPS; i++)
		at = next_slot[at];
	return at;
}

__attribute__((noinline)) static uint64_t hash(uint64_t h)
{
	for (uint64_t i = 0; i < HASH_ROUNDS; i++) {
		h ^= i;
		h *= 1099511628211u;
		h = (h << 7) | (h >> 57);
	}
	return h;
}

/* Both threads at the end of phase `p` (phased): the time it ended. */
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
	if (phased) {
		next_phase(0);
		for (int pass = 0; pass < PASSES; pass++) {
			/* The rounds, spread over the passes. */
			int n = rounds / PASSES + (pass < rounds % PASSES);
			for (int r = 0; r < n; r++)
				s += arith(w->a);
			next_phase(1 + 3 * pass);
			for (int r = 0; r < n; r++)
				at = chase(at);
			next_phase(2 + 3 * pass);
			for (int r = 0; r < n; r++)
				h = hash(h);
			next_phase(3 + 3 * pass);
		}
		w->result = h ^ at ^ (uint64_t)s;
		return NULL;
	}
	for (int r = 0; r < rounds; r++) {
		if (run_arith)
			s += arith(w->a);
		if (run_chase)
			at = chase(at);
		if (run_hash)
			h = hash(h);
	}
	w->result = h ^ at ^ (uint64_t)s;
	return NULL;
}

int main(int argc, char **argv)
{
	const char *only = argc > 2 ? argv[2] : NULL;
	if (argc > 1)
		rounds = atoi(argv[1]);
	if (rounds < 1 || argc > 3) {
		fprintf(stderr, "usage: profile_split [ROUNDS [arith|chase|hash|phased]]\n");
		return 2;
	}
	phased = only && !strcmp(only, "phased");
	if (only && !phased) {
		run_arith = !strcmp(only, "arith");
		run_chase = !strcmp(only, "chase");
		run_hash = !strcmp(only, "hash");
		if (!run_arith && !run_chase && !run_hash) {
			fprintf(stderr, "profile_split: unknown function %s\n", only);
			return 2;
		}
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
		fprintf(stderr, "profile_split: pthread_barrier_init failed\n");
		return 1;
	}
	uint64_t start = now_ns();
	for (int i = 0; i < 2; i++)
		if (pthread_create(&tid[i], NULL, work, &workers[i])) {
			fprintf(stderr, "profile_split: pthread_create failed\n");
			return 1;
		}
	for (int i = 0; i < 2; i++)
		pthread_join(tid[i], NULL);
	uint64_t ns = now_ns() - start;
	if (phased) {
		unsigned long long sum[3] = {0, 0, 0};
		for (int pass = 0; pass < PASSES; pass++) {
			const uint64_t *e = phase_end + 3 * pass;
			unsigned long long t[3] = {e[1] - e[0], e[2] - e[1], e[3] - e[2]};
			printf("profile_split: pass %d arith %llu ns chase %llu ns hash %llu ns\n",
			       pass + 1, t[0], t[1], t[2]);
			for (int i = 0; i < 3; i++)
				sum[i] += t[i];
		}
		printf("profile_split: phases arith %llu ns chase %llu ns hash %llu ns\n", sum[0],
		       sum[1], sum[2]);
	}
	printf("profile_split: %s %d rounds %llu ns (result %llx)\n", only ? only : "all", rounds,
	       (unsigned long long)ns, (unsigned long long)(workers[0].result ^ workers[1].result));
	return 0;
}
