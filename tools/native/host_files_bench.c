/*
 * What a program's start and its file I/O cost in the guest on the file
 * system holding DIR (docs/host-files.md, "Choosing the transport"):
 *
 *   host_files_bench DIR [N [DEVICE]]
 *
 * execs this program (dynamically linked) from DIR N times, opens and
 * fstat()s N*5 distinct files DIR/small/fNNN, reads DIR/big whole, and
 * prints the guest's microseconds for each. With DEVICE, mounts it (ext2,
 * read-only) on DIR first. `host_files_bench --noop` exits at once.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void run(const char *prog)
{
	pid_t pid = fork();
	if (pid == 0) {
		execl(prog, prog, "--noop", (char *)NULL);
		_exit(127);
	}
	int status;
	if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status)) {
		fprintf(stderr, "exec of %s failed\n", prog);
		exit(1);
	}
}

int main(int argc, char **argv)
{
	static char buf[1 << 20];
	char path[4096];

	if (argc > 1 && strcmp(argv[1], "--noop") == 0)
		return 0;
	if (argc < 2) {
		fprintf(stderr, "usage: %s DIR [N [DEVICE]]\n", argv[0]);
		return 2;
	}
	const char *dir = argv[1];
	int n = argc > 2 ? atoi(argv[2]) : 20;
	if (argc > 3) {
		mkdir(dir, 0755);
		if (mount(argv[3], dir, "ext2", MS_RDONLY, NULL) != 0) {
			perror("mount");
			return 1;
		}
	}
	snprintf(path, sizeof(path), "%s/host_files_bench", dir);
	double t0 = now_us();
	run(path);
	double t1 = now_us();
	for (int i = 0; i < n; i++)
		run(path);
	double t2 = now_us();
	printf("exec: first %.0f us, then %.0f us each\n", t1 - t0, (t2 - t1) / n);

	t0 = now_us();
	for (int i = 0; i < n * 5; i++) {
		struct stat st;
		snprintf(path, sizeof(path), "%s/small/f%03d", dir, i);
		int fd = open(path, O_RDONLY);
		if (fd < 0 || fstat(fd, &st) != 0) {
			perror(path);
			return 1;
		}
		close(fd);
	}
	t1 = now_us();
	printf("open+fstat: %.0f us each\n", (t1 - t0) / (n * 5));

	snprintf(path, sizeof(path), "%s/big", dir);
	t0 = now_us();
	int fd = open(path, O_RDONLY);
	long total = 0;
	ssize_t got;
	while (fd >= 0 && (got = read(fd, buf, sizeof(buf))) > 0)
		total += got;
	t1 = now_us();
	if (fd < 0) {
		perror(path);
		return 1;
	}
	close(fd);
	printf("read %ld bytes: %.0f us (%.1f MB/s)\n", total, t1 - t0, total / (t1 - t0));
	return 0;
}
