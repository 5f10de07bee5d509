/* Engine blocks between the engine's KV pool and the host tier's rows, with streaming stores.
 *
 * Built by kvport/connectors/offloading/tiers/host/block_copy.py. A pool is one or more segments
 * (engine_pool.py): engine block b of segment s is the page of page_bytes[s] bytes at
 * segs[s] + b * block_strides[s] (a page, or more where other layers' pages lie between), and a
 * host row holds a block's pages side by side, in segment order. One call copies n blocks: block blocks[i] <-> host row host_rows[i], every segment.
 *
 * Why not memcpy: below glibc's non-temporal threshold (about 3/4 of the last-level cache, so
 * every page here) memcpy stores through the cache, and each destination line is first read
 * from memory (read for ownership), then written back when evicted: three memory transfers per
 * line copied. A streaming store writes the line without reading it (two transfers), and does
 * not evict the lines the engine's next forward reuses. Measured on a 2-vCPU Zen 3 VM, 64 MiB in
 * rows of 32-720 KiB: one thread 10.5-12 GiB/s, memcpy 7.2-7.6, torch's 2-thread copy_ 7.6-9.6.
 * Neither side of a transfer is read again soon: a stored block waits in the tier, and a loaded
 * one is read once by attention.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#define LINE 64

static void stream_copy(char *dst, const char *src, int64_t n) {
#if defined(__AVX__) || defined(__SSE2__)
    int64_t head = (int64_t)((LINE - ((uintptr_t)dst & (LINE - 1))) & (LINE - 1));
    if (n < 4 * LINE) { /* too short for the stores to pay for the fence */
        memcpy(dst, src, (size_t)n);
        return;
    }
    memcpy(dst, src, (size_t)head); /* up to the first whole line of the destination */
    int64_t i = head;
    for (; i + 2 * LINE <= n; i += 2 * LINE) {
#if defined(__AVX__)
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
#else
        for (int k = 0; k < 2 * LINE; k += 16)
            _mm_stream_si128((__m128i *)(dst + i + k),
                             _mm_loadu_si128((const __m128i *)(src + i + k)));
#endif
    }
    memcpy(dst + i, src + i, (size_t)(n - i)); /* the tail after the last pair of lines */
#else
    memcpy(dst, src, (size_t)n);
#endif
}

/* The first i with blocks[i] or host_rows[i] out of range, else -1. */
int64_t kvport_check_blocks(const int64_t *host_rows, int64_t num_rows, const int64_t *blocks,
                            int64_t num_blocks, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (host_rows[i] < 0 || host_rows[i] >= num_rows || blocks[i] < 0 ||
            blocks[i] >= num_blocks)
            return i;
    return -1;
}

/* to_host != 0: pool -> host rows (a store), else host rows -> pool (a load). Returns -1, or
 * the first pair out of range (kvport_check_blocks) having copied nothing. */
int64_t kvport_copy_blocks(int64_t to_host, char *host, int64_t host_row_bytes,
                           const int64_t *host_rows, int64_t num_rows, char *const *segs,
                           const int64_t *page_bytes, const int64_t *block_strides,
                           int64_t num_segs, const int64_t *blocks,
                           int64_t num_blocks, int64_t n) {
    int64_t bad = kvport_check_blocks(host_rows, num_rows, blocks, num_blocks, n);
    if (bad >= 0)
        return bad;
    for (int64_t i = 0; i < n; i++) {
        char *row = host + host_rows[i] * host_row_bytes;
        for (int64_t s = 0; s < num_segs; s++) {
            char *page = segs[s] + blocks[i] * block_strides[s];
            if (to_host)
                stream_copy(row, page, page_bytes[s]);
            else
                stream_copy(page, row, page_bytes[s]);
            row += page_bytes[s];
        }
    }
#if defined(__AVX__) || defined(__SSE2__)
    /* streaming stores are weakly ordered: make them visible before the caller reports done */
    _mm_sfence();
#endif
    return -1;
}
