/* Known memory accesses and a loop of a known number of instructions, for
 * the replay-time expansion tests (docs/expansion.md).
 *
 * mem_access: writes each element of the global `a` once and reads it back
 * twice (1000 stores, 2000 loads of 4 bytes), then runs `exact_loop`: one
 * `mov` and 1000 times `dec; jnz` (2001 instructions between the labels
 * exact_loop and exact_loop_end). Then three heap blocks from three call
 * sites: make_ints' malloc(64), stored and loaded 16 times 4 bytes;
 * make_longs' calloc(8, 8), loaded 8 times 8 bytes, freed, then stored
 * once (8 bytes at offset 16: a use after free); make_bytes' malloc(100),
 * stored 10 times 1 byte. */
#include <stdio.h>
#include <stdlib.h>

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

/* Each allocates at a call site of its own (the empty asm keeps the call
 * from becoming a jump, which would name the caller's caller). */
__attribute__((noinline)) static volatile int *make_ints(void)
{
    volatile int *p = malloc(16 * sizeof(int));
    __asm__ volatile("" ::: "memory");
    return p;
}

__attribute__((noinline)) static volatile long *make_longs(void)
{
    volatile long *p = calloc(8, sizeof(long));
    __asm__ volatile("" ::: "memory");
    return p;
}

__attribute__((noinline)) static volatile char *make_bytes(void)
{
    volatile char *p = malloc(100);
    __asm__ volatile("" ::: "memory");
    return p;
}

int main(void)
{
    for (int i = 0; i < 1000; i++)
        a[i] = i;
    long sum = 0;
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < 1000; i++)
            sum += a[i];
    exact_loop();

    volatile int *ints = make_ints();
    volatile long *longs = make_longs();
    volatile char *bytes = make_bytes();
    if (!ints || !longs || !bytes)
        return 1;
    for (int i = 0; i < 16; i++)
        ints[i] = i;
    long heap = 0;
    for (int i = 0; i < 16; i++)
        heap += ints[i];
    for (int i = 0; i < 8; i++)
        heap += longs[i];
    for (int i = 0; i < 10; i++)
        bytes[i] = (char)i;
    free((void *)longs);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuse-after-free"
    longs[2] = heap; /* after free: on purpose */
#pragma GCC diagnostic pop
    printf("sum %ld heap %ld\n", sum, heap);
    return 0;
}
