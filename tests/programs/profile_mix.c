/*
 * profile_mix [ROUNDS [MODE]]: a program as a user writes and builds it,
 * for checking the sampling profiler where its functions interleave.
 *
 * Two threads each run ROUNDS rounds (default 40); in "mixed" mode (the
 * default) a round calls, in turn, arith() (a floating-point multiply-add
 * over a 16 KiB array), chase() (a pointer chase through a 16 KiB index
 * table) and hash() (FNV-1a over a counter, in registers). Their amounts
 * of work are read at run time, as a real program's are, so the loops
 * compare against registers. The arrays fit the first-level cache
 * together: with profile_split's 256 KiB table, the chase took 5-6 pp
 * more of the time interleaved than alone, natively, each call fetching
 * the table again, so that no profile of the interleaved rounds could
 * match the functions' times alone.
 *
 * "arith", "chase" or "hash" runs only that function, for the same
 * rounds; "none" starts and ends the threads with no work. A function's
 * share of the mixed run is its time alone less that of "none" (in the
 * guest, whose kernel is slow, starting and ending the two threads in a
 * fresh process took 0.2-0.5 s), over the sum of the three: timing a call
 * inside the mixed run would count the other thread's time while it is
 * preempted. On a host others use, runs minutes apart differ by several
 * per cent.
 *
 * "alone" times each function alone in the very run it profiles. In each
 * of PASSES passes (the rounds spread over them) both threads run their
 * rounds of arith_alone(), then (after a barrier) of chase_alone(), then
 * of hash_alone(), then nothing, each phase timed; then the same rounds
 * as in "mixed". The *_alone functions are the same code under other
 * names: a profile's rows arith, chase and hash are the mixed rounds'.
 * It prints each pass's phases, "profile_mix: pass K arith A ns chase C
 * ns hash H ns none E ns"; E, the empty phase's, is what a barrier costs
 * each of the others (in the guest a few milliseconds a phase). On a
 * host others use, a phase now and then takes far longer than its
 * neighbours' (the host ran something else meanwhile, on the whole
 * phase): a split of the passes' medians leaves those out, where a
 * profile of the interleaved rounds spreads them over all three.
 *
 * Every mode prints "profile_mix: MODE ROUNDS rounds NS ns (result R)",
 * NS the CLOCK_MONOTONIC time from the threads' start to their end.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../tools/native/cycle.h"

#define FP_LEN (16 * 1024 / sizeof(double))
#define CHASE_LEN (16 * 1024 / sizeof(uint32_t))

/* Work per call, read at run time: about 40 / 35 / 25 % of the time natively. */
static volatile long arith_passes = 3740;
static volatile long chase_steps = 3000000;
static volatile uint64_t hash_rounds = 2600000;

#define PASSES 10

static int rounds = 40;
static int run_arith, run_chase, run_hash, alone;
static pthread_barrier_t phase_barrier;
/* When each phase ended (alone): [0] the start, then arith, chase, hash,
 * the empty phase and the mixed rounds of each pass. */
static uint64_t phase_end[1 + 5 * PASSES];
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

/* Each function's code, compiled into two functions of their own (noipa:
 * neither inlined into its caller nor merged with its twin). */
static inline __attribute__((always_inline)) double arith_loop(double *a, long passes)
{
	double s = 0;
	for (long r = 0; r < passes; r++)
		for (size_t i = 0; i < FP_LEN; i++) {
			a[i] = a[i] * 0.999999 + 0.000001;
			s += a[i];
		}
	return s;
}

static inline __attribute__((always_inline)) uint32_t chase_loop(uint32_t at, long steps)
{
	while (steps-- > 0)
		at = next_slot[at];
	return at;
}

/* FNV-1a over the round's counter. */
static inline __attribute__((always_inline)) uint64_t hash_loop(uint64_t h, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++) {
		h ^= i;
		h *= 1099511628211u;
	}
	return h;
}

__attribute__((noipa)) static double arith(double *a, long passes)
{
	return arith_loop(a, passes);
}

__attribute__((noipa)) static uint32_t chase(uint32_t at, long steps)
{
	return chase_loop(at, steps);
}

__attribute__((noipa)) static uint64_t hash(uint64_t h, uint64_t n)
{
	return hash_loop(h, n);
}

__attribute__((noipa)) static double arith_alone(double *a, long passes)
{
	return arith_loop(a, passes);
}

__attribute__((noipa)) static uint32_t chase_alone(uint32_t at, long steps)
{
	return chase_loop(at, steps);
}

__attribute__((noipa)) static uint64_t hash_alone(uint64_t h, uint64_t n)
{
	return hash_loop(h, n);
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
	if (alone)
		next_phase(0);
	for (int pass = 0; alone && pass < PASSES; pass++) {
		int n = rounds / PASSES + (pass < rounds % PASSES);
		for (int r = 0; r < n; r++)
			s += arith_alone(w->a, arith_passes);
		next_phase(1 + 5 * pass);
		for (int r = 0; r < n; r++)
			at = chase_alone(at, chase_steps);
		next_phase(2 + 5 * pass);
		for (int r = 0; r < n; r++)
			h = hash_alone(h, hash_rounds);
		next_phase(3 + 5 * pass);
		next_phase(4 + 5 * pass);
		for (int r = 0; r < n; r++) {
			s += arith(w->a, arith_passes);
			at = chase(at, chase_steps);
			h = hash(h, hash_rounds);
		}
		/* The next pass's phases start together. */
		next_phase(5 + 5 * pass);
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
	one_cycle(next_slot, CHASE_LEN);
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
	for (int pass = 0; alone && pass < PASSES; pass++) {
		const uint64_t *e = phase_end + 5 * pass;
		printf("profile_mix: pass %d arith %llu ns chase %llu ns hash %llu ns none %llu ns\n",
		       pass + 1, (unsigned long long)(e[1] - e[0]), (unsigned long long)(e[2] - e[1]),
		       (unsigned long long)(e[3] - e[2]), (unsigned long long)(e[4] - e[3]));
	}
	printf("profile_mix: %s %d rounds %llu ns (result %llx)\n", mode, rounds,
	       (unsigned long long)ns, (unsigned long long)(workers[0].result ^ workers[1].result));
	return 0;
}
