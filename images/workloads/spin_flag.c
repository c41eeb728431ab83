/*
 * spin_flag [ROUNDS]: a thread busy-waits on a flag that the main thread
 * sets after a short sleep, without a system call in the waiting loop,
 * ROUNDS times (default 20). Only preemption of user code lets the main
 * thread run while the waiter spins (the guest has one CPU), so a
 * recorder that never preempts user code hangs here. Prints how many
 * times the waiter looked at the flag in each round, and "spin_flag: ok".
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static atomic_int flag;
static atomic_int round_no;

static void *waiter(void *arg)
{
	long rounds = (long)arg;
	for (long r = 1; r <= rounds; r++) {
		unsigned long spins = 0;
		while (atomic_load_explicit(&flag, memory_order_acquire) != r)
			spins++;
		printf("round %ld: flag seen after %s spins\n", r,
		       spins > 1000 ? "many" : "few");
		fflush(stdout);
		atomic_store(&round_no, (int)r);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long rounds = argc > 1 ? atol(argv[1]) : 20;
	pthread_t t;

	if (rounds < 1)
		rounds = 1;
	if (pthread_create(&t, NULL, waiter, (void *)rounds) != 0) {
		perror("pthread_create");
		return 1;
	}
	for (long r = 1; r <= rounds; r++) {
		usleep(1000);
		atomic_store_explicit(&flag, (int)r, memory_order_release);
		/* Wait (sleeping) until the waiter saw it. */
		while (atomic_load(&round_no) != r)
			usleep(1000);
	}
	pthread_join(t, NULL);
	printf("spin_flag: ok (%ld rounds)\n", rounds);
	return 0;
}
