/*
 * signal_frames [ROUNDS [SPINS]]: signals whose frames go to pages never
 * touched.
 *
 * Each round spins SPINS (default 20 million) rounds of a register-only
 * loop, maps a fresh alternate signal stack (64 KiB, not touched, its top
 * at another place in its last page each round), raises a signal handled
 * on it and checks, after the handler returns, an SSE value held in a
 * register across it and the handler's count. The kernel saves the vector
 * state into the frame on that stack with XSAVE, which insight completes
 * for the guest kernel on hosts that cannot emulate it: where the frame
 * crosses into a page not mapped yet, insight raises the page fault the
 * instruction would have, and the kernel maps the page and saves again.
 * Prints "signal_frames: ROUNDS rounds ok (H)", H a hex digit of the loop's
 * result, or what went wrong, and exits 1 then.
 */
#include <emmintrin.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define STACK (64 * 1024)

static volatile sig_atomic_t handled;

static void on_signal(int sig)
{
	(void)sig;
	/* Vector work in the handler: the program's own state is restored
	 * from the frame when it returns. */
	volatile __m128d x = _mm_set1_pd(-1.0);
	(void)x;
	handled++;
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 50;
	long spins = argc > 2 ? atol(argv[2]) : 20000000;
	if (rounds < 1 || spins < 0) {
		fprintf(stderr, "usage: signal_frames [ROUNDS [SPINS]]\n");
		return 2;
	}
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_signal;
	sa.sa_flags = SA_ONSTACK;
	sigemptyset(&sa.sa_mask);
	if (sigaction(SIGUSR1, &sa, NULL) != 0) {
		perror("signal_frames: sigaction");
		return 1;
	}
	unsigned long h = 1;
	for (int i = 0; i < rounds; i++) {
		for (long k = 0; k < spins; k++)
			h = h * 6364136223846793005UL + 1442695040888963407UL;
		void *stack = mmap(NULL, STACK, PROT_READ | PROT_WRITE,
				   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (stack == MAP_FAILED) {
			perror("signal_frames: mmap");
			return 1;
		}
		/* The stack's top moves through the page from round to round:
		 * the frame's vector state crosses from one page into the next
		 * at some of them (the kernel touches its header first, and
		 * the page that holds it is mapped before the XSAVE). */
		size_t size = STACK - (size_t)(i * 320) % 4096;
		stack_t ss = {.ss_sp = stack, .ss_size = size, .ss_flags = 0};
		if (sigaltstack(&ss, NULL) != 0) {
			perror("signal_frames: sigaltstack");
			return 1;
		}
		__m128d kept = _mm_set_pd(i + 0.25, i + 0.5);
		__asm__ volatile("" : "+x"(kept));
		raise(SIGUSR1);
		__asm__ volatile("" : "+x"(kept));
		double out[2];
		_mm_storeu_pd(out, kept);
		if (handled != i + 1 || out[0] != i + 0.5 || out[1] != i + 0.25) {
			printf("signal_frames: round %d: %d signals handled, register %g %g\n", i,
			       (int)handled, out[0], out[1]);
			return 1;
		}
		ss.ss_flags = SS_DISABLE;
		sigaltstack(&ss, NULL);
		munmap(stack, STACK);
	}
	printf("signal_frames: %d rounds ok (%lx)\n", rounds, h >> 60);
	return 0;
}
