/*
 * How often the guest's scheduler switches between two CPU-bound threads:
 * each spins 20 million times and counts the times it finds the other one
 * ran last. Natively on one CPU (taskset -c 0) about 30; compare with
 * `insight record -- ./switches` and `insight record --chaos -- ./switches`
 * to see whether chaos's forced preemptions end the running thread's
 * slice (docs/chaos.md, "Measured").
 *
 *   gcc -O1 -pthread -o switches tools/native/switches.c
 */
#include <pthread.h>
#include <stdio.h>

static volatile int last = -1;
static volatile long switches;

static void *run(void *arg)
{
	int me = (int)(long)arg;
	for (long i = 0; i < 20000000; i++) {
		if (last != me) {
			last = me;
			switches++;
		}
	}
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
