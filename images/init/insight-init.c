/*
 * /init of the insight guest.
 *
 * Mounts the usual file systems, brings up the loopback interface and, if
 * the host put an address in /etc/insight/net, eth0; runs the guest
 * command that the host put
 * in /etc/insight/command (NUL-separated argv, appended to the initramfs at
 * boot), reaps orphans while it runs, and reports the command's exit status
 * to the hypervisor's platform control port before powering off.
 *
 * Exit status as a shell reports it: the code of a normal exit, 128+N for
 * death by signal N.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

/* The protocol of the platform control port (see docs/ARCHITECTURE.md). */
#define CTL_PORT 0x0f00
#define CTL_INIT_REACHED 0x01
#define CTL_EXIT_STATUS 0x02
#define CTL_MSG(code, arg) (((unsigned)(code) << 24) | ((unsigned)(arg) & 0xffffff))

#define COMMAND_FILE "/etc/insight/command"
#define ENV_FILE "/etc/insight/env"
#define NET_FILE "/etc/insight/net"
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

	setsid();
	ioctl(STDIN_FILENO, TIOCSCTTY, 1);
	/* Plain "\n" line ends: the host's terminal adds its own "\r". */
	if (tcgetattr(STDOUT_FILENO, &t) == 0) {
		t.c_oflag &= ~(tcflag_t)ONLCR;
		tcsetattr(STDOUT_FILENO, TCSANOW, &t);
	}
	cmd = fork();
	if (cmd < 0)
		return 125;
	if (cmd == 0) {
		execvp(argv[0], argv);
		fprintf(stderr, "insight-init: cannot run %s: %s\n", argv[0],
			strerror(errno));
		_exit(errno == ENOENT ? 127 : 126);
	}
	/* Keys typed at the console are for the command, not for us. */
	signal(SIGINT, SIG_IGN);
	signal(SIGQUIT, SIG_IGN);
	signal(SIGTSTP, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
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
	have_port = ioperm(CTL_PORT, 4, 1) == 0;
	ctl(CTL_INIT_REACHED, 0);

	mount_or_warn("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC);
	mount_or_warn("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC);
	mount_or_warn("devtmpfs", "/dev", "devtmpfs", MS_NOSUID);
	mount_or_warn("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV);
	mount_or_warn("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV);

	setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 1);
	setenv("HOME", "/root", 1);
	setenv("TERM", "linux", 0);
	read_env();
	setup_network();
	if (chdir("/root") != 0 && chdir("/") != 0)
		die("chdir");

	char **argv = read_command();
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
