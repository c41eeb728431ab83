/*
 * libc_loop [ROUNDS]: formats and writes a line ROUNDS times (default
 * 200) through the same libc functions other programs call, then prints
 * a checksum: another process for the debugger's tests, which must never
 * stop or change when a breakpoint is in shared libc code.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	long rounds = argc > 1 ? atol(argv[1]) : 200;
	unsigned long sum = 0;
	char line[64];

	for (long i = 0; i < rounds; i++) {
		int n = snprintf(line, sizeof line, "libc_loop %ld\n", i);
		sum = sum * 31 + strlen(line);
		if (i % 50 == 0 && write(1, line, (size_t)n) != n)
			return 1;
	}
	printf("libc_loop: sum %lu\n", sum);
	return 0;
}
