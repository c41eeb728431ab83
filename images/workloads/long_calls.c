/*
 * long_calls: system calls that keep the guest kernel busy without a VM
 * exit for a long time, each followed by slow user code.
 *
 *   long_calls [ROUNDS [KIB [SPINS]]]
 *
 * It writes a file of KIB KiB (default 1024) to /tmp, then each round
 * maps it with MAP_POPULATE, so that the kernel maps every page before the
 * call returns (interpreted, about 0.1 ms a page, and nothing in it leaves
 * the guest: the pages are in the page cache already, none is cleared or
 * copied, which insight would do at an exit), reads it, then runs SPINS
 * (default 1000) CPUID instructions with nothing else in the loop but a
 * counter in R8, and unmaps it. CPUID costs the host's hypervisor a few microseconds, so
 * the loop is a few milliseconds of user code in a few thousand
 * instructions. A timer interrupt that comes due during the call waits
 * for an exit; the recorder delivers it at an asynchronous point in the
 * loop (or right at the call's return), a few hundred single steps from
 * the return: the debugger's tests step into such a point.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static void spin(long n)
{
	register long left asm("r8") = n;
	__asm__ volatile("1:\n\t"
			 "xor %%eax, %%eax\n\t"
			 "cpuid\n\t"
			 "dec %0\n\t"
			 "jnz 1b"
			 : "+r"(left)
			 :
			 : "rax", "rbx", "rcx", "rdx", "cc");
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 4;
	size_t len = (size_t)(argc > 2 ? atol(argv[2]) : 1024) << 10;
	long spins = argc > 3 ? atol(argv[3]) : 1000;
	if (rounds < 0 || len == 0 || spins < 1) {
		fprintf(stderr, "usage: long_calls [ROUNDS [KIB [SPINS]]]\n");
		return 2;
	}
	const char *path = "/tmp/long_calls.dat";
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	if (fd < 0) {
		perror("long_calls: open");
		return 1;
	}
	static char block[65536];
	memset(block, 'L', sizeof block);
	for (size_t done = 0; done < len;) {
		size_t n = len - done < sizeof block ? len - done : sizeof block;
		if (write(fd, block, n) != (ssize_t)n) {
			perror("long_calls: write");
			return 1;
		}
		done += n;
	}
	for (int i = 0; i < rounds; i++) {
		volatile char *p = mmap(NULL, len, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
		if (p == MAP_FAILED) {
			perror("long_calls: mmap");
			return 1;
		}
		if (p[len - 1] != 'L') {
			fprintf(stderr, "long_calls: the mapping does not show the file\n");
			return 1;
		}
		spin(spins);
		munmap((void *)p, len);
	}
	close(fd);
	unlink(path);
	printf("long_calls: %d rounds of %zu KiB\n", rounds, len >> 10);
	return 0;
}
