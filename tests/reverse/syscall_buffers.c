/* What system calls write into the program's memory, taken back: a pipe's
   descriptors, bytes read from it, the process's ids. */

#include <unistd.h>

int fds[2] = { -1, -1 };
char buf[8];
pid_t pid = -1;

void
before (void)
{
}

void
after (void)
{
}

int
main (void)
{
  before ();
  if (pipe (fds) != 0)		/* the pipe */
    return 1;
  write (fds[1], "insight", 7);
  read (fds[0], buf, 7);	/* the read */
  pid = getpid ();
  after ();
  return 0;
}
