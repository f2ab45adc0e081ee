/* The cost of AMX tile instructions on this processor, one thread (docs/CPU.md, "AMX products").
 *
 *   gcc -O2 -mamx-tile -mamx-int8 bench/bench_amx_tiles.c -o /tmp/amx_tiles && /tmp/amx_tiles
 *
 * Cycles are CPU time (CLOCK_THREAD_CPUTIME_ID) at a nominal 2.6 GHz, per iteration of each loop:
 * a chain of TDPBSSD into one tile; four independent ones; TILEZERO + TDPBSSD + TILESTORED (what a
 * 32-weight block of the products costs per sum tile); the same with the tile loads; two
 * independent such chains; a tile store alone. K = 32 (one block) and K = 64. */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(void) { struct timespec a; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a); return a.tv_sec + 1e-9 * a.tv_nsec; }
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1;
    for (int K = 32; K <= 64; K += 32) {
    cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    c.colsb[0] = K; c.rows[1] = K / 4; c.colsb[7] = K; c.rows[6] = K/4;
    _tile_loadconfig(&c);
    static int8_t buf[4096] __attribute__((aligned(64)));
    static int32_t out[2][256] __attribute__((aligned(64)));
    _tile_loadd(0, buf, 64); _tile_loadd(1, buf, 64); _tile_loadd(7, buf, 64); _tile_loadd(6, buf, 64);
    int N = 200000;
    double t0 = now();
    for (int i = 0; i < N; i++) { _tile_dpbssd(2, 0, 1); }
    double t1 = now();
    for (int i = 0; i < N; i++) { _tile_dpbssd(2, 0, 1); _tile_dpbssd(3, 0, 1); _tile_dpbssd(4, 0, 1); _tile_dpbssd(5, 0, 1); }
    double t2 = now();
    for (int i = 0; i < N; i++) { _tile_zero(2); _tile_dpbssd(2, 0, 1); _tile_stored(2, out[0], 64); }
    double t3 = now();
    for (int i = 0; i < N; i++) { _tile_loadd(0, buf + (i & 7) * 512, 32); _tile_loadd(1, buf + 2048, 64); _tile_zero(2); _tile_dpbssd(2, 0, 1); _tile_stored(2, out[0], 64); }
    double t4 = now();
    for (int i = 0; i < N; i++) { _tile_zero(2); _tile_dpbssd(2, 0, 1); _tile_stored(2, out[0], 64);_tile_zero(3); _tile_dpbssd(3, 7, 6); _tile_stored(3, out[1], 64); }
    double t5 = now();
    for (int i = 0; i < N; i++) { _tile_stored(2, out[i&1], 64); }
    double t6 = now();
    double f = 2.6e9 / N;
    printf("K=%d: dependent tdp %.1f, 4 independent %.1f each, zero+tdp+store %.1f, loads+zero+tdp+store %.1f, 2x(zero+tdp+store) %.1f, store %.1f cycles\n",
           K, (t1 - t0) * f, (t2 - t1) * f / 4, (t3 - t2) * f, (t4 - t3) * f, (t5-t4)*f, (t6-t5)*f);
    _tile_release();
    }
    return 0;
}
