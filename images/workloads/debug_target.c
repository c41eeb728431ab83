/*
 * debug_target: what the debugger's tests look at. It writes the global
 * `value` three times (0, then 42 by a store, then 1337 by a read() from a
 * pipe), runs a short stretch of code with system calls and a page fault
 * (window()), fills `big` (4 KiB) with one read() from the pipe, a copy
 * large enough for insight to make for the guest kernel, and reports the
 * value, big[100] and the shared objects it maps, as /proc/self/maps
 * lists them.
 */
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

long value;
long big[512];
static volatile int sink;

__attribute__((noinline)) static void set_value(long v)
{
	value = v;
}

/* A system call, another, and the first touch of a fresh page. */
__attribute__((noinline)) static void window(void)
{
	char *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
			  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (page == MAP_FAILED)
		return;
	long pid = syscall(SYS_getpid);
	page[0] = (char)pid;
	sink = page[0];
	munmap(page, 4096);
}

__attribute__((noinline)) static void report(void)
{
	printf("debug_target: value %ld\n", value);
	printf("debug_target: big[100] %ld\n", big[100]);
	FILE *maps = fopen("/proc/self/maps", "r");
	char line[512], last[256] = "";
	while (maps && fgets(line, sizeof line, maps)) {
		char *path = strchr(line, '/');
		if (!path || !strstr(path, ".so"))
			continue;
		path[strcspn(path, "\n")] = 0;
		if (strcmp(path, last) != 0)
			printf("debug_target: maps %s\n", path);
		snprintf(last, sizeof last, "%s", path);
	}
	if (maps)
		fclose(maps);
}

int main(void)
{
	int fds[2];
	long v = 1337;
	static long block[512];

	for (int i = 0; i < 512; i++)
		block[i] = 1000 + i;

	set_value(0);
	window();
	set_value(42);
	if (pipe(fds) != 0 || write(fds[1], &v, sizeof v) != sizeof v)
		return 1;
	if (read(fds[0], &value, sizeof value) != sizeof value)
		return 1;
	if (write(fds[1], block, sizeof block) != sizeof block ||
	    read(fds[0], big, sizeof big) != sizeof big)
		return 1;
	report();
	return 0;
}
