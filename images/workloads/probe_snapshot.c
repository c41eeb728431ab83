/*
 * probe_snapshot [THREADS [ITERATIONS]]: what a program could see of the
 * probes. THREADS (default 2) threads each call pthread_mutex_lock,
 * pthread_mutex_trylock (on the lock they hold: EBUSY) and
 * pthread_mutex_unlock ITERATIONS (default 50) times, each through a
 * small assembly routine that loads the callee-saved registers with known
 * values, makes the call, and snapshots right after it: the return value,
 * the callee-saved registers, the arithmetic flags and the 4 KiB below the
 * stack pointer, where the probe and libc ran. Prints a checksum of each
 * snapshot, so that a recording's output equals its replays' only if the
 * probes leave the same traces in both; and "probe_snapshot: N calls".
 * Exits 1 if a callee-saved register came back changed.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BELOW 4096

struct snapshot {
	uint64_t rax, rbx, rbp, r13, r14, r15, r12, rflags;
	unsigned char below[BELOW];
};

/* The values the callee-saved registers carry across the call. */
#define PATTERN_RBX 0x1111111111111111UL
#define PATTERN_RBP 0x2222222222222222UL
#define PATTERN_R13 0x3333333333333333UL
#define PATTERN_R14 0x4444444444444444UL
#define PATTERN_R15 0x5555555555555555UL

/* void probed_call(int (*fn)(pthread_mutex_t *), pthread_mutex_t *m, struct snapshot *out) */
__asm__(".text\n"
	".globl probed_call\n"
	".type probed_call,@function\n"
	"probed_call:\n"
	"	push %rbx\n"
	"	push %rbp\n"
	"	push %r12\n"
	"	push %r13\n"
	"	push %r14\n"
	"	push %r15\n"
	"	sub $8, %rsp\n" /* the call's stack alignment */
	"	mov %rdx, %r12\n"
	"	mov %rdi, %rax\n"
	"	mov %rsi, %rdi\n"
	"	movabs $0x1111111111111111, %rbx\n"
	"	movabs $0x2222222222222222, %rbp\n"
	"	movabs $0x3333333333333333, %r13\n"
	"	movabs $0x4444444444444444, %r14\n"
	"	movabs $0x5555555555555555, %r15\n"
	"	call *%rax\n"
	/* Nothing below changes the flags before PUSHF. */
	"	mov %rax, 0(%r12)\n"
	"	mov %rbx, 8(%r12)\n"
	"	mov %rbp, 16(%r12)\n"
	"	mov %r13, 24(%r12)\n"
	"	mov %r14, 32(%r12)\n"
	"	mov %r15, 40(%r12)\n"
	"	mov %r12, 48(%r12)\n"
	"	lea -4096(%rsp), %rsi\n"
	"	lea 64(%r12), %rdi\n"
	"	mov $4096, %ecx\n"
	"	rep movsb\n"
	"	pushf\n"
	"	pop %rcx\n"
	"	and $0xcd5, %rcx\n" /* CF PF AF ZF SF DF OF */
	"	mov %rcx, 56(%r12)\n"
	"	add $8, %rsp\n"
	"	pop %r15\n"
	"	pop %r14\n"
	"	pop %r13\n"
	"	pop %r12\n"
	"	pop %rbp\n"
	"	pop %rbx\n"
	"	ret\n"
	".size probed_call, .-probed_call\n");

void probed_call(int (*fn)(pthread_mutex_t *), pthread_mutex_t *m, struct snapshot *out);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;
static long iterations = 50;
static int broken;

static uint64_t fnv(const void *p, size_t n, uint64_t h)
{
	const unsigned char *b = p;
	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * 0x100000001b3UL;
	return h;
}

static void *worker(void *arg)
{
	int id = (int)(intptr_t)arg;
	static const char *names[] = { "lock", "trylock", "unlock" };
	int (*calls[])(pthread_mutex_t *) = { pthread_mutex_lock, pthread_mutex_trylock,
					      pthread_mutex_unlock };
	struct snapshot *s = malloc(sizeof(*s));
	if (!s)
		abort();
	for (long i = 0; i < iterations; i++) {
		uint64_t sums[3][2];
		int results[3];
		for (int c = 0; c < 3; c++) {
			probed_call(calls[c], &lock, s);
			results[c] = (int)s->rax;
			if (s->rbx != PATTERN_RBX || s->rbp != PATTERN_RBP || s->r13 != PATTERN_R13 ||
			    s->r14 != PATTERN_R14 || s->r15 != PATTERN_R15 || s->r12 != (uintptr_t)s)
				__atomic_store_n(&broken, 1, __ATOMIC_RELAXED);
			sums[c][0] = fnv(s, 8 * sizeof(uint64_t), 0xcbf29ce484222325UL);
			sums[c][1] = fnv(s->below, BELOW, 0xcbf29ce484222325UL);
		}
		/* Printed outside the calls snapshotted: stdio takes its own lock. */
		pthread_mutex_lock(&print_lock);
		for (int c = 0; c < 3; c++)
			printf("t%d %ld %s %d regs %016llx below %016llx\n", id, i, names[c], results[c],
			       (unsigned long long)sums[c][0], (unsigned long long)sums[c][1]);
		pthread_mutex_unlock(&print_lock);
	}
	free(s);
	return NULL;
}

int main(int argc, char **argv)
{
	int threads = argc > 1 ? atoi(argv[1]) : 2;
	if (argc > 2)
		iterations = atol(argv[2]);
	if (threads < 1 || threads > 64 || iterations < 1) {
		fprintf(stderr, "usage: probe_snapshot [THREADS (1-64) [ITERATIONS]]\n");
		return 2;
	}
	pthread_t t[64];
	for (int i = 0; i < threads; i++)
		if (pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i) != 0)
			abort();
	for (int i = 0; i < threads; i++)
		pthread_join(t[i], NULL);
	if (broken) {
		printf("probe_snapshot: a callee-saved register changed across a call\n");
		return 1;
	}
	printf("probe_snapshot: %ld calls\n", 3 * threads * iterations);
	return 0;
}
