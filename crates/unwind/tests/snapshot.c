/*
 * snapshot OUT: a thread whose routine calls three functions, the last of
 * which writes to OUT its registers (rip rsp rbp, one line), the loaded
 * objects (one "bias path" line each, as dl_iterate_phdr gives them),
 * then, after a line "stack", the thread's stack from rsp to its top.
 * Built with -O2 -fomit-frame-pointer: only the call-frame information
 * says where the callers' frames are.
 */
#define _GNU_SOURCE
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;
static volatile int sink;

static int object(struct dl_phdr_info *info, size_t size, void *data)
{
	(void)size;
	(void)data;
	fprintf(out, "%lu %s\n", (unsigned long)info->dlpi_addr, info->dlpi_name);
	return 0;
}

__attribute__((noinline)) void third(int n)
{
	volatile char pad[200];
	pad[n % 200] = (char)n;
	uint64_t rip, rsp, rbp;
	__asm__ volatile("lea 0(%%rip), %0\n\tmov %%rsp, %1\n\tmov %%rbp, %2"
			 : "=r"(rip), "=r"(rsp), "=r"(rbp));
	pthread_attr_t attr;
	void *base;
	size_t len;
	if (pthread_getattr_np(pthread_self(), &attr) || pthread_attr_getstack(&attr, &base, &len))
		exit(2);
	fprintf(out, "%lu %lu %lu\n", (unsigned long)rip, (unsigned long)rsp, (unsigned long)rbp);
	dl_iterate_phdr(object, NULL);
	fprintf(out, "stack\n");
	fwrite((void *)rsp, 1, (uintptr_t)base + len - rsp, out);
	sink = pad[0];
}

__attribute__((noinline)) void second(int n)
{
	volatile long pad[30];
	pad[n % 30] = n;
	third(n + 1);
	sink = (int)pad[1];
}

__attribute__((noinline)) void first(int n)
{
	second(n * 3);
	sink = n;
}

static void *routine(void *arg)
{
	first((int)(intptr_t)arg);
	sink = 0;
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 2 || !(out = fopen(argv[1], "w")))
		return 2;
	pthread_t t;
	if (pthread_create(&t, NULL, routine, (void *)7) || pthread_join(t, NULL))
		return 2;
	return fclose(out) ? 2 : 0;
}
