/*
 * udp_sink PORT SENDERS FILE [IDLE]: receives datagrams on UDP port PORT
 * and appends each to FILE, until SENDERS datagrams reading "end" have
 * come (one per sender) or IDLE seconds (guest time, default 30) pass
 * without any. Then prints how
 * many datagrams came and the SHA-256 of FILE. Two senders interleave
 * differently in every run: the file's checksum tells whether a replay
 * delivered the same datagrams in the same order.
 *
 * Prints "udp_sink: listening on port PORT" once it accepts datagrams.
 */
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sha256.h"

int main(int argc, char **argv)
{
	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: udp_sink PORT SENDERS FILE [IDLE_SECONDS]\n");
		return 2;
	}
	int port = atoi(argv[1]), senders = atoi(argv[2]);
	int idle = argc == 5 ? atoi(argv[4]) : 30;
	if (idle <= 0)
		idle = 30;
	FILE *out = fopen(argv[3], "a");
	if (!out) {
		perror(argv[3]);
		return 1;
	}
	int s = socket(AF_INET, SOCK_DGRAM, 0);
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port) };
	if (s < 0 || bind(s, (struct sockaddr *)&sin, sizeof(sin)) != 0) {
		perror("udp_sink: bind");
		return 1;
	}
	printf("udp_sink: listening on port %d\n", port);
	fflush(stdout);
	static char buf[65536];
	int ends = 0;
	unsigned long datagrams = 0;
	while (ends < senders) {
		struct pollfd p = { .fd = s, .events = POLLIN };
		int r = poll(&p, 1, idle * 1000);
		if (r == 0) {
			printf("udp_sink: no datagram for %d s, %d of %d senders ended\n", idle, ends,
			       senders);
			break;
		}
		if (r < 0)
			continue;
		ssize_t n = recv(s, buf, sizeof(buf), 0);
		if (n < 0)
			continue;
		datagrams++;
		if ((n == 3 || n == 4) && memcmp(buf, "end", 3) == 0)
			ends++;
		fwrite(buf, 1, (size_t)n, out);
	}
	if (fclose(out) != 0) {
		perror(argv[3]);
		return 1;
	}
	FILE *in = fopen(argv[3], "r");
	if (!in) {
		perror(argv[3]);
		return 1;
	}
	struct sha256 h;
	sha256_init(&h);
	size_t n;
	while ((n = fread(buf, 1, sizeof(buf), in)) > 0)
		sha256_update(&h, buf, n);
	fclose(in);
	char hex[65];
	sha256_hex(&h, hex);
	printf("udp_sink: %lu datagrams, sha256 %s  %s\n", datagrams, hex, argv[3]);
	return ends == senders ? 0 : 1;
}
