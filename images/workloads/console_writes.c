/*
 * console_writes: writes to its standard output the ways a program can,
 * each with text that says where every byte came from, and then one line
 * per case saying what write() returned. Under insight the terminal's
 * driver hands the device the program's own buffer (guest kernel patch
 * 0012) instead of copying it; these are the cases where that could go
 * wrong:
 *   - a buffer across a page boundary, and one of 64 KiB (sixteen pages,
 *     the longest the tty passes at once) plus a page;
 *   - writev() with several segments, one of them empty (the driver takes
 *     one segment at a time);
 *   - a buffer whose second page cannot be read: write() fails with
 *     EFAULT and writes nothing, as when the kernel copies it;
 *   - a buffer on a page the program has never touched (the kernel must
 *     fault it in before the device reads it): sixteen zero bytes.
 * The test computes the same text and compares.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#define PAGE 4096

/* Fills n bytes with lines "TAG OFFSET\n" padded with '-' to 32 bytes. */
static void fill(char *p, size_t n, const char *tag)
{
	for (size_t off = 0; off < n; off += 32) {
		char line[33];
		int len = snprintf(line, sizeof line, "%s %06zu", tag, off);
		memset(line + len, '-', 32 - (size_t)len);
		line[31] = '\n';
		memcpy(p + off, line, n - off < 32 ? n - off : 32);
	}
}

static void report(const char *what, ssize_t ret, int err)
{
	char line[80];
	int len = snprintf(line, sizeof line, "\n%s: %zd %s\n", what, ret,
			   ret < 0 ? strerror(err) : "ok");
	if (write(1, line, (size_t)len) != len)
		_exit(2);
}

int main(void)
{
	char *area = mmap(NULL, 20 * PAGE, PROT_READ | PROT_WRITE,
			  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (area == MAP_FAILED)
		return 1;
	ssize_t ret;

	/* 96 bytes across the boundary of pages 0 and 1. */
	fill(area + PAGE - 64, 96, "cross");
	ret = write(1, area + PAGE - 64, 96);
	report("cross", ret, errno);

	/* 64 KiB + 1 page from page 2. */
	fill(area + 2 * PAGE, 17 * PAGE, "big");
	ret = write(1, area + 2 * PAGE, 17 * PAGE);
	report("big", ret, errno);

	/* Three segments and an empty one, from different places. */
	char stack_text[40];
	fill(stack_text, 32, "stack");
	struct iovec iov[4] = {
		{ area + 2 * PAGE + 100, 50 },
		{ stack_text, 0 },
		{ stack_text, 32 },
		{ area + 5 * PAGE - 10, 20 },
	};
	ret = writev(1, iov, 4);
	report("writev", ret, errno);

	/* Page 19 cannot be read: a write reaching into it fails whole. */
	if (mprotect(area + 19 * PAGE, PAGE, PROT_NONE))
		return 1;
	fill(area + 18 * PAGE, PAGE, "lost");
	ret = write(1, area + 18 * PAGE, 2 * PAGE);
	report("efault", ret, errno);

	/* A page never touched: the write faults it in, zeros. */
	char *fresh = mmap(NULL, PAGE, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (fresh == MAP_FAILED)
		return 1;
	ret = write(1, fresh, 16);
	report("fresh", ret, errno);
	return 0;
}
