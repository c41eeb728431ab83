/*
 * probe_target [CALLS [FORKS [PAUSE_MS]]]: what the tests of probes given at replay
 * look at. Two threads call parse_request() CALLS times each (default 60)
 * with a length that cycles through 0, 1000, ..., 9000 and a method name
 * that cycles through "GET", "PUT", "POST"; parse_request() returns twice
 * the length and counts its calls in the global `requests`. The main
 * thread then computes factorial(6) recursively (6 nested calls) once,
 * and forks FORKS children (default none), each of which calls
 * parse_request("GET", 100) 10 times. With PAUSE_MS, the main thread
 * sleeps that long between its threads' calls and the rest (another
 * program can run meanwhile), and each child sleeps that long before its
 * calls, not waited for: it outlives the program. The main thread prints what a probe
 * should see, each line with one write() of its own:
 *   probe_target: thread TID calls C over_4096 B      (each worker)
 *   probe_target: parse_request calls C over_4096 B requests R
 *   probe_target: factorial calls F result X
 *   probe_target: children F calls_each 10            (with FORKS)
 *   probe_target: writes W                            (its write() calls)
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

long requests;
static long factorial_calls;
static volatile long sink;
static long calls = 60;
static long over_4096;
static long writes;
static pthread_mutex_t count_lock = PTHREAD_MUTEX_INITIALIZER;

/* What each worker thread counted of its own calls. */
struct worker_count {
	long tid, calls, over_4096;
};

__attribute__((noinline)) long parse_request(const char *method, long len)
{
	pthread_mutex_lock(&count_lock);
	requests++;
	if (len > 4096)
		over_4096++;
	pthread_mutex_unlock(&count_lock);
	for (long i = 0; i < len; i++)
		sink += method[i % strlen(method)];
	return 2 * len;
}

__attribute__((noinline)) long factorial(long n)
{
	factorial_calls++;
	if (n <= 1)
		return 1;
	long r = n * factorial(n - 1);
	sink += r;
	return r;
}

static void *worker(void *arg)
{
	static const char *const methods[] = {"GET", "PUT", "POST"};
	struct worker_count *count = arg;
	count->tid = syscall(SYS_gettid);
	for (long i = 0; i < calls; i++) {
		long len = (i % 10) * 1000;
		sink += parse_request(methods[i % 3], len);
		count->calls++;
		count->over_4096 += len > 4096;
	}
	return NULL;
}

/* One line, in one write() of its own. */
__attribute__((format(printf, 1, 2))) static void say(const char *format, ...)
{
	char line[256];
	va_list ap;
	va_start(ap, format);
	int n = vsnprintf(line, sizeof line, format, ap);
	va_end(ap);
	writes++;
	if (n < 0 || write(1, line, (size_t)n) != n)
		exit(1);
}

int main(int argc, char **argv)
{
	pthread_t t[2];
	struct worker_count counts[2] = {{0, 0, 0}, {0, 0, 0}};

	if (argc > 1)
		calls = atol(argv[1]);
	for (int i = 0; i < 2; i++)
		if (pthread_create(&t[i], NULL, worker, &counts[i]) != 0)
			return 1;
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	long pause_ms = argc > 3 ? atol(argv[3]) : 0;
	if (pause_ms > 0)
		usleep((useconds_t)pause_ms * 1000);
	long f = factorial(6);
	long forks = argc > 2 ? atol(argv[2]) : 0;
	for (long i = 0; i < forks; i++) {
		pid_t child = fork();
		if (child < 0)
			return 1;
		if (child == 0) {
			if (pause_ms > 0)
				usleep((useconds_t)pause_ms * 1000);
			for (int j = 0; j < 10; j++)
				sink += parse_request("GET", 100);
			_exit(0);
		}
		if (pause_ms == 0)
			waitpid(child, NULL, 0);
	}
	for (int i = 0; i < 2; i++)
		say("probe_target: thread %ld calls %ld over_4096 %ld\n", counts[i].tid,
		    counts[i].calls, counts[i].over_4096);
	say("probe_target: parse_request calls %ld over_4096 %ld requests %ld\n",
	    2 * calls, over_4096, requests);
	say("probe_target: factorial calls %ld result %ld\n", factorial_calls, f);
	if (forks > 0)
		say("probe_target: children %ld calls_each 10\n", forks);
	say("probe_target: writes %ld\n", writes + 1);
	return 0;
}
