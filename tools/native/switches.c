/*
 * How often the scheduler switches between two CPU-bound threads: each
 * spins 20 million times and counts the times it finds the other one ran
 * last ("switches"), and prints how often it was preempted at all (its
 * nonvoluntary context switches). Natively on one CPU (taskset -c 0)
 * about 30 switches; compare `insight run`, `insight record` and
 * `insight record --chaos` of it: whether chaos's forced preemptions hand
 * the CPU to the other thread (docs/chaos.md, "Measured").
 *
 *   gcc -O1 -pthread -o switches tools/native/switches.c
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static volatile int last = -1;
static volatile long switches;

/* The calling thread's context switch counts, from /proc. */
static void show(int me)
{
	char line[128];
	FILE *f = fopen("/proc/thread-self/status", "r");
	if (!f)
		return;
	while (fgets(line, sizeof line, f))
		if (strstr(line, "ctxt_switches"))
			printf("thread %d %s", me, line);
	fclose(f);
}

static void *run(void *arg)
{
	int me = (int)(long)arg;
	for (long i = 0; i < 20000000; i++) {
		if (last != me) {
			last = me;
			switches++;
		}
	}
	show(me);
	return NULL;
}

int main(void)
{
	pthread_t a, b;
	pthread_create(&a, NULL, run, (void *)0);
	pthread_create(&b, NULL, run, (void *)1);
	pthread_join(a, NULL);
	pthread_join(b, NULL);
	printf("switches %ld\n", switches);
	return 0;
}
