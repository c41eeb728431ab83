/*
 * vector_check [PROCESSES [THREADS [ROUNDS]]]: concurrent processes and
 * threads doing vector work must each see their own register state.
 *
 * Every thread runs SSE arithmetic held in registers across yields, glibc
 * memcpy/memcmp of large buffers (glibc picks its widest implementation the
 * CPU and OS allow), and, when the OS enables AVX state (XCR0 bits 1-2),
 * AVX arithmetic held in ymm registers. A context switch that does not
 * save what user code can use shows up as a wrong result. Prints
 * "vector_check: ok ..." and the widest state found usable.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define BUF (256 * 1024)

static long rounds = 200;
static int avx_usable;

static uint64_t xcr0(void)
{
	unsigned a, b, c, d;
	if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE))
		return 0;
	uint32_t lo, hi;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	return ((uint64_t)hi << 32) | lo;
}

static int sse_round(unsigned seed)
{
	__m128i a = _mm_set1_epi32((int)seed);
	__m128i inc = _mm_set_epi32(4, 3, 2, 1);
	for (int i = 0; i < 64; i++) {
		a = _mm_add_epi32(a, inc);
		if (i % 8 == 0)
			sched_yield();
	}
	int32_t out[4];
	_mm_storeu_si128((__m128i *)out, a);
	for (int k = 0; k < 4; k++)
		if (out[k] != (int32_t)(seed + 64u * (unsigned)(k + 1)))
			return 1;
	return 0;
}

__attribute__((target("avx"))) static int avx_round(unsigned seed)
{
	__m256d a = _mm256_set1_pd((double)seed);
	__m256d inc = _mm256_set_pd(4.0, 3.0, 2.0, 1.0);
	for (int i = 0; i < 64; i++) {
		a = _mm256_add_pd(a, inc);
		if (i % 8 == 0)
			sched_yield();
	}
	double out[4];
	_mm256_storeu_pd(out, a);
	for (int k = 0; k < 4; k++)
		if (out[k] != (double)seed + 64.0 * (k + 1))
			return 1;
	return 0;
}

static void *worker(void *arg)
{
	unsigned id = (unsigned)(uintptr_t)arg;
	unsigned char *src = malloc(BUF), *dst = malloc(BUF);
	long bad = 0;
	if (!src || !dst)
		return (void *)1;
	for (long r = 0; r < rounds; r++) {
		unsigned seed = id * 1000003u + (unsigned)r;
		for (size_t i = 0; i < BUF; i++)
			src[i] = (unsigned char)(seed + i * 7);
		memcpy(dst, src, BUF);
		if (memcmp(dst, src, BUF) != 0)
			bad++;
		for (size_t i = 0; i < BUF; i += 4093)
			if (dst[i] != (unsigned char)(seed + i * 7))
				bad++;
		bad += sse_round(seed);
		if (avx_usable)
			bad += avx_round(seed);
	}
	free(src);
	free(dst);
	return (void *)(uintptr_t)bad;
}

static int run_process(int threads)
{
	pthread_t tid[64];
	long bad = 0;
	for (int t = 0; t < threads; t++)
		if (pthread_create(&tid[t], NULL, worker,
				   (void *)(uintptr_t)(getpid() * 64 + t)) != 0)
			return 1;
	for (int t = 0; t < threads; t++) {
		void *ret;
		pthread_join(tid[t], &ret);
		bad += (long)(uintptr_t)ret;
	}
	if (bad)
		fprintf(stderr, "vector_check: pid %d: %ld wrong results\n", getpid(), bad);
	return bad != 0;
}

int main(int argc, char **argv)
{
	int procs = argc > 1 ? atoi(argv[1]) : 4;
	int threads = argc > 2 ? atoi(argv[2]) : 4;
	if (argc > 3)
		rounds = atol(argv[3]);
	if (procs < 1 || procs > 64 || threads < 1 || threads > 64 || rounds < 1) {
		fprintf(stderr, "usage: vector_check [PROCESSES(1-64) [THREADS(1-64) [ROUNDS]]]\n");
		return 2;
	}
	uint64_t x = xcr0();
	avx_usable = (x & 6) == 6 && __builtin_cpu_supports("avx");

	int failed = 0;
	for (int p = 0; p < procs; p++) {
		pid_t pid = fork();
		if (pid < 0) {
			perror("fork");
			return 1;
		}
		if (pid == 0)
			_exit(run_process(threads));
	}
	for (int p = 0; p < procs; p++) {
		int status;
		if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
			failed++;
	}
	if (failed) {
		fprintf(stderr, "vector_check: FAILED in %d of %d processes (xcr0=%#llx)\n",
			failed, procs, (unsigned long long)x);
		return 1;
	}
	printf("vector_check: ok processes=%d threads=%d rounds=%ld xcr0=%#llx avx=%s\n", procs,
	       threads, rounds, (unsigned long long)x, avx_usable ? "used" : "off");
	return 0;
}
