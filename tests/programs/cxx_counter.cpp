// A C++ program brought into the guest by its host path: it reads a count
// from the file its argument names, has two threads `add` that many times
// in a library beside it (found by its RUNPATH, $ORIGIN/lib) and prints
// the total.
#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>

extern "C" void add(long n);
extern "C" long total_added();

int main(int argc, char **argv)
{
	long n = 0;
	std::ifstream input(argc > 1 ? argv[1] : "count.txt");
	if (!(input >> n)) {
		std::perror("cxx_counter: cannot read the count");
		return 2;
	}
	std::vector<std::thread> threads;
	for (int i = 0; i < 2; i++)
		threads.emplace_back(add, n);
	for (auto &t : threads)
		t.join();
	std::printf("cxx_counter: total %ld\n", total_added());
	return 0;
}
