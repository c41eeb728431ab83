/*
 * syn_cont: the synthetic lock-contention workload of the InSight paper.
 *
 * 16 threads, two levels of locks: each level-1 lock is shared by 2
 * threads, each level-2 lock by 8. Every iteration a thread does some CPU
 * work, works under its level-1 lock, works, and works under its level-2
 * lock (one after the other, not nested: a thread waiting for its level-2
 * lock holds nothing its level-1 partner needs). With the default 1000 iterations each level-1 lock is
 * requested 2000 times and each level-2 lock 8000 times; level-2 locks are
 * the contended ones.
 *
 * Prints the order in which the threads finished (which depends on how
 * they were scheduled), the acquisition count of every lock, and how many
 * of its requests found it held (the lock word read right before each
 * pthread_mutex_lock: what a lock profiler calls blocked).
 *
 *   syn_cont [ITERATIONS [WORK [KERNEL_EVERY [INSIDE]]]]
 *
 * WORK is the CPU work before the level-1 lock; between the locks and
 * inside each there is WORK/4. With INSIDE, the paper's proportions
 * (`comp(); lock(); comp(); unlock();`): WORK before each lock, INSIDE
 * within each.
 *
 * KERNEL_EVERY > 0 makes each thread enter the kernel (getppid) every that
 * many iterations. Under insight's exit clock a thread can only be
 * preempted at a kernel entry; with the probe library preloaded every lock
 * operation is one, without it this option stands in for them.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define THREADS 16
#define L1_LOCKS (THREADS / 2)
#define L2_LOCKS (THREADS / 8)

static pthread_mutex_t level1[L1_LOCKS];
static pthread_mutex_t level2[L2_LOCKS];
static unsigned long level1_count[L1_LOCKS];
static unsigned long level2_count[L2_LOCKS];

static pthread_mutex_t finish_lock = PTHREAD_MUTEX_INITIALIZER;
static int finish_order[THREADS];
static int finished;

static long iterations = 1000;
static long work = 2000;
static long kernel_every;
static long inside = -1;
static long between = -1;

/* Requests that found their lock held, per thread (summed per lock at the
 * end: no counter is shared while the threads run). */
static unsigned long held1[THREADS], held2[THREADS];

/* Whether @m is held by anyone right now (glibc's lock word). */
static int is_held(pthread_mutex_t *m)
{
	return __atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) != 0;
}

/* CPU work the compiler cannot remove. */
static unsigned long spin(unsigned long seed, long n)
{
	volatile unsigned long x = seed;
	for (long i = 0; i < n; i++)
		x = x * 6364136223846793005UL + 1442695040888963407UL;
	return x;
}

static void *worker(void *arg)
{
	int id = (int)(long)arg;
	pthread_mutex_t *l1 = &level1[id / 2];
	pthread_mutex_t *l2 = &level2[id / 8];
	unsigned long acc = id;

	for (long i = 0; i < iterations; i++) {
		acc = spin(acc, work);
		held1[id] += is_held(l1);
		pthread_mutex_lock(l1);
		level1_count[id / 2]++;
		acc = spin(acc, inside);
		pthread_mutex_unlock(l1);
		acc = spin(acc, between);
		held2[id] += is_held(l2);
		pthread_mutex_lock(l2);
		level2_count[id / 8]++;
		acc = spin(acc, inside);
		pthread_mutex_unlock(l2);
		if (kernel_every > 0 && i % kernel_every == 0)
			getppid();
	}
	pthread_mutex_lock(&finish_lock);
	finish_order[finished++] = id;
	pthread_mutex_unlock(&finish_lock);
	return (void *)acc;
}

int main(int argc, char **argv)
{
	pthread_t threads[THREADS];

	if (argc > 1)
		iterations = atol(argv[1]);
	if (argc > 2)
		work = atol(argv[2]);
	if (argc > 3)
		kernel_every = atol(argv[3]);
	if (argc > 4)
		inside = atol(argv[4]);
	if (iterations < 1 || work < 0 || kernel_every < 0 || (argc > 4 && inside < 0)) {
		fprintf(stderr, "usage: syn_cont [ITERATIONS [WORK [KERNEL_EVERY [INSIDE]]]]\n");
		return 2;
	}
	between = inside < 0 ? work / 4 : work;
	if (inside < 0)
		inside = work / 4;
	for (int i = 0; i < L1_LOCKS; i++)
		pthread_mutex_init(&level1[i], NULL);
	for (int i = 0; i < L2_LOCKS; i++)
		pthread_mutex_init(&level2[i], NULL);
	for (long i = 0; i < THREADS; i++) {
		if (pthread_create(&threads[i], NULL, worker, (void *)i)) {
			perror("pthread_create");
			return 1;
		}
	}
	for (int i = 0; i < THREADS; i++)
		pthread_join(threads[i], NULL);

	printf("syn_cont: finish order:");
	for (int i = 0; i < THREADS; i++)
		printf(" %d", finish_order[i]);
	printf("\n");
	int ok = 1;
	for (int i = 0; i < L1_LOCKS; i++) {
		unsigned long held = held1[2 * i] + held1[2 * i + 1];
		printf("syn_cont: level-1 lock %d: %lu acquisitions, %lu found it held\n", i,
		       level1_count[i], held);
		ok &= level1_count[i] == (unsigned long)(2 * iterations);
	}
	for (int i = 0; i < L2_LOCKS; i++) {
		unsigned long held = 0;
		for (int t = 8 * i; t < 8 * i + 8; t++)
			held += held2[t];
		printf("syn_cont: level-2 lock %d: %lu acquisitions, %lu found it held\n", i,
		       level2_count[i], held);
		ok &= level2_count[i] == (unsigned long)(8 * iterations);
	}
	printf("syn_cont: %s\n", ok ? "counts correct" : "COUNTS WRONG");
	return ok ? 0 : 1;
}
