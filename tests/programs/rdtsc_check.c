/*
 * Reads the TSC from user mode and says, for each way of reading it,
 * whether the value came from the guest kernel's emulation (a nanosecond
 * count between two CLOCK_MONOTONIC readings taken around it) or from the
 * CPU (anything else), or whether the read raised SIGSEGV.
 *
 *   rdtsc: emulated|native|SIGSEGV
 *   rdtscp: emulated|native|SIGSEGV aux=N
 *   rdtsc with PR_TSC_SIGSEGV: ...       (the task asked for SIGSEGV)
 *   rdtsc with PR_TSC_ENABLE: ...        (and asked for the TSC back)
 *   rdtsc in a PR_TSC_SIGSEGV child: ...
 *   rdtsc after the child: ...           (CR4.TSD across context switches)
 *
 * Always exits 0 when it could run every check: the caller decides what
 * the host should have given.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static sigjmp_buf on_fault;

static void segv_handler(int sig)
{
	(void)sig;
	siglongjmp(on_fault, 1);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t read_rdtsc(uint32_t *aux)
{
	uint32_t lo, hi;

	*aux = 0;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return (uint64_t)hi << 32 | lo;
}

static uint64_t read_rdtscp(uint32_t *aux)
{
	uint32_t lo, hi, c;

	__asm__ volatile("rdtscp" : "=a"(lo), "=d"(hi), "=c"(c));
	*aux = c;
	return (uint64_t)hi << 32 | lo;
}

/* Reads the TSC with `read` and classifies the value. */
static const char *probe(uint64_t (*read)(uint32_t *), uint32_t *aux)
{
	/* volatile: read again after siglongjmp. */
	volatile uint64_t before = now_ns();
	uint64_t tsc, after;

	if (sigsetjmp(on_fault, 1))
		return "SIGSEGV";
	tsc = read(aux);
	after = now_ns();
	return (tsc >= before && tsc <= after) ? "emulated" : "native";
}

int main(void)
{
	struct sigaction sa = { .sa_handler = segv_handler };
	uint32_t aux;
	const char *what;
	pid_t child;
	int status;

	sigemptyset(&sa.sa_mask);
	if (sigaction(SIGSEGV, &sa, NULL)) {
		perror("rdtsc_check: sigaction");
		return 1;
	}
	printf("rdtsc: %s\n", probe(read_rdtsc, &aux));
	what = probe(read_rdtscp, &aux);
	printf("rdtscp: %s aux=%u\n", what, aux);

	if (prctl(PR_SET_TSC, PR_TSC_SIGSEGV, 0, 0, 0)) {
		perror("rdtsc_check: prctl(PR_SET_TSC, PR_TSC_SIGSEGV)");
		return 1;
	}
	printf("rdtsc with PR_TSC_SIGSEGV: %s\n", probe(read_rdtsc, &aux));
	if (prctl(PR_SET_TSC, PR_TSC_ENABLE, 0, 0, 0)) {
		perror("rdtsc_check: prctl(PR_SET_TSC, PR_TSC_ENABLE)");
		return 1;
	}
	printf("rdtsc with PR_TSC_ENABLE: %s\n", probe(read_rdtsc, &aux));
	fflush(stdout);

	child = fork();
	if (child < 0) {
		perror("rdtsc_check: fork");
		return 1;
	}
	if (child == 0) {
		if (prctl(PR_SET_TSC, PR_TSC_SIGSEGV, 0, 0, 0))
			_exit(2);
		/* Let the parent run in between: context switches both ways. */
		usleep(20000);
		printf("rdtsc in a PR_TSC_SIGSEGV child: %s\n", probe(read_rdtsc, &aux));
		fflush(stdout);
		_exit(0);
	}
	if (waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
	    WEXITSTATUS(status) != 0) {
		fprintf(stderr, "rdtsc_check: the child failed\n");
		return 1;
	}
	printf("rdtsc after the child: %s\n", probe(read_rdtsc, &aux));
	return 0;
}
