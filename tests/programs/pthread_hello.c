/*
 * A user program brought into the guest through the VM config: dynamically
 * linked, with threads. `pthread_hello N` starts N threads that each add
 * their index to a shared sum under a mutex, then prints the sum.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static long sum;

static void *add(void *arg)
{
	pthread_mutex_lock(&lock);
	sum += (long)arg;
	pthread_mutex_unlock(&lock);
	return NULL;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? strtol(argv[1], NULL, 10) : 4;
	pthread_t t[64];
	if (n < 1 || n > 64)
		return 2;
	for (long i = 0; i < n; i++)
		pthread_create(&t[i], NULL, add, (void *)(i + 1));
	for (long i = 0; i < n; i++)
		pthread_join(t[i], NULL);
	printf("pthread_hello: %ld threads, sum %ld\n", n, sum);
	return 0;
}
