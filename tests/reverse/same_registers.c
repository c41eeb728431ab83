/* Three calls of one function from three lines of main, the last two with
   the same registers throughout: the argument is the same, the function
   leaves the same value in RAX each time, and what main does between the
   calls stores immediates only. Only the return address on the stack (and
   main's `stage`) tells the calls apart, so a debugger that knows a position
   by its registers alone takes one call for another. */

volatile int sink;
int stage;

void
touch (int v)
{
  sink = v;			/* in touch */
}

int
main (void)
{
  touch (7);			/* first call */
  stage = 1;			/* after the first call */
  touch (7);			/* second call */
  stage = 2;			/* after the second call */
  touch (7);			/* third call */
  stage = 3;			/* after the third call */
  return 0;			/* end of main */
}
