/*
 * Shared by the potential-deadlock programs of the InSight paper
 * (deadlock_trylock, deadlock_trylock_fail, deadlock_transitive,
 * deadlock_gatelock): threads that take locks in orders that could
 * deadlock, run one after the other so that they never do. The turns are
 * handed over with semaphores, which are not mutexes: the probes see only
 * the lock orders.
 */
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>

/* Global, so that reports can name them from the symbol table. */
pthread_mutex_t L1 = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t L2 = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t L3 = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t G = PTHREAD_MUTEX_INITIALIZER;

#define MAX_TURNS 8
static sem_t turn[MAX_TURNS];

static void wait_turn(int n)
{
	while (sem_wait(&turn[n]) != 0)
		;
}

static void give_turn(int n)
{
	sem_post(&turn[n]);
}

static void must(int ok, const char *what)
{
	if (!ok) {
		fprintf(stderr, "%s failed\n", what);
		exit(1);
	}
}

/* Runs the thread functions concurrently (they order themselves with
 * turns; turn 0 is given at once) and waits for them. */
static void run_threads(void *(*const fns[])(void *), int n, const char *name)
{
	pthread_t t[MAX_TURNS];
	for (int i = 0; i < MAX_TURNS; i++)
		must(sem_init(&turn[i], 0, 0) == 0, "sem_init");
	for (int i = 0; i < n; i++)
		must(pthread_create(&t[i], NULL, fns[i], NULL) == 0, "pthread_create");
	give_turn(0);
	for (int i = 0; i < n; i++)
		must(pthread_join(t[i], NULL) == 0, "pthread_join");
	printf("%s: done, no deadlock\n", name);
}
