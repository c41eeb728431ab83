/*
 * timeit: runs a command and prints how long it took by the guest's
 * monotonic clock, in nanoseconds, on standard error.
 *
 *   timeit COMMAND [ARGS...]
 *
 * Exits with the command's status (128+N if signal N killed it).
 */
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	int status;
	pid_t pid;
	long long start;

	if (argc < 2) {
		fprintf(stderr, "usage: timeit COMMAND [ARGS...]\n");
		return 2;
	}
	start = now_ns();
	pid = fork();
	if (pid < 0) {
		perror("timeit: fork");
		return 126;
	}
	if (pid == 0) {
		execvp(argv[1], argv + 1);
		fprintf(stderr, "timeit: cannot run %s: %s\n", argv[1], strerror(errno));
		_exit(127);
	}
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR) {
			perror("timeit: waitpid");
			return 126;
		}
	}
	fprintf(stderr, "timeit: %lld ns\n", now_ns() - start);
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 126;
}
