/*
 * What a system call costs the user code after it: a pointer chase around
 * one random cycle (every element visited once a lap) over tables of
 * 256 KiB, 2 MiB and 8 MiB, in segments of STEPS steps, each segment
 * timed alone by the TSC. With FILE given, a 4 KiB pread of FILE comes
 * before each segment; the read's own time is not counted.
 *
 *   cold_walk SEGMENTS STEPS [FILE]
 *
 * prints per table "cold_walk: KIB KiB reads|noreads: median M cycles a
 * step, mean A" (the median segment's cycles over STEPS, and all
 * segments' mean). Natively the reads change nothing; in a guest whose
 * kernel the host interprets, each read leaves caches the chase must
 * refill (docs/profiler-comparison.md). Run it under `insight run`, not
 * `record`: TSC values in registers keep the recorder from stopping the
 * task at a pending interrupt.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <x86intrin.h>

#include "cycle.h"

static int by_value(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	if (argc < 3 || argc > 4) {
		fprintf(stderr, "usage: cold_walk SEGMENTS STEPS [FILE]\n");
		return 2;
	}
	uint64_t segments = strtoull(argv[1], NULL, 0), steps = strtoull(argv[2], NULL, 0);
	if (segments == 0 || steps == 0 || segments > 100000000 || steps > 100000000) {
		fprintf(stderr, "cold_walk: SEGMENTS and STEPS must be from 1 to 100000000\n");
		return 2;
	}
	int fd = -1;
	if (argc == 4 && (fd = open(argv[3], O_RDONLY)) < 0) {
		perror(argv[3]);
		return 1;
	}
	uint64_t *cycles = malloc(segments * sizeof *cycles);
	if (!cycles) {
		fprintf(stderr, "cold_walk: out of memory\n");
		return 1;
	}
	static const size_t sizes[] = { 256 << 10, 2 << 20, 8 << 20 };
	static char buf[4096];
	for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
		size_t n = sizes[s] / sizeof(uint32_t);
		uint32_t *a = malloc(n * sizeof *a);
		if (!a) {
			fprintf(stderr, "cold_walk: out of memory\n");
			return 1;
		}
		one_cycle(a, n);
		uint32_t p = 0;
		for (size_t k = 0; k < n; k++) /* one lap: the table resident */
			p = a[p];
		off_t off = 0;
		uint64_t sum = 0;
		for (uint64_t g = 0; g < segments; g++) {
			if (fd >= 0) {
				if (pread(fd, buf, sizeof buf, off) < (ssize_t)sizeof buf)
					off = 0;
				else
					off += sizeof buf;
			}
			uint64_t t0 = __rdtsc();
			for (uint64_t k = 0; k < steps; k++)
				p = a[p];
			cycles[g] = __rdtsc() - t0;
			sum += cycles[g];
		}
		qsort(cycles, segments, sizeof *cycles, by_value);
		printf("cold_walk: %zu KiB %s: median %.1f cycles a step, mean %.1f (end %u)\n",
		       sizes[s] >> 10, fd >= 0 ? "reads" : "noreads",
		       (double)cycles[segments / 2] / (double)steps,
		       (double)sum / (double)(segments * steps), p);
		free(a);
	}
	return 0;
}
