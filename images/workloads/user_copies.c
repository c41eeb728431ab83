/*
 * user_copies: moves data between the kernel and its own memory the ways
 * that reach the kernel's copy to or from user memory, and checks every
 * byte. Under insight, copies of 512 bytes or more are made by the
 * hypervisor as far as both sides are mapped (guest kernel patch 0013),
 * the rest by the kernel; these are the cases where that could go wrong:
 *   - a read into pages never touched (not present: the kernel faults
 *     them in and copies the rest), and across page boundaries;
 *   - a read into a buffer whose second page is read-only, and a write
 *     from one whose second page cannot be read: short counts, as the
 *     kernel's own copy gives;
 *   - a read into a page a fork left shared copy-on-write: the child's
 *     copy must not show in the parent;
 *   - a read into a private file mapping (the file must not change) and
 *     into a shared one (it must);
 *   - readv and writev with segments across pages, and a pipe;
 *   - pages the kernel clears for a fresh mapping and copies for a
 *     copy-on-write fault (guest kernel patch 0015).
 * Prints one line per case, "user_copies: CASE ok" or "... FAILED ...",
 * and exits 1 if any failed.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAGE 4096
#define FILE_BYTES (64 * PAGE)

static int failed;
static volatile unsigned char touch;

static void report(const char *what, int ok, const char *detail)
{
	printf("user_copies: %s %s%s\n", what, ok ? "ok" : "FAILED ",
	       ok ? "" : detail);
	failed |= !ok;
}

/* The file's byte at offset i: different on every page and in every byte. */
static unsigned char pattern(size_t i)
{
	return (unsigned char)(i * 7 + i / PAGE * 13 + 1);
}

static int matches(const unsigned char *p, size_t off, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != pattern(off + i))
			return 0;
	return 1;
}

static unsigned char *map(size_t pages, int prot)
{
	void *p = mmap(NULL, pages * PAGE, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("user_copies: mmap");
		exit(1);
	}
	return p;
}

static ssize_t read_at(int fd, void *buf, size_t n, off_t off)
{
	return pread(fd, buf, n, off);
}

int main(void)
{
	const char *path = "/tmp/user_copies.dat";
	char detail[128];
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	if (fd < 0) {
		perror("user_copies: open");
		return 1;
	}
	/* The file, written from a buffer the program filled. */
	unsigned char *src = map(FILE_BYTES / PAGE, PROT_READ | PROT_WRITE);
	for (size_t i = 0; i < FILE_BYTES; i++)
		src[i] = pattern(i);
	ssize_t n = write(fd, src, FILE_BYTES);
	snprintf(detail, sizeof detail, "wrote %zd", n);
	report("write", n == FILE_BYTES, detail);

	/* Pages never touched, at an odd offset across pages. */
	unsigned char *fresh = map(20, PROT_READ | PROT_WRITE);
	n = read_at(fd, fresh + 100, 16 * PAGE + 5, 333);
	snprintf(detail, sizeof detail, "read %zd", n);
	report("fresh-pages", n == 16 * PAGE + 5 && matches(fresh + 100, 333, (size_t)n), detail);

	/* The second page read-only: the first page is read, then it stops. */
	unsigned char *half = map(2, PROT_READ | PROT_WRITE);
	half[0] = 0;
	mprotect(half + PAGE, PAGE, PROT_READ);
	n = read_at(fd, half, 2 * PAGE, 0);
	snprintf(detail, sizeof detail, "read %zd", n);
	report("read-only-page", n == PAGE && matches(half, 0, PAGE), detail);

	/* The second page unreadable: a write of what comes before it. */
	unsigned char *hidden = map(2, PROT_READ | PROT_WRITE);
	memcpy(hidden, src + 5 * PAGE, PAGE);
	mprotect(hidden + PAGE, PAGE, PROT_NONE);
	int out = open("/tmp/user_copies.out", O_RDWR | O_CREAT | O_TRUNC, 0600);
	n = write(out, hidden, 2 * PAGE);
	unsigned char back[2 * PAGE];
	ssize_t got = read_at(out, back, sizeof back, 0);
	snprintf(detail, sizeof detail, "wrote %zd, read back %zd", n, got);
	report("unreadable-page", n == PAGE && got == PAGE && matches(back, 5 * PAGE, PAGE), detail);

	/* A page shared copy-on-write with a child that reads into it. */
	unsigned char *cow = map(3, PROT_READ | PROT_WRITE);
	memset(cow, 'P', 3 * PAGE);
	pid_t child = fork();
	if (child == 0) {
		ssize_t r = read_at(fd, cow, 3 * PAGE, 7 * PAGE);
		_exit(r == 3 * PAGE && matches(cow, 7 * PAGE, 3 * PAGE) ? 0 : 1);
	}
	int status = 0;
	waitpid(child, &status, 0);
	int untouched = 1;
	for (size_t i = 0; i < 3 * PAGE; i++)
		untouched &= cow[i] == 'P';
	snprintf(detail, sizeof detail, "child status %#x, parent's page %s", status,
		 untouched ? "intact" : "changed");
	report("copy-on-write", WIFEXITED(status) && WEXITSTATUS(status) == 0 && untouched, detail);

	/* A private mapping of a file: the read lands in the program's copy. */
	int other = open("/tmp/user_copies.map", O_RDWR | O_CREAT | O_TRUNC, 0600);
	static unsigned char zeros[4 * PAGE];
	write(other, zeros, sizeof zeros);
	unsigned char *priv = mmap(NULL, 4 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE, other, 0);
	/* One page looked at first: mapped, read only, the file's own page. */
	touch = priv[2 * PAGE];
	n = read_at(fd, priv + 10, 3 * PAGE, 2 * PAGE);
	got = read_at(other, back, 2 * PAGE, 0);
	int file_zero = got == 2 * PAGE;
	for (size_t i = 0; i < 2 * PAGE; i++)
		file_zero &= back[i] == 0;
	snprintf(detail, sizeof detail, "read %zd, file %s", n, file_zero ? "zero" : "changed");
	report("private-mapping", n == 3 * PAGE && matches(priv + 10, 2 * PAGE, 3 * PAGE) && file_zero,
	       detail);

	/* A shared mapping: the read lands in the file. */
	unsigned char *shared = mmap(NULL, 4 * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, other, 0);
	touch = shared[2 * PAGE];
	n = read_at(fd, shared + PAGE, 2 * PAGE, 9 * PAGE);
	got = read_at(other, back, 2 * PAGE, PAGE);
	snprintf(detail, sizeof detail, "read %zd, read back %zd", n, got);
	report("shared-mapping", n == 2 * PAGE && got == 2 * PAGE && matches(back, 9 * PAGE, 2 * PAGE),
	       detail);

	/* readv across pages, then writev of the same segments. */
	unsigned char *v = map(8, PROT_READ | PROT_WRITE);
	struct iovec iov[3] = {
		{v + 4000, 700}, {v + 2 * PAGE - 1, PAGE + 2}, {v + 6 * PAGE, 600},
	};
	n = preadv(fd, iov, 3, 11 * PAGE + 1);
	int vec_ok = n == 700 + PAGE + 2 + 600 && matches(v + 4000, 11 * PAGE + 1, 700) &&
		     matches(v + 2 * PAGE - 1, 11 * PAGE + 701, PAGE + 2) &&
		     matches(v + 6 * PAGE, 12 * PAGE + 703, 600);
	ssize_t w = pwritev(out, iov, 3, 0);
	got = read_at(out, back, (size_t)n, 0);
	vec_ok &= w == n && got == n && matches(back, 11 * PAGE + 1, (size_t)n);
	snprintf(detail, sizeof detail, "readv %zd, writev %zd, read back %zd", n, w, got);
	report("vectors", vec_ok, detail);

	/* A pipe: 48 pages from a child, read in pieces of 5000 bytes. */
	int p[2];
	pipe(p);
	child = fork();
	if (child == 0) {
		close(p[0]);
		ssize_t left = 48 * PAGE;
		const unsigned char *at = src;
		while (left > 0) {
			ssize_t k = write(p[1], at, (size_t)left);
			if (k <= 0)
				_exit(1);
			at += k;
			left -= k;
		}
		_exit(0);
	}
	close(p[1]);
	unsigned char *sink = map(48, PROT_READ | PROT_WRITE);
	size_t total = 0;
	for (;;) {
		ssize_t k = read(p[0], sink + total, total + 5000 > 48 * PAGE ? 48 * PAGE - total : 5000);
		if (k <= 0)
			break;
		total += (size_t)k;
	}
	waitpid(child, &status, 0);
	snprintf(detail, sizeof detail, "%zu bytes, child status %#x", total, status);
	report("pipe", total == 48 * PAGE && matches(sink, 0, total) && status == 0, detail);

	/*
	 * Pages the kernel clears and copies itself (insight makes those too,
	 * guest kernel patch 0015): memory written, unmapped and mapped again
	 * reads as zeros; a child's write to pages a fork left shared copies
	 * each whole page first, and the parent's stay as they were.
	 */
	unsigned char *used = map(64, PROT_READ | PROT_WRITE);
	memset(used, 0xa5, 64 * PAGE);
	munmap(used, 64 * PAGE);
	unsigned char *again = map(64, PROT_READ | PROT_WRITE);
	size_t nonzero = 0;
	for (size_t i = 0; i < 64 * PAGE; i++)
		nonzero += again[i] != 0;
	snprintf(detail, sizeof detail, "%zu bytes not zero", nonzero);
	report("cleared-pages", nonzero == 0, detail);

	unsigned char *forked = map(16, PROT_READ | PROT_WRITE);
	for (size_t i = 0; i < 16 * PAGE; i++)
		forked[i] = pattern(i);
	child = fork();
	if (child == 0) {
		int same = 1;
		for (size_t pg = 0; pg < 16; pg++) {
			unsigned char *page = forked + pg * PAGE;
			page[pg] ^= 0xff;
			for (size_t i = 0; i < PAGE; i++)
				same &= page[i] == (unsigned char)(pattern(pg * PAGE + i) ^ (i == pg ? 0xff : 0));
		}
		_exit(same ? 0 : 1);
	}
	waitpid(child, &status, 0);
	untouched = matches(forked, 0, 16 * PAGE);
	snprintf(detail, sizeof detail, "child status %#x, parent's pages %s", status,
		 untouched ? "intact" : "changed");
	report("copied-pages", WIFEXITED(status) && WEXITSTATUS(status) == 0 && untouched, detail);

	unlink(path);
	unlink("/tmp/user_copies.out");
	unlink("/tmp/user_copies.map");
	printf("user_copies: %s\n", failed ? "FAILED" : "all ok");
	return failed;
}
