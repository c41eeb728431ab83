/*
 * probe_calls: a program built on the host for checking probes given at
 * replay against its own counts. Three threads each call parse() a number
 * of times drawn at run time (from the clock: every run differs), the
 * main thread then computes fib(12) recursively; it prints
 * "probe_calls: parse=P fib=F", the calls of each.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int parses, fibs;
static pthread_mutex_t counted = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) int parse(const char *s)
{
	pthread_mutex_lock(&counted);
	parses++;
	pthread_mutex_unlock(&counted);
	return atoi(s);
}

__attribute__((noinline)) int fib(int n)
{
	__atomic_fetch_add(&fibs, 1, __ATOMIC_RELAXED);
	return n < 2 ? n : fib(n - 1) + fib(n - 2);
}

static void *worker(void *arg)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	unsigned seed = (unsigned)(long)arg ^ (unsigned)now.tv_nsec;
	int n = 50 + rand_r(&seed) % 100;
	for (int i = 0; i < n; i++)
		parse("42");
	return NULL;
}

int main(void)
{
	pthread_t t[3];
	for (long i = 0; i < 3; i++)
		pthread_create(&t[i], NULL, worker, (void *)i);
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);
	fib(12);
	printf("probe_calls: parse=%d fib=%d\n", parses, fibs);
	return 0;
}
