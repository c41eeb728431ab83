/*
 * hotspot: a program with a known profile, for the sampling profiler.
 *
 *   hotspot [ROUNDS [PAGES]]     (default 200 rounds, 0 pages)
 *
 * One worker thread (so that the probe library tracks it) runs ROUNDS
 * rounds; each round spends about 80 % of its CPU time in hot(), 14 % in
 * warm() and 6 % in cool() -- the same loop body, different trip counts.
 * With PAGES, each round also has touch() store once into each of PAGES
 * fresh pages: next to no user time, one page fault per page (the kernel's
 * time, which a profiler must not charge to the store).
 * Prints the checksum and the time it took (about 14 ms per round on a
 * current x86 core).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define UNIT 100000L

static unsigned long spin(unsigned long x, long n)
{
	for (long i = 0; i < n; i++)
		x = x * 6364136223846793005UL + 1442695040888963407UL + (x >> 29);
	return x;
}

__attribute__((noinline)) static unsigned long hot(unsigned long x)
{
	return spin(x, 80 * UNIT);
}

__attribute__((noinline)) static unsigned long warm(unsigned long x)
{
	return spin(x, 14 * UNIT);
}

__attribute__((noinline)) static unsigned long cool(unsigned long x)
{
	return spin(x, 6 * UNIT);
}

__attribute__((noinline)) static unsigned long touch(unsigned long x, long pages)
{
	volatile unsigned char *p = mmap(NULL, pages * 4096, PROT_READ | PROT_WRITE,
					 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	for (long i = 0; i < pages; i++)
		p[i * 4096] = (unsigned char)(x + i);
	x += p[0];
	munmap((void *)p, pages * 4096);
	return x;
}

static long rounds = 200, pages;

static void *worker(void *arg)
{
	unsigned long x = (unsigned long)arg;
	for (long r = 0; r < rounds; r++) {
		x = cool(warm(hot(x)));
		if (pages > 0)
			x = touch(x, pages);
	}
	return (void *)x;
}

int main(int argc, char **argv)
{
	if (argc > 1)
		rounds = atol(argv[1]);
	if (argc > 2)
		pages = atol(argv[2]);
	if (rounds < 1 || pages < 0 || pages > 16384) {
		fprintf(stderr, "usage: hotspot [ROUNDS (>= 1) [PAGES (0..16384)]]\n");
		return 2;
	}
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	pthread_t t;
	void *result;
	if (pthread_create(&t, NULL, worker, (void *)1UL) != 0 || pthread_join(t, &result) != 0) {
		perror("pthread");
		return 1;
	}
	clock_gettime(CLOCK_MONOTONIC, &b);
	double s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
	printf("hotspot: %ld rounds, checksum %lx, %.2f s\n", rounds, (unsigned long)result, s);
	return 0;
}
