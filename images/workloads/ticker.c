/*
 * ticker [CALLS [SPINS]]: calls tick() CALLS times (default 10000), with
 * SPINS rounds of arithmetic (default 2000000, about 3 ms of a current
 * core) before each call, then prints how many calls it made and a
 * checksum in done(). A breakpoint on tick() is hit CALLS times, spread
 * evenly over the run: the debugger's benchmark goes back from done() to
 * the last of them.
 */
#include <stdio.h>
#include <stdlib.h>

static unsigned long calls;

__attribute__((noinline)) static void tick(unsigned long x)
{
	calls += 1 + (x & 0);
}

__attribute__((noinline)) static void done(unsigned long sum)
{
	printf("ticker: %lu calls, checksum %lu\n", calls, sum);
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 10000;
	long spins = argc > 2 ? atol(argv[2]) : 2000000;
	unsigned long x = 1;

	for (long i = 0; i < n; i++) {
		for (long j = 0; j < spins; j++)
			x = x * 6364136223846793005UL + 1442695040888963407UL;
		tick(x);
	}
	done(x);
	return 0;
}
