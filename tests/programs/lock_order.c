/*
 * Two threads take two mutexes in opposite orders, each waiting until the
 * other holds its first: a deadlock every run (a lock-order inversion).
 *
 *   lock_order
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>

static pthread_mutex_t accounts = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t journal = PTHREAD_MUTEX_INITIALIZER;
static atomic_int holding;

static void take_both(pthread_mutex_t *first, pthread_mutex_t *second)
{
	pthread_mutex_lock(first);
	atomic_fetch_add(&holding, 1);
	while (atomic_load(&holding) < 2)
		sched_yield();
	pthread_mutex_lock(second);
	pthread_mutex_unlock(second);
	pthread_mutex_unlock(first);
}

static void *transfer(void *arg)
{
	(void)arg;
	take_both(&accounts, &journal);
	return NULL;
}

static void *audit(void *arg)
{
	(void)arg;
	take_both(&journal, &accounts);
	return NULL;
}

int main(void)
{
	pthread_t a, b;

	pthread_create(&a, NULL, transfer, NULL);
	pthread_create(&b, NULL, audit, NULL);
	pthread_join(a, NULL);
	pthread_join(b, NULL);
	puts("lock_order: no deadlock");
	return 0;
}
