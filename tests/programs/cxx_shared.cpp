// The library a host program's test links with: `add` counts under a
// std::mutex (libstdc++, which the guest image does not carry).
#include <mutex>

static std::mutex shared;
static long total;

extern "C" void add(long n)
{
	for (long i = 0; i < n; i++) {
		std::lock_guard<std::mutex> hold(shared);
		total++;
	}
}

extern "C" long total_added()
{
	return total;
}
