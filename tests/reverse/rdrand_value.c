/* A value from RDRAND, the CPU's random number generator, which a replay
   cannot make again: the replay must give the program the value it had
   when it was recorded, or say that it cannot. */

#include <cpuid.h>
#include <stdio.h>

unsigned long got;

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
  return 0;			/* end of main */
}
