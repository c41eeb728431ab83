/*
 * sync_queue [ITEMS]: producers and consumers on a bounded queue, a
 * program that counts its own synchronisation, for checking the lock
 * report's model of condition variables, read-write locks, semaphores
 * and barriers against it.
 *
 * Two producers each put ITEMS (default 200) items into a queue of four
 * slots guarded by `queue_lock`; two consumers take them. A full queue
 * makes a producer wait on `not_full`, an empty one a consumer on
 * `not_empty`; each wait, signal and broadcast is counted. Every item's
 * value is added to a total under the read-write lock `totals` (a write
 * lock), which the consumers also read now and then (a read lock). The
 * consumers start together at a barrier; a semaphore counts the items
 * taken, and the main thread takes one unit of it per item.
 *
 * Prints "sync_queue: items N waits W signals S broadcasts B reads R
 * writes W2 sem_waits M total T".
 */
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>

#define SLOTS 4
#define PRODUCERS 2
#define CONSUMERS 2

static pthread_mutex_t queue_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t not_empty = PTHREAD_COND_INITIALIZER;
static pthread_cond_t not_full = PTHREAD_COND_INITIALIZER;
static pthread_rwlock_t totals = PTHREAD_RWLOCK_INITIALIZER;
static pthread_barrier_t start;
static sem_t taken;

static long queue[SLOTS];
static int head, count, producers_left = PRODUCERS;
static long items;
/* Counted under queue_lock. */
static long waits, signals, broadcasts;
/* Under totals (reads: atomically, under its read lock). */
static long total, reads, writes;

static void *produce(void *arg)
{
	long base = (long)arg * 1000000;
	for (long i = 0; i < items; i++) {
		pthread_mutex_lock(&queue_lock);
		while (count == SLOTS) {
			waits++;
			pthread_cond_wait(&not_full, &queue_lock);
		}
		queue[(head + count) % SLOTS] = base + i;
		count++;
		signals++;
		pthread_cond_signal(&not_empty);
		pthread_mutex_unlock(&queue_lock);
	}
	pthread_mutex_lock(&queue_lock);
	if (--producers_left == 0) {
		/* Wakes consumers waiting on an empty queue: no more items. */
		broadcasts++;
		pthread_cond_broadcast(&not_empty);
	}
	pthread_mutex_unlock(&queue_lock);
	return NULL;
}

static void *consume(void *arg)
{
	(void)arg;
	pthread_barrier_wait(&start);
	for (long n = 0;; n++) {
		pthread_mutex_lock(&queue_lock);
		while (count == 0 && producers_left > 0) {
			waits++;
			pthread_cond_wait(&not_empty, &queue_lock);
		}
		if (count == 0) {
			pthread_mutex_unlock(&queue_lock);
			return NULL;
		}
		long v = queue[head];
		head = (head + 1) % SLOTS;
		count--;
		signals++;
		pthread_cond_signal(&not_full);
		pthread_mutex_unlock(&queue_lock);

		pthread_rwlock_wrlock(&totals);
		total += v;
		writes++;
		pthread_rwlock_unlock(&totals);
		if (n % 16 == 0) {
			pthread_rwlock_rdlock(&totals);
			/* Readers share the lock: the count is atomic. */
			__atomic_fetch_add(&reads, total >= 0, __ATOMIC_RELAXED);
			pthread_rwlock_unlock(&totals);
		}
		sem_post(&taken);
	}
}

int main(int argc, char **argv)
{
	items = argc > 1 ? strtol(argv[1], NULL, 10) : 200;
	if (items < 1 || items > 1000000)
		return 2;
	pthread_barrier_init(&start, NULL, CONSUMERS);
	sem_init(&taken, 0, 0);
	pthread_t p[PRODUCERS], c[CONSUMERS];
	for (long i = 0; i < CONSUMERS; i++)
		pthread_create(&c[i], NULL, consume, NULL);
	for (long i = 0; i < PRODUCERS; i++)
		pthread_create(&p[i], NULL, produce, (void *)i);
	long sem_waits = 0;
	for (long i = 0; i < PRODUCERS * items; i++) {
		sem_wait(&taken);
		sem_waits++;
	}
	for (long i = 0; i < PRODUCERS; i++)
		pthread_join(p[i], NULL);
	for (long i = 0; i < CONSUMERS; i++)
		pthread_join(c[i], NULL);
	printf("sync_queue: items %ld waits %ld signals %ld broadcasts %ld reads %ld writes %ld "
	       "sem_waits %ld total %ld\n",
	       PRODUCERS * items, waits, signals, broadcasts, reads, writes, sem_waits, total);
	return 0;
}
