/*
 * fork_exec: forks children that exec a program and exit with known
 * statuses, to check FORK, EXIT and CONTEXTSWITCH events.
 *
 *   fork_exec [CHILDREN]     (default 3)
 *
 * Child i execs "fork_exec --child i", which prints its pid and exits with
 * status 10 + i. The parent waits for each in turn and prints
 * "fork_exec: child PID exited with STATUS".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc == 3 && strcmp(argv[1], "--child") == 0) {
		int i = atoi(argv[2]);
		printf("fork_exec: child %d is pid %d, parent %d\n", i, (int)getpid(), (int)getppid());
		fflush(stdout);
		return 10 + i;
	}
	int children = argc > 1 ? atoi(argv[1]) : 3;
	if (children < 1 || children > 100) {
		fprintf(stderr, "usage: fork_exec [CHILDREN (1..100)]\n");
		return 2;
	}
	printf("fork_exec: parent is pid %d\n", (int)getpid());
	fflush(stdout);
	for (int i = 0; i < children; i++) {
		pid_t pid = fork();
		if (pid < 0) {
			perror("fork");
			return 1;
		}
		if (pid == 0) {
			char arg[16];
			snprintf(arg, sizeof(arg), "%d", i);
			execl("/proc/self/exe", "fork_exec", "--child", arg, (char *)NULL);
			perror("exec");
			_exit(127);
		}
		int status;
		if (waitpid(pid, &status, 0) != pid) {
			perror("waitpid");
			return 1;
		}
		printf("fork_exec: child %d exited with %d\n", (int)pid,
		       WIFEXITED(status) ? WEXITSTATUS(status) : -1);
	}
	return 0;
}
