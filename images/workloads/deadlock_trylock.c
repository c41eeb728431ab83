/*
 * deadlock_trylock: T1 takes L1 by a successful trylock, then L2; later T2
 * takes L2, then L1. A potential deadlock: L2(T2) -> L1(T2) -> L1(T1) ->
 * L2(T1) -> L2(T2).
 */
#include "deadlock_common.h"

static void *t1(void *arg)
{
	wait_turn(0);
	must(pthread_mutex_trylock(&L1) == 0, "trylock L1");
	pthread_mutex_lock(&L2);
	pthread_mutex_unlock(&L2);
	pthread_mutex_unlock(&L1);
	give_turn(1);
	return arg;
}

static void *t2(void *arg)
{
	wait_turn(1);
	pthread_mutex_lock(&L2);
	pthread_mutex_lock(&L1);
	pthread_mutex_unlock(&L1);
	pthread_mutex_unlock(&L2);
	return arg;
}

int main(void)
{
	void *(*const fns[])(void *) = {t1, t2};
	run_threads(fns, 2, "deadlock_trylock");
	return 0;
}
