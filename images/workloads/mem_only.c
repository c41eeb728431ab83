/*
 * mem_only [MILLISECONDS]: a thread loops on an instruction that changes
 * memory and leaves every register and flag as it was on each pass
 * (`incq (%rbx)` and a compare that always comes out the same), for about
 * MILLISECONDS (default 400) while the main thread sleeps in 10 ms steps,
 * then prints how far the count got. Every pass of the loop has the same
 * registers, so only memory tells the passes apart: a replay that matched
 * preemption points on registers alone would deliver the timer at the
 * wrong pass and print another count (or diverge sooner).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile uint64_t cell;
static volatile uint64_t stop;

static void *looper(void *arg)
{
	(void)arg;
	__asm__ volatile("1:\n\t"
			 "incq (%0)\n\t"
			 "cmpq $0, (%1)\n\t"
			 "je 1b\n"
			 :
			 : "r"(&cell), "r"(&stop)
			 : "memory", "cc");
	return NULL;
}

int main(int argc, char **argv)
{
	long ms = argc > 1 ? atol(argv[1]) : 400;
	pthread_t t;
	struct timespec start, now;

	clock_gettime(CLOCK_MONOTONIC, &start);
	pthread_create(&t, NULL, looper, NULL);
	do {
		usleep(10000);
		clock_gettime(CLOCK_MONOTONIC, &now);
	} while ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 <
		 ms);
	stop = 1;
	pthread_join(t, NULL);
	printf("mem_only: the loop counted to %llu\n", (unsigned long long)cell);
	return 0;
}
