/* Decode attention straight from the paged KV pool: one query token per sequence.
 *
 * Built and loaded by kvport/model/kernels.py (gcc -O3 -march=native -fopenmp, called through
 * ctypes). torch's scaled_dot_product_attention needs each sequence's keys and values side by
 * side, so the torch path first gathers them out of the pool (an index_select of every block,
 * per layer) and then runs a flash kernel sized for long queries. Here each (sequence, KV head)
 * task reads its blocks where they lie, once.
 *
 * Layout (strides in elements; the last dimension of every tensor is contiguous):
 *   q    (n, heads, head_dim)                          q_tok, q_head
 *   kv   one layer's view of the pool (blocks, 2, block_size, kv_heads, head_dim)
 *                                                       kv_block, kv_kv, kv_tok, kv_head
 *   out  (n, heads, head_dim)                          o_tok, o_head
 *   tables (n, table_len) int64 block ids; lens (n,) int64: the keys sequence i sees
 * Every block id a call would read or write is checked against num_blocks first (like
 * block_copy.c): an id out of range returns an error code, having touched nothing, instead of
 * reading or writing memory outside the pool.
 * Query heads h * group .. h * group + group - 1 share KV head h (GQA, as in the checkpoints).
 * Scores, softmax and sums are float32; bfloat16 is widened on load and the output rounded to
 * nearest even, as torch rounds.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t n, heads, kv_heads, head_dim, block_size, table_len;
    int64_t q_tok, q_head, kv_block, kv_kv, kv_tok, kv_head, o_tok, o_head;
    int64_t num_blocks; /* blocks in the pool: every id must be in [0, num_blocks) */
    float scale;
    int32_t bf16; /* 1: every tensor is bfloat16, 0: float32 */
} Geometry;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of a float32 or bfloat16 array (`bf16` is a constant where this is inlined). */
static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline const void *at(const void *p, int64_t offset, int bf16) {
    return (const char *)p + offset * (bf16 ? 2 : 4);
}

/* One task: sequence `i`'s query rows of KV heads h0 .. h1 - 1 against its `len` keys. Always
 * inlined with a constant `bf16`, so each dtype gets its own vectorized loops (a runtime flag
 * inside them kept them scalar: 10x slower). The pool is walked block by block, each block's
 * keys (then values) of every head in the task read front to back, the next block prefetched:
 * the reads come from DRAM (the step's weights have evicted them) and a block lies anywhere. */
static inline __attribute__((always_inline)) void attend(
        const Geometry *g, const void *q, const void *kv, const int64_t *table, int64_t len,
        int64_t h0, int64_t h1, void *out, float *buf, const int bf16) {
    const int64_t group = g->heads / g->kv_heads, d = g->head_dim, bs = g->block_size;
    const int64_t rows = (h1 - h0) * group, elem = bf16 ? 2 : 4;
    float *qf = buf, *acc = qf + rows * d, *sum = acc + rows * d, *scores = sum + rows;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < d; j++)
            qf[r * d + j] = load(q, (h0 * group + r) * g->q_head + j, bf16) * g->scale;
    for (int pass = 0; pass < 2; pass++) {  /* 0: scores from the keys, 1: sums of the values */
        if (pass == 1) memset(acc, 0, sizeof(float) * rows * d);
        for (int64_t t0 = 0; t0 < len; t0 += bs) {
            const int64_t b = t0 / bs, end = t0 + bs < len ? t0 + bs : len;
            if (t0 + bs < len) {  /* the first lines of the next block, for each head */
                const char *next = at(kv, table[b + 1] * g->kv_block + pass * g->kv_kv, bf16);
                for (int64_t h = h0; h < h1; h++)
                    __builtin_prefetch(next + h * g->kv_head * elem);
            }
            const int64_t base = table[b] * g->kv_block + pass * g->kv_kv;
            for (int64_t t = t0; t < end; t++) {
                for (int64_t h = h0; h < h1; h++) {
                    const void *x = at(kv, base + (t - t0) * g->kv_tok + h * g->kv_head, bf16);
                    for (int64_t r = (h - h0) * group; r < (h - h0 + 1) * group; r++) {
                        if (pass == 0) {
                            const float *qr = qf + r * d;
                            float s = 0.0f;
#pragma omp simd reduction(+ : s)
                            for (int64_t j = 0; j < d; j++) s += qr[j] * load(x, j, bf16);
                            scores[r * len + t] = s;
                        } else {
                            const float p = scores[r * len + t];
                            float *restrict ar = acc + r * d;
#pragma omp simd
                            for (int64_t j = 0; j < d; j++) ar[j] += p * load(x, j, bf16);
                        }
                    }
                }
            }
        }
        if (pass == 1) break;
        for (int64_t r = 0; r < rows; r++) {  /* softmax numerators and their sums */
            float *sr = scores + r * len, m = -FLT_MAX, total = 0.0f;
            for (int64_t t = 0; t < len; t++) m = sr[t] > m ? sr[t] : m;
            for (int64_t t = 0; t < len; t++) {
                sr[t] = expf(sr[t] - m);
                total += sr[t];
            }
            sum[r] = total;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = len > 0 ? 1.0f / sum[r] : 0.0f;
        const int64_t o = (h0 * group + r) * g->o_head;
        for (int64_t j = 0; j < d; j++) {
            const float x = acc[r * d + j] * inv;
            if (bf16)
                ((uint16_t *)out)[o + j] = f32_to_bf16(x);
            else
                ((float *)out)[o + j] = x;
        }
    }
}

/* 0 when every sequence's length fits its table (0 <= lens[i] <= table_len * block_size) and
 * every block its keys lie in is in [0, num_blocks); else KVPORT_BAD_LEN (where[0] = i) or
 * KVPORT_BAD_BLOCK (where[0] = i, where[1] = the table column), for the first one found. */
#define KVPORT_BAD_LEN 1
#define KVPORT_BAD_BLOCK 2
int kvport_check_tables(const Geometry *g, const int64_t *tables, const int64_t *lens,
                        int64_t *where) {
    for (int64_t i = 0; i < g->n; i++) {
        const int64_t len = lens[i];
        where[0] = i;
        if (len < 0 || len > g->table_len * g->block_size)
            return KVPORT_BAD_LEN;
        for (int64_t b = 0; b * g->block_size < len; b++) {
            const int64_t id = tables[i * g->table_len + b];
            where[1] = b;
            if (id < 0 || id >= g->num_blocks)
                return KVPORT_BAD_BLOCK;
        }
    }
    return 0;
}

/* out = attention of each sequence's one query over its first lens[i] keys. A task is one
 * sequence, or one of its KV heads when there are fewer sequences than threads. Returns 0, or
 * -1 when a task could not get its scratch memory (out is then incomplete: the caller falls
 * back), or kvport_check_tables' code (nothing read or written). */
int kvport_decode_attention(const Geometry *g, const void *q, const void *kv,
                            const int64_t *tables, const int64_t *lens, void *out,
                            int64_t *where) {
    const int bad = kvport_check_tables(g, tables, lens, where);
    if (bad != 0)
        return bad;
    const int64_t group = g->heads / g->kv_heads, d = g->head_dim, elem = g->bf16 ? 2 : 4;
    const int64_t split = g->n < omp_get_max_threads() ? g->kv_heads : 1;
    const int64_t per_task = g->kv_heads / split;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < g->n * split; task++) {
        const int64_t i = task / split, h0 = task % split * per_task, len = lens[i];
        float *buf = malloc(sizeof(float) * per_task * group * (2 * d + 1 + len));
        if (buf == NULL) {
            failed = 1;
            continue;
        }
        const void *qi = at(q, i * g->q_tok, g->bf16);
        void *oi = (char *)out + i * g->o_tok * elem;
        const int64_t *table = tables + i * g->table_len;
        if (g->bf16)
            attend(g, qi, kv, table, len, h0, h0 + per_task, oi, buf, 1);
        else
            attend(g, qi, kv, table, len, h0, h0 + per_task, oi, buf, 0);
        free(buf);
    }
    return failed ? -1 : 0;
}

/* pool[slot_blocks[t], 0 (K) / 1 (V), slot_offsets[t]] = k[t], v[t] for the step's n tokens, all
 * their KV heads: one call per layer instead of two index_put ops (the rows are head_dim
 * elements of `elem` bytes; any dtype). Returns -1, or the first token whose block is not in
 * [0, num_blocks) or whose offset is not in [0, block_size), having written nothing. */
int64_t kvport_store_kv(const Geometry *g, void *kv, const int64_t *slot_blocks,
                        const int64_t *slot_offsets, const void *k, int64_t k_tok,
                        const void *v, int64_t v_tok, int64_t elem) {
    for (int64_t t = 0; t < g->n; t++)
        if (slot_blocks[t] < 0 || slot_blocks[t] >= g->num_blocks || slot_offsets[t] < 0 ||
            slot_offsets[t] >= g->block_size)
            return t;
    const int64_t row = g->head_dim * elem;
#pragma omp parallel for schedule(static) if (g->n > 256)
    for (int64_t t = 0; t < g->n; t++) {
        char *dst = (char *)kv + (slot_blocks[t] * g->kv_block + slot_offsets[t] * g->kv_tok) * elem;
        const char *kt = (const char *)k + t * k_tok * elem, *vt = (const char *)v + t * v_tok * elem;
        for (int64_t h = 0; h < g->kv_heads; h++) {
            memcpy(dst + h * g->kv_head * elem, kt + h * g->head_dim * elem, row);
            memcpy(dst + (g->kv_kv + h * g->kv_head) * elem, vt + h * g->head_dim * elem, row);
        }
    }
    return -1;
}
