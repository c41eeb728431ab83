/*
 * Reads standard input to its end in reads of changing sizes and prints
 * whether it is a terminal, how many bytes it read, and their FNV-1a
 * digest: what a program recorded by its host path gets of the input
 * given to insight.
 *
 *   stdin_digest < FILE
 */
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

int main(void)
{
	static unsigned char buf[70000];
	uint64_t digest = 0xcbf29ce484222325ull, total = 0;
	size_t want = 1;

	for (;;) {
		ssize_t n = read(STDIN_FILENO, buf, want);
		if (n < 0) {
			perror("read");
			return 1;
		}
		if (n == 0)
			break;
		for (ssize_t i = 0; i < n; i++) {
			digest ^= buf[i];
			digest *= 0x100000001b3ull;
		}
		total += (uint64_t)n;
		want = want * 7 % sizeof(buf) + 1;
	}
	printf("stdin %s\n", isatty(STDIN_FILENO) ? "terminal" : "not a terminal");
	printf("%llu bytes, digest %016llx\n", (unsigned long long)total,
	       (unsigned long long)digest);
	return 0;
}
