/* What a CPU-bound program measures about itself, natively or in the
 * guest: its CLOCK_MONOTONIC time, its user and system time in clock ticks
 * (/proc/self/stat) and the timer interrupts counted in /proc/interrupts
 * (IRQ 0 named "timer": the guest's PIT; -1 where no such line exists, as
 * on most hosts). Shared by the tick_count workload and tools/native/loops.c.
 */
#ifndef SELF_MEASURE_H
#define SELF_MEASURE_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void cpu_ticks(long *user, long *sys)
{
	char buf[1024];
	FILE *f = fopen("/proc/self/stat", "r");
	size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
	if (f)
		fclose(f);
	buf[n] = 0;
	/* Fields 14 and 15, counted after the ")" that ends the name. */
	char *p = strrchr(buf, ')');
	*user = *sys = -1;
	if (p)
		sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld", user, sys);
}

static long timer_irqs(void)
{
	char line[512];
	long count = -1;
	FILE *f = fopen("/proc/interrupts", "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof line, f)) {
		long c;
		if (sscanf(line, " 0: %ld", &c) == 1 && strstr(line, "timer"))
			count = c;
	}
	fclose(f);
	return count;
}

#endif
