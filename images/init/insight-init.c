/*
 * /init of the insight guest.
 *
 * Mounts the usual file systems and tells the hypervisor it is ready: a
 * boot snapshot is taken at that point, and what follows is the same
 * whether the guest booted or was restored. It then fetches the run's
 * archive from the hypervisor and unpacks it (the command, environment,
 * the user's files, a random seed, the wall-clock time), attaches the
 * disk and network devices the archive lists, brings up the loopback
 * interface and, if the host put an address in /etc/insight/net, eth0;
 * runs the guest command that the host put in /etc/insight/command
 * (NUL-separated argv), reaps orphans while it runs, and reports the
 * command's exit status to the hypervisor's platform control port before
 * powering off. Outside insight (QEMU), the files come appended to the
 * initramfs instead and nothing is fetched.
 *
 * The command's standard output and error are its terminal, or, where the
 * host's are not terminals (/etc/insight/streams says which), pipes whose
 * bytes this process relays to the hypervisor, which writes them to the
 * host's. Its standard input likewise: a pipe this process fills with what
 * it asks the hypervisor for, where the host's is no terminal.
 *
 * Exit status as a shell reports it: the code of a normal exit, 128+N for
 * death by signal N.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/random.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

/* The protocol of the platform control port (see docs/ARCHITECTURE.md). */
#define CTL_PORT 0x0f00
#define CTL_PORTS 12
#define ARCHIVE_PORT 0x0f08
#define CTL_SIGNATURE 0x47534e49u /* "INSG" */
#define CTL_INIT_REACHED 0x01
#define CTL_EXIT_STATUS 0x02
#define CTL_READY 0x09
#define CTL_FETCH 0x0a
#define CTL_TERMINAL 0x0b
#define CTL_OUTPUT 0x0e
#define CTL_INPUT 0x0f
#define CTL_INIT_ANNOUNCES_TERMINAL 1 /* CTL_INIT_REACHED's arg: CTL_TERMINAL comes */
#define CTL_MSG(code, arg) (((unsigned)(code) << 24) | ((unsigned)(arg) & 0xffffff))

#define COMMAND_FILE "/etc/insight/command"
#define ENV_FILE "/etc/insight/env"
#define WORKDIR_FILE "/etc/insight/workdir"
#define NET_FILE "/etc/insight/net"
#define DEVICES_FILE "/etc/insight/devices"
#define SEED_FILE "/etc/insight/seed"
#define CLOCK_FILE "/etc/insight/clock"
#define STREAMS_FILE "/etc/insight/streams"
#define HOST_FILES_FILE "/etc/insight/host-files"
#define HOST_FILES_TAG "insight-host"
#define PROBE_LIBRARY "/usr/lib/libinsight-probes.so"
#define IMAGE_DIR "/.insight-image"
#define IMAGE_PROGRAMS IMAGE_DIR "/bin"
#define MAX_ARGS 4096

static int have_port;

static void ctl(unsigned code, unsigned arg)
{
	if (have_port)
		outl(CTL_MSG(code, arg), CTL_PORT);
}

static void die(const char *what)
{
	fprintf(stderr, "insight-init: %s: %s\n", what, strerror(errno));
	tcdrain(STDERR_FILENO);
	ctl(CTL_EXIT_STATUS, 127);
	sync();
	reboot(RB_POWER_OFF);
	for (;;)
		pause();
}

/*
 * The run's archive ("newc" cpio), fetched from the hypervisor a piece at
 * a time: a CTL_FETCH message asks it to write the piece at offset RCX,
 * RDI bytes, to this buffer at RSI.
 */
static unsigned char piece[64 * 1024] __attribute__((aligned(4096)));
static size_t archive_len, fetched, piece_pos, piece_len, consumed;

static void fetch_piece(void)
{
	size_t n = archive_len - fetched;

	if (n > sizeof(piece))
		n = sizeof(piece);
	/* Its pages must be present and writable when the hypervisor writes. */
	memset(piece, 0, n);
	__asm__ volatile("outl %%eax, %%dx"
			 :
			 : "a"(CTL_MSG(CTL_FETCH, 0)), "d"(CTL_PORT), "S"(piece), "D"(n),
			   "c"(fetched)
			 : "memory");
	fetched += n;
	piece_pos = 0;
	piece_len = n;
}

/* The next n bytes of the archive, into dst (discarded if NULL). */
static void take(void *dst, size_t n)
{
	unsigned char *d = dst;

	while (n) {
		if (piece_pos == piece_len) {
			if (fetched == archive_len) {
				errno = EPROTO;
				die("the run's archive ends too soon");
			}
			fetch_piece();
		}
		size_t k = piece_len - piece_pos;
		if (k > n)
			k = n;
		if (d) {
			memcpy(d, piece + piece_pos, k);
			d += k;
		}
		piece_pos += k;
		consumed += k;
		n -= k;
	}
}

static void align4(void)
{
	take(NULL, (4 - consumed % 4) % 4);
}

static unsigned long hex_field(const char *p)
{
	char text[9];

	memcpy(text, p, 8);
	text[8] = 0;
	return strtoul(text, NULL, 16);
}

/* Unpacks the archive's entries relative to the current directory. */
static void unpack_archive(void)
{
	static char name[PATH_MAX], target[PATH_MAX];

	archive_len = have_port ? inl(ARCHIVE_PORT) : 0;
	while (archive_len) {
		char hdr[110];

		take(hdr, sizeof(hdr));
		errno = EPROTO;
		if (memcmp(hdr, "070701", 6) != 0)
			die("the run's archive is not a newc cpio archive");
		unsigned long mode = hex_field(hdr + 14);
		unsigned long size = hex_field(hdr + 54);
		unsigned long namesize = hex_field(hdr + 94);
		if (namesize == 0 || namesize > sizeof(name))
			die("a name in the run's archive is too long");
		take(name, namesize);
		name[namesize - 1] = 0;
		align4();
		/* Archives may follow one another, as in an initramfs. */
		if (strcmp(name, "TRAILER!!!") == 0) {
			if (consumed >= archive_len)
				break;
			continue;
		}
		switch (mode & S_IFMT) {
		case S_IFDIR:
			if (mkdir(name, mode & 07777) != 0 && errno != EEXIST)
				die(name);
			break;
		case S_IFREG: {
			unlink(name);
			int fd = open(name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode & 07777);
			if (fd < 0)
				die(name);
			for (unsigned long left = size; left;) {
				if (piece_pos == piece_len)
					fetch_piece();
				size_t k = piece_len - piece_pos;
				if (k > left)
					k = left;
				for (size_t done = 0; done < k;) {
					ssize_t w = write(fd, piece + piece_pos + done, k - done);
					if (w < 0 && errno == EINTR)
						continue;
					if (w < 0)
						die(name);
					done += (size_t)w;
				}
				piece_pos += k;
				consumed += k;
				left -= k;
			}
			if (fchmod(fd, mode & 07777) != 0 || close(fd) != 0)
				die(name);
			size = 0;
			break;
		}
		case S_IFLNK:
			if (size >= sizeof(target))
				die("a link target in the run's archive is too long");
			take(target, size);
			target[size] = 0;
			size = 0;
			unlink(name);
			if (symlink(target, name) != 0)
				die(name);
			break;
		default:
			die("the run's archive holds an entry of an unknown type");
		}
		take(NULL, size);
		align4();
	}
}

/* Binds the devices the host attached (platform device names, one a line). */
static void attach_devices(void)
{
	char line[64];
	FILE *f = fopen(DEVICES_FILE, "r");

	if (!f)
		return;
	while (fgets(line, sizeof(line), f)) {
		int fd = open("/sys/bus/platform/drivers_probe", O_WRONLY | O_CLOEXEC);
		line[strcspn(line, "\n")] = 0;
		if (fd < 0 || write(fd, line, strlen(line)) < 0)
			fprintf(stderr, "insight-init: cannot attach %s: %s\n", line, strerror(errno));
		if (fd >= 0)
			close(fd);
	}
	fclose(f);
}

/*
 * Mixes the run's own seed into the kernel's random number generator and
 * reseeds it: a restored guest would otherwise draw what every run from
 * the same snapshot draws.
 */
static void seed_random(void)
{
	struct {
		struct rand_pool_info info;
		unsigned char bytes[64];
	} seed;
	int fd = open(SEED_FILE, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return;
	ssize_t n = read(fd, seed.bytes, sizeof(seed.bytes));
	close(fd);
	unlink(SEED_FILE);
	if (n <= 0)
		return;
	seed.info.entropy_count = (int)n * 8;
	seed.info.buf_size = (int)n;
	fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
	if (fd < 0 || ioctl(fd, RNDADDENTROPY, &seed) != 0 || ioctl(fd, RNDRESEEDCRNG) != 0)
		fprintf(stderr, "insight-init: cannot seed the random number generator: %s\n",
			strerror(errno));
	if (fd >= 0)
		close(fd);
}

/* Sets the wall clock to the host's ("SECONDS NANOSECONDS"), if it is given. */
static void set_clock(void)
{
	long long sec = 0;
	long nsec = 0;
	FILE *f = fopen(CLOCK_FILE, "r");

	if (!f)
		return;
	if (fscanf(f, "%lld %ld", &sec, &nsec) == 2 && nsec >= 0 && nsec < 1000000000) {
		struct timespec ts = { .tv_sec = (time_t)sec, .tv_nsec = nsec };
		if (clock_settime(CLOCK_REALTIME, &ts) != 0)
			fprintf(stderr, "insight-init: cannot set the clock: %s\n", strerror(errno));
	}
	fclose(f);
	unlink(CLOCK_FILE);
}

static void mount_or_warn(const char *src, const char *dst, const char *type,
			  unsigned long flags)
{
	mkdir(dst, 0755);
	if (mount(src, dst, type, flags, NULL) != 0 && errno != EBUSY)
		fprintf(stderr, "insight-init: mount %s on %s: %s\n", type, dst,
			strerror(errno));
}

/*
 * Reads a file of NUL-separated strings into vec (at most max entries,
 * NULL-terminated); returns the count, 0 if the file is absent or empty.
 */
static size_t read_strings(const char *path, char *buf, size_t size, char **vec, size_t max)
{
	size_t len = 0, count = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return 0;
	for (;;) {
		ssize_t n = read(fd, buf + len, size - 1 - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			die(path);
		if (n == 0)
			break;
		len += (size_t)n;
		if (len == size - 1) {
			errno = E2BIG;
			die(path);
		}
	}
	close(fd);
	buf[len] = '\0';
	for (size_t pos = 0; pos < len && count < max;) {
		vec[count++] = buf + pos;
		pos += strlen(buf + pos) + 1;
	}
	vec[count] = NULL;
	return count;
}

/* The argv the host provided; a shell if none. */
static char **read_command(void)
{
	static char *fallback[] = { "/bin/sh", NULL };
	static char *argv[MAX_ARGS + 1];
	static char buf[256 * 1024];

	return read_strings(COMMAND_FILE, buf, sizeof(buf), argv, MAX_ARGS) ? argv : fallback;
}

/* KEY=VALUE entries the host provided for the command's environment. */
static void read_env(void)
{
	static char *vars[MAX_ARGS + 1];
	static char buf[64 * 1024];
	size_t n = read_strings(ENV_FILE, buf, sizeof(buf), vars, MAX_ARGS);

	for (size_t i = 0; i < n; i++)
		putenv(vars[i]);
}

/* The command's working directory, if the host chose one (read before
 * the host's files replace the root). */
static char workdir[PATH_MAX + 1];

static void read_workdir(void)
{
	FILE *f = fopen(WORKDIR_FILE, "r");

	if (!f)
		return;
	if (fgets(workdir, sizeof(workdir), f))
		workdir[strcspn(workdir, "\n")] = 0;
	fclose(f);
}

static void enter_workdir(void)
{
	if (workdir[0] && chdir(workdir) != 0)
		fprintf(stderr, "insight-init: cannot enter %s (%s): running in %s\n", workdir,
			strerror(errno), getenv("HOME"));
}

/* Copies the file `from` to `to` (made with `mode`); false if it cannot. */
static bool copy_file(const char *from, const char *to, mode_t mode)
{
	char buf[64 * 1024];
	ssize_t n = 0;
	int in = open(from, O_RDONLY | O_CLOEXEC), out = -1;

	if (in >= 0)
		out = open(to, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
	while (out >= 0 && (n = read(in, buf, sizeof(buf))) > 0)
		if (write(out, buf, (size_t)n) != n) {
			n = -1;
			break;
		}
	if (in >= 0)
		close(in);
	if (out >= 0 && close(out) != 0)
		n = -1;
	return in >= 0 && out >= 0 && n == 0;
}

/*
 * The host's files, where the run asks for them: the hypervisor's 9P
 * device (read-only, what it serves recorded) under an overlay whose
 * upper layer is a tmpfs, so the command writes where it likes and the
 * host's files never change. The guest's own /proc, /sys and /dev are
 * bound into that tree, which becomes the root: the command's path,
 * working directory and environment resolve as on the host. /tmp and /run
 * are the overlay's (in memory too): a working directory under the host's
 * /tmp stays visible.
 */
static void enter_host_files(void)
{
	static const char *own[] = { "/proc", "/sys", "/dev" };
	char path[64];

	if (access(HOST_FILES_FILE, F_OK) != 0)
		return;
	mkdir("/host", 0755);
	mkdir("/host-rw", 0755);
	mkdir("/merged", 0755);
	if (mount(HOST_FILES_TAG, "/host", "9p", MS_RDONLY,
		  "trans=virtio,version=9p2000.L,cache=loose,msize=262144") != 0)
		die("mount the host's files (9p)");
	if (mount("tmpfs", "/host-rw", "tmpfs", 0, "mode=0755") != 0)
		die("mount the host files' overlay (tmpfs)");
	mkdir("/host-rw/upper", 0755);
	mkdir("/host-rw/work", 0755);
	if (mount("overlay", "/merged", "overlay", 0,
		  "lowerdir=/host,upperdir=/host-rw/upper,workdir=/host-rw/work") != 0)
		die("mount the host files' overlay");
	for (size_t i = 0; i < sizeof(own) / sizeof(own[0]); i++) {
		snprintf(path, sizeof(path), "/merged%s", own[i]);
		mkdir(path, 0755);
		if (mount(own[i], path, NULL, MS_BIND | MS_REC, NULL) != 0)
			fprintf(stderr, "insight-init: cannot bind %s: %s\n", own[i],
				strerror(errno));
	}
	/* The probe library (`--probes`) is the image's: it goes into the
	 * overlay at its path, over whatever the host has there. */
	if (access(PROBE_LIBRARY, F_OK) == 0) {
		snprintf(path, sizeof(path), "/merged%s", PROBE_LIBRARY);
		if (!copy_file(PROBE_LIBRARY, path, 0755))
			fprintf(stderr, "insight-init: cannot place %s: %s\n", PROBE_LIBRARY,
				strerror(errno));
	}
	/* The image's own programs (its /usr/bin: the workloads), for the end
	 * of the command's PATH (crates/guest IMAGE_PROGRAMS): the host's
	 * programs of the same name come first. */
	mkdir("/merged" IMAGE_DIR, 0755);
	mkdir("/merged" IMAGE_PROGRAMS, 0755);
	if (mount("/usr/bin", "/merged" IMAGE_PROGRAMS, NULL, MS_BIND, NULL) != 0)
		fprintf(stderr, "insight-init: cannot bind the image's programs: %s\n",
			strerror(errno));
	mkdir("/merged/tmp", 01777);
	mkdir("/merged/run", 0755);
	if (chdir("/merged") != 0 || chroot(".") != 0 || chdir("/") != 0)
		die("enter the host's files");
}

/*
 * The command's terminal: the virtio console when the run attached it
 * (hvc0, a VM exit per buffer of output), else the serial console this
 * process inherited (ttyS0, a VM exit per byte), which keeps the kernel's
 * messages either way.
 */
static bool use_virtio_console(void)
{
	int fd = open("/dev/hvc0", O_RDWR | O_NOCTTY | O_CLOEXEC);
	bool ok = true;

	if (fd < 0) {
		if (errno != ENOENT)
			fprintf(stderr, "insight-init: cannot open /dev/hvc0: %s\n", strerror(errno));
		return false;
	}
	for (int std = 0; std <= 2; std++)
		if (dup2(fd, std) < 0) {
			fprintf(stderr, "insight-init: cannot use /dev/hvc0: %s\n", strerror(errno));
			ok = false;
		}
	close(fd);
	return ok;
}

/*
 * The command's standard input where it is a pipe: what the hypervisor
 * gave (input[off..len)) and not yet written to the pipe, whether the
 * host's input ended, and how long to wait before asking again when it
 * had nothing (ms, doubling up to INPUT_WAIT_MAX_MS).
 */
#define INPUT_WAIT_MAX_MS 64
static unsigned char input[64 * 1024] __attribute__((aligned(4096)));
static size_t input_len, input_off;
static bool input_ended;
static int input_wait_ms = 1;
static volatile unsigned long long input_answer;

/*
 * The command's standard streams that are pipes to the host's: a line per
 * stream, "0" for standard input, "1" or "2" for a pipe of its own, "2>&1"
 * for standard error in standard output's. The write ends of 1 and 2 go to
 * the command as its fds 1 and 2, the read end of 0 as its fd 0 (kept in
 * write_end[0], the end the command gets); input_fd is where this process
 * writes the command's input (-1 once it ended or nobody reads it).
 */
struct relays {
	int write_end[3];
	struct pollfd read_end[3]; /* one per relayed stream, and the command */
	unsigned stream[2];
	int count;
	int input_fd;
};

/* The streams file as read before the root may change. */
static char streams_text[256];
static size_t streams_len;

static void read_streams(void)
{
	int fd = open(STREAMS_FILE, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0)
		return;
	n = read(fd, streams_text, sizeof(streams_text) - 1);
	streams_len = n > 0 ? (size_t)n : 0;
	close(fd);
}

static void open_relays(struct relays *r)
{
	char line[16];
	bool out = false, err = false, err_with_out = false;
	FILE *f = streams_len ? fmemopen(streams_text, streams_len, "r") : NULL;

	bool in = false;

	memset(r, 0, sizeof(*r));
	r->write_end[0] = r->write_end[1] = r->write_end[2] = r->input_fd = -1;
	if (!f)
		return;
	while (fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = 0;
		in |= strcmp(line, "0") == 0;
		out |= strcmp(line, "1") == 0;
		err |= strcmp(line, "2") == 0;
		err_with_out |= strcmp(line, "2>&1") == 0;
	}
	fclose(f);
	for (unsigned stream = 1; stream <= 2; stream++) {
		int p[2];
		if (!(stream == 1 ? out : err))
			continue;
		if (pipe2(p, O_CLOEXEC) != 0) {
			fprintf(stderr, "insight-init: no pipe for stream %u, the terminal instead: %s\n",
				stream, strerror(errno));
			continue;
		}
		r->write_end[stream] = p[1];
		r->read_end[r->count].fd = p[0];
		r->read_end[r->count].events = POLLIN;
		r->stream[r->count++] = stream;
	}
	if (err_with_out)
		r->write_end[2] = r->write_end[1];
	if (in) {
		int p[2];
		if (pipe2(p, O_CLOEXEC) != 0) {
			fprintf(stderr, "insight-init: no pipe for standard input, the terminal instead: %s\n",
				strerror(errno));
			return;
		}
		r->write_end[0] = p[0];
		r->input_fd = p[1];
		fcntl(p[1], F_SETFL, O_NONBLOCK);
	}
}

/*
 * Asks the hypervisor for the command's standard input: a CTL_INPUT
 * message with the buffer in RSI, its size in RDI and in R8 the address
 * of a word it sets to the count of bytes it wrote, bit 63 set where the
 * host's input ended after them. One VM exit.
 */
static void ask_for_input(void)
{
	if (!have_port) {
		input_len = input_off = 0;
		input_ended = true;
		return;
	}
	/* The hypervisor writes only into pages that are there and this
	 * process's own (not shared copy-on-write since the fork): one store
	 * a page makes them so. */
	for (size_t i = 0; i < sizeof(input); i += 4096)
		((volatile unsigned char *)input)[i] = 0;
	((volatile unsigned char *)input)[sizeof(input) - 1] = 0;
	input_answer = 0;
	register volatile unsigned long long *answer __asm__("r8") = &input_answer;
	__asm__ volatile("outl %%eax, %%dx"
			 :
			 : "a"(CTL_MSG(CTL_INPUT, 0)), "d"(CTL_PORT), "S"(input),
			   "D"(sizeof(input)), "r"(answer)
			 : "memory");
	input_len = (size_t)(input_answer & 0xffffffff);
	if (input_len > sizeof(input))
		input_len = 0;
	input_off = 0;
	input_ended = input_answer >> 63;
	input_wait_ms = input_len ? 1 : (input_wait_ms * 2 > INPUT_WAIT_MAX_MS ? INPUT_WAIT_MAX_MS
									 : input_wait_ms * 2);
}

/*
 * Moves the command's standard input on: asks for more when all it had is
 * written, writes what the pipe takes, closes the pipe at the end of the
 * input (or when the command closed its end: EPIPE). Returns the poll
 * timeout it needs (ms, -1: none), and sets *writable to wait for room in
 * the pipe.
 */
static int feed_input(struct relays *r, bool *writable)
{
	*writable = false;
	if (r->input_fd < 0)
		return -1;
	if (input_off == input_len && !input_ended)
		ask_for_input();
	while (input_off < input_len) {
		ssize_t n = write(r->input_fd, input + input_off, input_len - input_off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN) {
			*writable = true;
			return -1;
		}
		if (n <= 0) {
			input_ended = true;
			input_off = input_len;
			break;
		}
		input_off += (size_t)n;
	}
	if (input_ended) {
		close(r->input_fd);
		r->input_fd = -1;
		return -1;
	}
	/* Written out: ask again at once if the host gave some, else later. */
	return input_len ? 0 : input_wait_ms;
}

/*
 * Hands the hypervisor n bytes the command wrote to its standard stream:
 * a CTL_OUTPUT message with the buffer in RSI, its length in RDI and in R8
 * the address of a word the hypervisor sets to 1 if the host's stream
 * takes no more (a pipe whose reader has gone), one VM exit. Outside
 * insight, they go to this process's own stream. Returns false where the
 * stream is closed.
 */
static unsigned char relayed[64 * 1024];
static volatile unsigned host_closed;

static bool relay(unsigned stream, size_t n)
{
	if (!have_port)
		return write((int)stream, relayed, n) >= 0 || errno != EPIPE;
	host_closed = 0;
	register volatile unsigned *answer __asm__("r8") = &host_closed;
	__asm__ volatile("outl %%eax, %%dx"
			 :
			 : "a"(CTL_MSG(CTL_OUTPUT, stream)), "d"(CTL_PORT), "S"(relayed), "D"(n),
			   "r"(answer)
			 : "memory");
	return !host_closed;
}

/*
 * Reads what one pipe holds and relays it: 1 if it relayed bytes, 0 if it
 * had none now, -1 at its end (closed). Where the host's stream takes no
 * more, the pipe is closed: the command's next write to it fails with
 * EPIPE (and SIGPIPE), as when a reader such as `head` exits natively.
 */
static int relay_once(struct relays *r, int i)
{
	ssize_t n = read(r->read_end[i].fd, relayed, sizeof(relayed));

	if (n < 0 && (errno == EINTR || errno == EAGAIN))
		return 0;
	if (n <= 0 || !relay(r->stream[i], (size_t)n)) {
		close(r->read_end[i].fd);
		r->read_end[i].fd = -1;
		return -1;
	}
	return 1;
}

/*
 * Relays the pipes until the command `cmd` exits, then what they still
 * hold: a process it left running may keep them open, and the run ends
 * with the command, as it does with a terminal.
 */
static void relay_until_exit(struct relays *r, pid_t cmd)
{
	int open_ends = r->count;
	struct pollfd *exited = &r->read_end[r->count];
	struct pollfd fds[4];

	exited->fd = (int)syscall(SYS_pidfd_open, cmd, 0);
	exited->events = POLLIN;
	while (open_ends > 0 || r->input_fd >= 0) {
		bool writable;
		int timeout = feed_input(r, &writable);
		nfds_t n = (nfds_t)r->count + 1;
		memcpy(fds, r->read_end, n * sizeof(fds[0]));
		fds[n].fd = writable ? r->input_fd : -1;
		fds[n].events = POLLOUT;
		fds[n].revents = 0;
		if (poll(fds, n + 1, timeout) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		for (nfds_t i = 0; i < n; i++)
			r->read_end[i].revents = fds[i].revents;
		for (int i = 0; i < r->count; i++)
			if (r->read_end[i].fd >= 0 && r->read_end[i].revents)
				open_ends -= relay_once(r, i) < 0;
		if (exited->fd >= 0 && exited->revents)
			break;
	}
	if (r->input_fd >= 0) {
		close(r->input_fd);
		r->input_fd = -1;
	}
	for (int i = 0; i < r->count; i++) {
		if (r->read_end[i].fd < 0)
			continue;
		fcntl(r->read_end[i].fd, F_SETFL, O_NONBLOCK);
		while (relay_once(r, i) > 0)
			;
		if (r->read_end[i].fd >= 0)
			close(r->read_end[i].fd);
	}
	if (exited->fd >= 0)
		close(exited->fd);
}

/*
 * The command's session: this process leads it, with the console as
 * controlling tty, and runs the command as its child. When a session
 * leader exits, the kernel hangs up its terminal and discards output not
 * yet transmitted; waiting here until the console has sent everything the
 * command wrote keeps the end of its output. Returns the command's status
 * as a shell reports it.
 */
static int session_leader(char **argv)
{
	struct termios t;
	int status;
	pid_t cmd;

	bool virtio_console = use_virtio_console();
	setsid();
	ioctl(STDIN_FILENO, TIOCSCTTY, 1);
	/*
	 * Output goes to the host's terminal as written: plain "\n" line ends
	 * (the host's terminal adds its own "\r"), and no output processing,
	 * which the interpreted guest kernel would do byte by byte.
	 */
	if (tcgetattr(STDOUT_FILENO, &t) == 0) {
		t.c_oflag &= ~(tcflag_t)(OPOST | ONLCR);
		tcsetattr(STDOUT_FILENO, TCSANOW, &t);
	}
	/* Which terminal the command has: input goes there from now on. */
	ctl(CTL_TERMINAL, virtio_console);
	struct relays relays;
	open_relays(&relays);
	cmd = fork();
	if (cmd < 0)
		return 125;
	if (cmd == 0) {
		for (int fd = 0; fd <= 2; fd++)
			if (relays.write_end[fd] >= 0 && dup2(relays.write_end[fd], fd) < 0)
				_exit(126);
		/* A program named by a relative path (a host program recorded
		 * as ./prog) runs by its absolute one, argv[0] as given: the
		 * path the hypervisor sees it execute names its file whatever
		 * directory the process goes to (the debugger, probes and the
		 * tracer read the program from there). */
		static char path[PATH_MAX];
		const char *file = argv[0];
		if (strchr(file, '/') && file[0] != '/' && realpath(file, path))
			file = path;
		execvp(file, argv);
		fprintf(stderr, "insight-init: cannot run %s: %s\n", argv[0],
			strerror(errno));
		_exit(errno == ENOENT ? 127 : 126);
	}
	/* Keys typed at the console are for the command, not for us. */
	signal(SIGINT, SIG_IGN);
	signal(SIGQUIT, SIG_IGN);
	signal(SIGTSTP, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	/* A command that stops reading its input: EPIPE here, not a signal. */
	signal(SIGPIPE, SIG_IGN);
	if (relays.write_end[0] >= 0)
		close(relays.write_end[0]);
	for (int fd = 1; fd <= 2; fd++)
		if (relays.write_end[fd] >= 0 && (fd == 1 || relays.write_end[2] != relays.write_end[1]))
			close(relays.write_end[fd]);
	/*
	 * The relay runs as soon as the command writes (a woken task that
	 * slept preempts it): what the command wrote reaches the host before
	 * it goes on, and a run that ends without its exit (poweroff -f)
	 * keeps what it wrote before.
	 */
	if (relays.count || relays.input_fd >= 0)
		relay_until_exit(&relays, cmd);
	while (waitpid(cmd, &status, 0) < 0) {
		if (errno != EINTR)
			return 125;
	}
	tcdrain(STDOUT_FILENO);
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return 125;
}

static int set_addr(int sock, struct ifreq *ifr, unsigned long request, in_addr_t addr)
{
	struct sockaddr_in *sin = (struct sockaddr_in *)&ifr->ifr_addr;
	memset(sin, 0, sizeof(*sin));
	sin->sin_family = AF_INET;
	sin->sin_addr.s_addr = addr;
	return ioctl(sock, request, ifr);
}

/* Brings interface `name` up, with address `addr`/`prefix` unless prefix < 0. */
static void if_up(int sock, const char *name, in_addr_t addr, int prefix)
{
	struct ifreq ifr;
	memset(&ifr, 0, sizeof(ifr));
	strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
	if (prefix >= 0) {
		in_addr_t mask = prefix ? htonl(~0u << (32 - prefix)) : 0;
		if (set_addr(sock, &ifr, SIOCSIFADDR, addr) != 0 ||
		    set_addr(sock, &ifr, SIOCSIFNETMASK, mask) != 0) {
			fprintf(stderr, "insight-init: cannot set the address of %s: %s\n",
				name, strerror(errno));
			return;
		}
	}
	if (ioctl(sock, SIOCGIFFLAGS, &ifr) != 0)
		goto fail;
	ifr.ifr_flags |= IFF_UP;
	if (ioctl(sock, SIOCSIFFLAGS, &ifr) != 0)
		goto fail;
	return;
fail:
	fprintf(stderr, "insight-init: cannot bring %s up: %s\n", name, strerror(errno));
}

/* lo, and eth0 with the address in NET_FILE ("a.b.c.d/len"), if any. */
static void setup_network(void)
{
	int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (sock < 0)
		return; /* a kernel without networking */
	if_up(sock, "lo", 0, -1);
	char line[64] = "";
	FILE *f = fopen(NET_FILE, "r");
	if (f) {
		if (!fgets(line, sizeof(line), f))
			line[0] = 0;
		fclose(f);
	}
	char *slash = strchr(line, '/');
	if (slash) {
		*slash = 0;
		struct in_addr addr;
		int prefix = atoi(slash + 1);
		if (inet_pton(AF_INET, line, &addr) == 1 && prefix > 0 && prefix <= 30)
			if_up(sock, "eth0", addr.s_addr, prefix);
		else
			fprintf(stderr, "insight-init: bad address in %s\n", NET_FILE);
	}
	close(sock);
}

int main(void)
{
	have_port = ioperm(CTL_PORT, CTL_PORTS, 1) == 0 && inl(CTL_PORT) == CTL_SIGNATURE;
	ctl(CTL_INIT_REACHED, CTL_INIT_ANNOUNCES_TERMINAL);

	mount_or_warn("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC);
	mount_or_warn("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC);
	mount_or_warn("devtmpfs", "/dev", "devtmpfs", MS_NOSUID);
	mount_or_warn("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV);
	mount_or_warn("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV);

	/* A boot snapshot is taken here; the run's own part comes next. */
	ctl(CTL_READY, 0);
	if (chdir("/") != 0)
		die("chdir");
	unpack_archive();
	attach_devices();
	seed_random();
	set_clock();

	setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 1);
	setenv("HOME", "/root", 1);
	setenv("TERM", "linux", 0);
	read_env();
	setup_network();
	read_workdir();
	read_streams();
	char **argv = read_command();
	enter_host_files();
	if (chdir("/root") != 0 && chdir("/") != 0)
		die("chdir");
	enter_workdir();

	pid_t child = fork();
	if (child < 0)
		die("fork");
	if (child == 0)
		_exit(session_leader(argv));

	int status = 0, code;
	for (;;) {
		pid_t pid = wait(&status);
		if (pid == child)
			break;
		if (pid < 0 && errno != EINTR)
			die("wait");
	}
	/* The session leader reports the command's status as its own. */
	if (WIFEXITED(status))
		code = WEXITSTATUS(status);
	else if (WIFSIGNALED(status))
		code = 128 + WTERMSIG(status);
	else
		code = 125;

	/*
	 * The run ends with the report: first let the console transmit what
	 * the command wrote (the UART drains on interrupts, which may still
	 * be pending), and the file systems reach their disks.
	 */
	tcdrain(STDOUT_FILENO);
	sync();
	ctl(CTL_EXIT_STATUS, (unsigned)code);
	reboot(RB_POWER_OFF);
	die("reboot");
	return 1;
}
