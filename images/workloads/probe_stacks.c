/*
 * probe_stacks [ROUNDS]: lock calls where the replay's copy of the stack
 * above a probe (docs/events.md, "The event ring") meets the edges of a
 * stack. Each round, a mutex is locked and unlocked (ROUNDS default 20):
 *   - beneath a 1 MiB local array that is never written, in the main
 *     thread and in a second thread: the stack pages right above the
 *     probe were never touched;
 *   - in a signal handler on a signal stack whose end is followed by an
 *     inaccessible page;
 *   - in a coroutine (makecontext) whose stack ends at an inaccessible
 *     page.
 * After each call beneath the array, counts how many of the array's two
 * lowest pages are present (mincore): the recording and its replays must
 * print the same counts, though only the replay's probes copy stacks.
 * Prints "probe_stacks: N calls, P array pages present". Built without
 * stack-clash protection (gcc's default here), so the array's pages stay
 * untouched.
 */
#define _GNU_SOURCE
#include <alloca.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#define UNTOUCHED (1 << 20)
#define STACK_PAGES 8

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int calls;
static int present;

static __attribute__((noinline)) void locked_call(void)
{
	pthread_mutex_lock(&lock);
	calls++;
	pthread_mutex_unlock(&lock);
}

static __attribute__((noinline)) void under_array(void)
{
	char *array = alloca(UNTOUCHED);
	/* The array is there, and nothing writes it. */
	__asm__ volatile("" : : "r"(array) : "memory");
	locked_call();
	long page = sysconf(_SC_PAGESIZE);
	unsigned char in_core[2];
	void *lowest = (void *)((unsigned long)array & ~(page - 1));
	if (mincore(lowest, 2 * page, in_core) == 0)
		__atomic_add_fetch(&present, (in_core[0] & 1) + (in_core[1] & 1), __ATOMIC_RELAXED);
}

static void *thread_rounds(void *arg)
{
	int rounds = *(int *)arg;
	for (int i = 0; i < rounds; i++)
		under_array();
	return NULL;
}

/* STACK_PAGES read-write pages followed by an inaccessible one. */
static char *stack_before_a_hole(void)
{
	long page = sysconf(_SC_PAGESIZE);
	char *p = mmap(NULL, (STACK_PAGES + 1) * page, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED || mprotect(p + STACK_PAGES * page, page, PROT_NONE)) {
		perror("probe_stacks: mmap");
		exit(2);
	}
	return p;
}

static void on_signal(int sig)
{
	(void)sig;
	locked_call();
}

static ucontext_t main_context, coroutine_context;

static void coroutine(void)
{
	locked_call();
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 20;
	long page = sysconf(_SC_PAGESIZE);

	for (int i = 0; i < rounds; i++)
		under_array();

	pthread_t t;
	if (pthread_create(&t, NULL, thread_rounds, &rounds) || pthread_join(t, NULL)) {
		fprintf(stderr, "probe_stacks: pthread_create failed\n");
		return 2;
	}

	stack_t ss = {.ss_sp = stack_before_a_hole(), .ss_size = STACK_PAGES * page};
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sa.sa_flags = SA_ONSTACK;
	if (sigaltstack(&ss, NULL) || sigaction(SIGUSR1, &sa, NULL)) {
		perror("probe_stacks: sigaltstack");
		return 2;
	}
	for (int i = 0; i < rounds; i++)
		raise(SIGUSR1);

	char *stack = stack_before_a_hole();
	for (int i = 0; i < rounds; i++) {
		getcontext(&coroutine_context);
		coroutine_context.uc_stack.ss_sp = stack;
		coroutine_context.uc_stack.ss_size = STACK_PAGES * page;
		coroutine_context.uc_link = &main_context;
		makecontext(&coroutine_context, coroutine, 0);
		if (swapcontext(&main_context, &coroutine_context)) {
			perror("probe_stacks: swapcontext");
			return 2;
		}
	}

	printf("probe_stacks: %d calls, %d array pages present\n", calls, present);
	return 0;
}
