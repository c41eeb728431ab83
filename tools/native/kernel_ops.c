/*
 * What kernel-bound operations cost, by CLOCK_MONOTONIC: the same static
 * binary run natively and in the guest, side by side (docs/pvm-guest.md).
 *
 *   kernel_ops [SYSCALLS [FAULTS [FORKS [WRITES [LINES]]]]]
 *
 * defaults 200000 20000 200 200000 0. Times, in order: a getppid system
 * call; a page fault on a fresh anonymous page; fork, exec and exit of
 * /bin/busybox true; a 1-byte write to /dev/null; a 42-byte line to
 * standard output (flushed; "terminal" or "pipe" says what it was). Each
 * prints "kernel_ops: NAME US us (COUNT)" on standard error. In the guest,
 * where the kernel is interpreted, use about a hundredth of the counts:
 *
 *   insight run -- ./kernel_ops 2000 500 5 2000 200
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char *name, double start, long count)
{
	fprintf(stderr, "kernel_ops: %s %.3f us (%ld)\n", name,
		(now() - start) * 1e6 / count, count);
}

int main(int argc, char **argv)
{
	long n[5] = { 200000, 20000, 200, 200000, 0 };
	double start;
	char *pages;
	int fd;

	for (int i = 1; i < argc && i <= 5; i++) {
		n[i - 1] = atol(argv[i]);
		if (n[i - 1] < (i == 5 ? 0 : 1)) {
			fprintf(stderr, "kernel_ops: count %d must be positive\n", i);
			return 2;
		}
	}

	start = now();
	for (long i = 0; i < n[0]; i++)
		syscall(SYS_getppid);
	report("getppid", start, n[0]);

	pages = mmap(NULL, (size_t)n[1] * 4096, PROT_READ | PROT_WRITE,
		     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (pages == MAP_FAILED) {
		perror("kernel_ops: mmap");
		return 1;
	}
	start = now();
	for (long i = 0; i < n[1]; i++)
		pages[(size_t)i * 4096] = 1;
	report("page_fault", start, n[1]);

	start = now();
	for (long i = 0; i < n[2]; i++) {
		int status;
		pid_t child = fork();

		if (child == 0) {
			execl("/bin/busybox", "busybox", "true", (char *)NULL);
			_exit(127);
		}
		if (child < 0 || waitpid(child, &status, 0) != child ||
		    !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			fprintf(stderr, "kernel_ops: busybox true failed\n");
			return 1;
		}
	}
	report("fork_exec_exit", start, n[2]);

	fd = open("/dev/null", O_WRONLY);
	if (fd < 0) {
		perror("kernel_ops: /dev/null");
		return 1;
	}
	start = now();
	for (long i = 0; i < n[3]; i++)
		if (write(fd, "x", 1) != 1) {
			perror("kernel_ops: write");
			return 1;
		}
	report("write_dev_null", start, n[3]);

	if (n[4] > 0) {
		const char *kind = isatty(1) ? "line_to_terminal" : "line_to_pipe";

		start = now();
		for (long i = 0; i < n[4]; i++) {
			printf("kernel_ops: line %6ld, forty characters\n", i);
			fflush(stdout);
		}
		report(kind, start, n[4]);
	}
	return 0;
}
