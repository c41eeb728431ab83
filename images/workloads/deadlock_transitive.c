/*
 * deadlock_transitive: three threads, three locks: T1 takes L1 then L2,
 * T2 takes L2 then L3, T3 takes L3 then L1. A potential deadlock of all
 * three: L1(T1) -> L2(T1) -> L2(T2) -> L3(T2) -> L3(T3) -> L1(T3) -> L1(T1).
 */
#include "deadlock_common.h"

static void nested(pthread_mutex_t *a, pthread_mutex_t *b)
{
	pthread_mutex_lock(a);
	pthread_mutex_lock(b);
	pthread_mutex_unlock(b);
	pthread_mutex_unlock(a);
}

static void *t1(void *arg)
{
	wait_turn(0);
	nested(&L1, &L2);
	give_turn(1);
	return arg;
}

static void *t2(void *arg)
{
	wait_turn(1);
	nested(&L2, &L3);
	give_turn(2);
	return arg;
}

static void *t3(void *arg)
{
	wait_turn(2);
	nested(&L3, &L1);
	return arg;
}

int main(void)
{
	void *(*const fns[])(void *) = {t1, t2, t3};
	run_threads(fns, 3, "deadlock_transitive");
	return 0;
}
