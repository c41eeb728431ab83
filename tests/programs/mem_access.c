/* Known memory accesses and a loop of a known number of instructions, for
 * the replay-time expansion tests (docs/expansion.md).
 *
 * mem_access: writes each element of the global `a` once and reads it back
 * twice (1000 stores, 2000 loads of 4 bytes), then runs `exact_loop`: one
 * `mov` and 1000 times `dec; jnz` (2001 instructions between the labels
 * exact_loop and exact_loop_end). */
#include <stdio.h>

volatile int a[1000];

void exact_loop(void);
__asm__(".text\n"
        ".globl exact_loop\n"
        ".type exact_loop, @function\n"
        "exact_loop:\n"
        "    mov $1000, %ecx\n"
        "1:  dec %ecx\n"
        "    jnz 1b\n"
        ".globl exact_loop_end\n"
        "exact_loop_end:\n"
        "    ret\n");

int main(void)
{
    for (int i = 0; i < 1000; i++)
        a[i] = i;
    long sum = 0;
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < 1000; i++)
            sum += a[i];
    exact_loop();
    printf("sum %ld\n", sum);
    return 0;
}
