/*
 * alloc_churn: an allocation-heavy workload for the heap events' costs.
 *
 *   alloc_churn [ROUNDS]
 *
 * Keeps 64 blocks of pseudo-random sizes (16 B to 4 KiB); each round frees
 * one and allocates another in its place (every 8th through realloc or
 * calloc), touching its first bytes. Prints a checksum, which every
 * run, recording and replay must agree on.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SLOTS 64

int main(int argc, char **argv)
{
	long rounds = argc > 1 ? atol(argv[1]) : 100000;
	unsigned char *slot[SLOTS] = { 0 };
	unsigned long seed = 12345, sum = 0;

	for (long i = 0; i < rounds; i++) {
		seed = seed * 6364136223846793005UL + 1442695040888963407UL;
		unsigned k = (unsigned)(seed >> 33) % SLOTS;
		size_t size = 16 + (size_t)(seed >> 45) % 4080;
		unsigned char *p;
		if (i % 8 == 3 && slot[k]) {
			p = realloc(slot[k], size);
		} else {
			free(slot[k]);
			p = i % 8 == 5 ? calloc(1, size) : malloc(size);
		}
		if (!p) {
			fprintf(stderr, "alloc_churn: out of memory\n");
			return 1;
		}
		p[0] = (unsigned char)i;
		sum += p[0] + size;
		slot[k] = p;
	}
	for (unsigned k = 0; k < SLOTS; k++)
		free(slot[k]);
	printf("alloc_churn: %ld rounds, checksum %lu\n", rounds, sum);
	return 0;
}
