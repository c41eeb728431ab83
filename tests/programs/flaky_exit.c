/* Fails on some runs, by its own reading of the clock: exits 1 when the
 * microseconds of CLOCK_MONOTONIC are a multiple of 3, else 0. The clock
 * is an input the recording logs, so a replay of a failing run fails the
 * same way. With "hang" as its argument it blocks for good instead of
 * failing (a thread waiting for a lock its own thread holds). */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void *take_it(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&lock);
	return NULL;
}

int main(int argc, char **argv)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	int fail = (ts.tv_nsec / 1000) % 3 == 0;
	printf("flaky_exit: %s\n", fail ? "fails" : "passes");
	fflush(stdout);
	if (!fail)
		return 0;
	if (argc > 1 && strcmp(argv[1], "hang") == 0) {
		pthread_t t;
		pthread_mutex_lock(&lock);
		pthread_create(&t, NULL, take_it, NULL);
		pthread_join(t, NULL);
	}
	return 1;
}
