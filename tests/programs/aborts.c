/*
 * aborts [VALUE]: a program that fails an assertion of its own: check()
 * aborts unless VALUE (default 41) is 42. For opening a debugger where
 * a recorded run failed (`insight debug --at end`).
 */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) static void check(int v)
{
	if (v != 42) {
		fprintf(stderr, "aborts: bad value %d\n", v);
		abort();
	}
}

int main(int argc, char **argv)
{
	int v = argc > 1 ? atoi(argv[1]) : 41;
	check(v);
	puts("aborts: fine");
	return 0;
}
