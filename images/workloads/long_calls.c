/*
 * long_calls: system calls that keep the guest kernel busy without a VM
 * exit for a long time, each followed by slow user code.
 *
 *   long_calls [ROUNDS [KIB [SPINS]]]
 *
 * Each round maps KIB KiB (default 1024) with MAP_POPULATE, so that the
 * kernel clears every page before the call returns (interpreted, a
 * millisecond or more a page), touches it, then runs SPINS (default 1000)
 * CPUID instructions with nothing else in the loop but a counter in R8,
 * and unmaps it. CPUID costs the host's hypervisor a few microseconds, so
 * the loop is a few milliseconds of user code in a few thousand
 * instructions. A timer interrupt that comes due during the call waits
 * for an exit; the recorder delivers it at an asynchronous point in the
 * loop (or right at the call's return), a few hundred single steps from
 * the return: the debugger's tests step into such a point.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

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
	for (int i = 0; i < rounds; i++) {
		volatile char *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
					MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		if (p == MAP_FAILED) {
			perror("long_calls: mmap");
			return 1;
		}
		p[len - 1] = (char)i;
		spin(spins);
		munmap((void *)p, len);
	}
	printf("long_calls: %d rounds of %zu KiB\n", rounds, len >> 10);
	return 0;
}
