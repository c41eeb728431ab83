/* A value from RDRAND, the CPU's random number generator, which a replay
   cannot make again: the replay must give the program the value it had
   when it was recorded, or say that it cannot. */

#include <cpuid.h>
#include <stdio.h>
#include <time.h>

unsigned long got;
volatile unsigned long sink;

static long
ms_since (const struct timespec *start)
{
  struct timespec now;
  clock_gettime (CLOCK_MONOTONIC, &now);
  return (now.tv_sec - start->tv_sec) * 1000
    + (now.tv_nsec - start->tv_nsec) / 1000000;
}

/* 50 ms of user code that works with the value, with few clock readings
   (each a system call or an exit): the recording preempts it there,
   with the value in the registers, at least once.  */
static void
use_value (void)
{
  struct timespec start;
  int i;
  clock_gettime (CLOCK_MONOTONIC, &start);
  do
    for (i = 0; i < 100000; i++)
      sink += got;
  while (ms_since (&start) < 50);
}

static int
has_rdrand (void)
{
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid (1, &eax, &ebx, &ecx, &edx))
    return 0;
  return (ecx >> 30) & 1;
}

int
main (void)
{
  unsigned long value = 1;
  if (has_rdrand ())
    __asm__ volatile ("rdrand %0" : "=r" (value));	/* the random value */
  got = value;			/* kept */
  printf ("rdrand_value: %s\n", got ? "a value" : "zero");
  use_value ();
  return 0;			/* end of main */
}
