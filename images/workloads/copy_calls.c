/*
 * copy_calls [ROUNDS]: copies short strings with mempcpy and memcpy in
 * turn, ROUNDS times (default 20000000), without a system call, then
 * prints a checksum.
 *
 * glibc's mempcpy enters memmove past its first instruction: it sets RAX
 * and jumps to the `cmp` after memmove's `mov %rdi, %rax`, 74 bytes
 * before memmove's entry in glibc 2.36's AVX2 variant. The recorder stops
 * this loop in memcpy (memmove) often; a trampoline placed over memmove's
 * entry at replay would be entered in its middle by the next mempcpy
 * call, and the replay would run garbage.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Called through pointers, so that the compiler cannot inline them. */
static void *(*volatile copy)(void *, const void *, size_t) = memcpy;
static void *(*volatile copy_end)(void *, const void *, size_t) = mempcpy;

int main(int argc, char **argv)
{
	unsigned long rounds = argc > 1 ? strtoul(argv[1], NULL, 10) : 20000000;
	static char src[128], dst[128];
	unsigned long sum = 0;

	for (int i = 0; i < (int)sizeof src; i++)
		src[i] = (char)('a' + i % 26);
	for (unsigned long i = 0; i < rounds; i++) {
		size_t n = 1 + (i * 7) % 31;
		char *end = copy_end(dst, src + i % 64, n);
		copy(end, src + (i * 3) % 64, n);
		sum = sum * 31 + (unsigned char)dst[(i * 5) % (2 * n)];
	}
	printf("copy_calls: sum %lu\n", sum);
	return 0;
}
