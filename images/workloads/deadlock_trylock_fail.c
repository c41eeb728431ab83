/*
 * deadlock_trylock_fail: the trylock program where the trylock fails.
 * T2 holds L2 and L1 while T1's trylock of L1 fails; T1 takes L2 only
 * after T2 released both. No lock order can deadlock.
 */
#include <errno.h>

#include "deadlock_common.h"

static void *t1(void *arg)
{
	wait_turn(1);
	must(pthread_mutex_trylock(&L1) == EBUSY, "trylock L1 failing");
	give_turn(2);
	wait_turn(3);
	pthread_mutex_lock(&L2);
	pthread_mutex_unlock(&L2);
	return arg;
}

static void *t2(void *arg)
{
	wait_turn(0);
	pthread_mutex_lock(&L2);
	pthread_mutex_lock(&L1);
	give_turn(1);
	wait_turn(2);
	pthread_mutex_unlock(&L1);
	pthread_mutex_unlock(&L2);
	give_turn(3);
	return arg;
}

int main(void)
{
	void *(*const fns[])(void *) = {t1, t2};
	run_threads(fns, 2, "deadlock_trylock_fail");
	return 0;
}
