/*
 * Writes numbered lines to standard output and to standard error, then
 * says of each whether it is a terminal, and exits with status 3: what a
 * program recorded by its host path sees of the streams insight gives it.
 *
 *   two_streams [LINES]
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	int lines = argc > 1 ? atoi(argv[1]) : 3;
	int out_terminal = isatty(STDOUT_FILENO), err_terminal = isatty(STDERR_FILENO);

	for (int i = 0; i < lines; i++) {
		printf("out %d\n", i);
		fprintf(stderr, "err %d\n", i);
	}
	printf("stdout %s\n", out_terminal ? "terminal" : "not a terminal");
	fprintf(stderr, "stderr %s\n", err_terminal ? "terminal" : "not a terminal");
	return 3;
}
