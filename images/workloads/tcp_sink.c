/*
 * tcp_sink PORT: accepts one TCP connection on PORT, reads it to the end
 * and prints how many bytes came and their SHA-256 (computed here, in user
 * space). With the host sending a file, the checksum proves every byte
 * arrived; recorded and replayed, it proves replay delivered the same.
 *
 * Prints "tcp_sink: listening on port PORT" once it accepts connections,
 * and at the end also the time from the first byte to the end of the
 * stream (guest clock), for throughput measurements.
 * Gives up after 120 s (guest time) without data.
 */
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "sha256.h"

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: tcp_sink PORT\n");
		return 2;
	}
	int port = atoi(argv[1]);
	int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port) };
	if (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
	    bind(ls, (struct sockaddr *)&sin, sizeof(sin)) != 0 || listen(ls, 1) != 0) {
		perror("tcp_sink: listen");
		return 1;
	}
	printf("tcp_sink: listening on port %d\n", port);
	fflush(stdout);
	int s = accept(ls, NULL, NULL);
	if (s < 0) {
		perror("tcp_sink: accept");
		return 1;
	}
	struct timeval tv = { .tv_sec = 120 };
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	static char buf[1 << 17];
	struct sha256 h;
	sha256_init(&h);
	unsigned long long total = 0;
	struct timespec first = { 0 }, last;
	for (;;) {
		ssize_t n = read(s, buf, sizeof(buf));
		if (total == 0 && n > 0)
			clock_gettime(CLOCK_MONOTONIC, &first);
		if (n == 0)
			break;
		if (n < 0) {
			if (errno == EINTR)
				continue;
			perror("tcp_sink: read");
			return 1;
		}
		sha256_update(&h, buf, (size_t)n);
		total += (unsigned long long)n;
	}
	clock_gettime(CLOCK_MONOTONIC, &last);
	char hex[65];
	sha256_hex(&h, hex);
	printf("tcp_sink: %llu bytes, sha256 %s\n", total, hex);
	long long ns = (last.tv_sec - first.tv_sec) * 1000000000LL + (last.tv_nsec - first.tv_nsec);
	printf("tcp_sink: received in %lld ns\n", total ? ns : 0);
	return 0;
}
