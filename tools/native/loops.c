/* CPU-bound loops without system calls, for tools/bench native: the same
 * binary runs natively and in the guest, and times itself.
 *
 *   loops fp|chase|hash N
 *
 * fp:    floating-point multiply-add over a 32 KiB array, N passes
 * chase: N steps of a pointer chase through a 256 KiB index table
 * hash:  N rounds of a register-only hash
 *
 * Prints "loops: KIND NS ns, user U system S ticks, timer T" where NS is
 * the loop's CLOCK_MONOTONIC time, U and S the process's user and system
 * time in clock ticks (/proc/self/stat) over the loop, and T the timer
 * interrupts counted in /proc/interrupts over it (-1 where no IRQ 0 line
 * says "timer", as on most hosts).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../images/workloads/self_measure.h"
#include "cycle.h"

#define FP_LEN (32 * 1024 / sizeof(double))
#define CHASE_LEN (256 * 1024 / sizeof(uint32_t))

static double fp(uint64_t n)
{
	static double a[FP_LEN];
	for (size_t i = 0; i < FP_LEN; i++)
		a[i] = (double)i * 0.5;
	double s = 0;
	for (uint64_t r = 0; r < n; r++)
		for (size_t i = 0; i < FP_LEN; i++) {
			a[i] = a[i] * 0.999999 + 0.000001;
			s += a[i];
		}
	return s;
}

static uint64_t chase(uint64_t n)
{
	static uint32_t next[CHASE_LEN];
	one_cycle(next, CHASE_LEN);
	uint32_t at = 0;
	for (uint64_t i = 0; i < n; i++)
		at = next[at];
	return at;
}

static uint64_t hash(uint64_t n)
{
	uint64_t h = 1469598103934665603u;
	for (uint64_t i = 0; i < n; i++) {
		h ^= i;
		h *= 1099511628211u;
		h = (h << 7) | (h >> 57);
	}
	return h;
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: loops fp|chase|hash N\n");
		return 2;
	}
	uint64_t n = strtoull(argv[2], NULL, 10);
	long u0, s0, u1, s1;
	long t0 = timer_irqs();
	cpu_ticks(&u0, &s0);
	uint64_t start = now_ns();
	double result;
	if (!strcmp(argv[1], "fp"))
		result = fp(n);
	else if (!strcmp(argv[1], "chase"))
		result = (double)chase(n);
	else if (!strcmp(argv[1], "hash"))
		result = (double)hash(n);
	else {
		fprintf(stderr, "loops: unknown kind %s\n", argv[1]);
		return 2;
	}
	uint64_t ns = now_ns() - start;
	cpu_ticks(&u1, &s1);
	long t1 = timer_irqs();
	printf("loops: %s %llu ns, user %ld system %ld ticks, timer %ld (result %g)\n", argv[1],
	       (unsigned long long)ns, u1 - u0, s1 - s0, t0 < 0 || t1 < 0 ? -1 : t1 - t0, result);
	return 0;
}
