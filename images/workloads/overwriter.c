/*
 * overwriter [THREADS] [ITERATIONS]: THREADS threads (default 4) count
 * through ITERATIONS rounds (default 20000); one of them, at one round,
 * both chosen from /dev/urandom, overwrites the global `shared` in
 * scribble(). Prints which thread wrote (its thread id) and the final
 * value, in report().
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Alone on its page: the other threads' work writes elsewhere. */
long shared __attribute__((aligned(4096))) = 7;
static long threads = 4, iterations = 20000;
static long writer, at;
static long sums[64];

__attribute__((noinline)) static void scribble(long i)
{
	shared = 1000 + i;
}

static void *worker(void *arg)
{
	long me = (long)arg, local = 0;
	for (long i = 0; i < iterations; i++) {
		local += i ^ me;
		if (me == writer && i == at) {
			scribble(i);
			printf("overwriter: thread %ld (tid %ld) wrote at round %ld\n",
			       me, (long)syscall(SYS_gettid), i);
		}
		if ((i & 1023) == 0)
			sched_yield();
	}
	sums[me] = local;
	return NULL;
}

__attribute__((noinline)) static void report(void)
{
	printf("overwriter: shared %ld\n", shared);
}

int main(int argc, char **argv)
{
	unsigned long r[2] = { 0, 0 };
	pthread_t t[64];
	FILE *f = fopen("/dev/urandom", "r");

	if (argc > 1)
		threads = atol(argv[1]);
	if (argc > 2)
		iterations = atol(argv[2]);
	if (threads < 1 || threads > 64 || iterations < 1)
		return 2;
	if (!f || fread(r, sizeof r, 1, f) != 1)
		return 1;
	fclose(f);
	writer = (long)(r[0] % (unsigned long)threads);
	at = (long)(r[1] % (unsigned long)iterations);
	for (long i = 0; i < threads; i++)
		pthread_create(&t[i], NULL, worker, (void *)i);
	for (long i = 0; i < threads; i++)
		pthread_join(t[i], NULL);
	report();
	return 0;
}
