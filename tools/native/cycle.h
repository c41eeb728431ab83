/* A table of n indices that form one cycle through every slot, in a
 * shuffled order (Sattolo's algorithm, xorshift64 with a fixed seed: the
 * same table every run): a chase from any slot visits all n before it
 * comes back. Shared by loops.c, cold_walk.c and the test program
 * tests/programs/profile_mix.c.
 */
#ifndef CYCLE_H
#define CYCLE_H

#include <stddef.h>
#include <stdint.h>

static void one_cycle(uint32_t *next, size_t n)
{
	for (size_t i = 0; i < n; i++)
		next[i] = (uint32_t)i;
	uint64_t x = 88172645463325252u;
	for (size_t i = n - 1; i > 0; i--) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		size_t j = (size_t)(x % i);
		uint32_t t = next[i];
		next[i] = next[j], next[j] = t;
	}
}

#endif
