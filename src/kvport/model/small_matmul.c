/* y = x @ W^T (+ bias) for the few rows of a decode step, float32.
 *
 * Built with paged_attention.c by kvport/model/kernels.py. At 1-32 rows a projection reads its
 * weight once and does little arithmetic per byte, so its speed is the speed of that read.
 * torch's matmuls (MKL, and oneDNN on a prepacked weight) read SmolLM2's projections at 13-18
 * GB/s here, where two cores read 28-33 GB/s: their per-call set-up and blocking are made for
 * larger products. This kernel reads a weight packed as column tiles (kvport.model.linear):
 *
 *   wp (n_tiles, k, 16): wp[t, i, j] = W[16 t + j, i], zero beyond the last output column,
 *
 * so each 16-column tile is one contiguous run of 64 k bytes, streamed front to back by one
 * thread while 8 rows of x accumulate in 16 vector registers (two 8-lane halves per row). Each
 * output is a sum over i in order, in one float32 lane.
 */
#include <stdint.h>
#include <string.h>

#define TILE 16
#define ROWS 8 /* rows of x per pass over a tile: 2 * ROWS accumulators fill AVX2's 16 registers */

typedef float v8 __attribute__((vector_size(32)));

/* Rows r0 .. r0 + M - 1 of x against tile `t`; M a constant where this is inlined. */
static inline __attribute__((always_inline)) void tile_rows(
        const float *x, const float *w, const float *bias, float *y, int64_t k, int64_t n,
        int64_t t, const int M) {
    v8 lo[ROWS], hi[ROWS];
    for (int r = 0; r < M; r++) lo[r] = hi[r] = (v8){0};
    for (int64_t i = 0; i < k; i++) {
        v8 w0, w1;
        memcpy(&w0, w + i * TILE, sizeof w0);
        memcpy(&w1, w + i * TILE + 8, sizeof w1);
        for (int r = 0; r < M; r++) {
            const float xi = x[r * k + i];
            lo[r] += xi * w0;
            hi[r] += xi * w1;
        }
    }
    const int64_t c0 = t * TILE, cols = n - c0 < TILE ? n - c0 : TILE;
    for (int r = 0; r < M; r++) {
        float out[TILE];
        memcpy(out, &lo[r], sizeof lo[r]);
        memcpy(out + 8, &hi[r], sizeof hi[r]);
        for (int64_t j = 0; j < cols; j++)
            y[r * n + c0 + j] = out[j] + (bias ? bias[c0 + j] : 0.0f);
    }
}

/* x (m, k), wp (ceil(n / 16), k, 16), bias (n) or NULL -> y (m, n); all contiguous. */
void kvport_small_matmul(const float *x, const float *wp, const float *bias, float *y,
                         int64_t m, int64_t k, int64_t n) {
    const int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const float *w = wp + t * k * TILE;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const float *xr = x + r0 * k;
            float *yr = y + r0 * n;
            switch (m - r0 < ROWS ? m - r0 : ROWS) {
            case 1: tile_rows(xr, w, bias, yr, k, n, t, 1); break;
            case 2: tile_rows(xr, w, bias, yr, k, n, t, 2); break;
            case 3: tile_rows(xr, w, bias, yr, k, n, t, 3); break;
            case 4: tile_rows(xr, w, bias, yr, k, n, t, 4); break;
            case 5: tile_rows(xr, w, bias, yr, k, n, t, 5); break;
            case 6: tile_rows(xr, w, bias, yr, k, n, t, 6); break;
            case 7: tile_rows(xr, w, bias, yr, k, n, t, 7); break;
            default: tile_rows(xr, w, bias, yr, k, n, t, 8); break;
            }
        }
    }
}
