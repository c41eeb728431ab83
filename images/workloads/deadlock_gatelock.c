/*
 * deadlock_gatelock: T1 takes G, L1, L2; T2 takes G, L2, L1. The L1/L2
 * cycle cannot deadlock because both threads hold the gate lock G around
 * it: it is reported as protected by G.
 */
#include "deadlock_common.h"

static void gated(pthread_mutex_t *a, pthread_mutex_t *b)
{
	pthread_mutex_lock(&G);
	pthread_mutex_lock(a);
	pthread_mutex_lock(b);
	pthread_mutex_unlock(b);
	pthread_mutex_unlock(a);
	pthread_mutex_unlock(&G);
}

static void *t1(void *arg)
{
	wait_turn(0);
	gated(&L1, &L2);
	give_turn(1);
	return arg;
}

static void *t2(void *arg)
{
	wait_turn(1);
	gated(&L2, &L1);
	return arg;
}

int main(void)
{
	void *(*const fns[])(void *) = {t1, t2};
	run_threads(fns, 2, "deadlock_gatelock");
	return 0;
}
