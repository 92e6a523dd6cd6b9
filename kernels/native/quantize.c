/* Quantized cache rows (hybridkv/cache_dtype.py): encode float32 items into one-byte codes and a
 * float32 scale per row, and decode them back, one pass each.
 *
 * An item is float32 [A][L][B] (row = the L values at fixed (a, b), stride B); its bytes are the
 * codes in the same order, zero padding up to code_bytes, then the scales [A][B] (float32). Per row:
 * scale = max |x| / top (127 for int8, 448 for float8 e4m3fn), inv = 1 / scale (0 for an all-zero
 * row), code = round-to-nearest-even(x * inv) clamped to +-top; a row holding a NaN or an infinity
 * gets codes 0 and a NaN scale (it decodes to NaN). The same float32 arithmetic as QuantLayout's
 * torch path, which is the specification (tests/kernels/test_quantize.py compares the bytes).
 *
 * The gather / scatter forms (quant_decode_gather_f32, quant_encode_scatter_f32) do the same per
 * item, reading or writing a pool's items in place by their index: no copy of the rows between.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_rows.h" /* encode_item, decode_item */

void quant_encode_f32(const float *x, uint8_t *raw, int64_t items, int64_t A, int64_t L, int64_t B,
                      int64_t nbytes, int64_t code_bytes, int fp8) {
    const float top = fp8 ? 448.0f : 127.0f;
    for (int64_t i = 0; i < items; i++) encode_item(x + i * A * L * B, raw + i * nbytes, A, L, B, code_bytes, fp8, top);
}

void quant_decode_f32(const uint8_t *raw, float *y, int64_t items, int64_t A, int64_t L, int64_t B,
                      int64_t nbytes, int64_t code_bytes, const float *fp8_values) {
    for (int64_t i = 0; i < items; i++) decode_item(raw + i * nbytes, y + i * A * L * B, A, L, B, code_bytes, fp8_values);
}

/* 0 when each of the n runs of `group` items starting at first[i] lies in [0, items); else 2. */
static int runs_inside(const int64_t *first, int64_t n, int64_t group, int64_t items) {
    for (int64_t i = 0; i < n; i++)
        if (first[i] < 0 || first[i] > items - group) return 2;
    return 0;
}

/* Gather and decode: the n runs of `group` consecutive items of the pool (pool_items items of
 * nbytes) starting at item src[i] -> y, run after run ([n * group] items of A*L*B floats). The
 * same arithmetic as quant_decode_f32. Returns 2 (nothing written) when a run leaves the pool. */
int quant_decode_gather_f32(const uint8_t *pool, int64_t pool_items, const int64_t *src, int64_t n, int64_t group,
                            float *y, int64_t A, int64_t L, int64_t B, int64_t nbytes, int64_t code_bytes,
                            const float *fp8_values) {
    if (runs_inside(src, n, group, pool_items)) return 2;
    const int64_t numel = A * L * B;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < group; j++)
            decode_item(pool + (src[i] + j) * nbytes, y + (i * group + j) * numel, A, L, B, code_bytes, fp8_values);
    return 0;
}

/* Encode and scatter: for each of the n runs, the `group` items of x (x_items items of A*L*B
 * floats) starting at item src[i] are encoded into the pool's items starting at dst[i]. The same
 * arithmetic as quant_encode_f32; runs are written in order (a later run to the same items wins).
 * Returns 2 (nothing written) when a run leaves x or the pool. */
int quant_encode_scatter_f32(const float *x, int64_t x_items, const int64_t *src, uint8_t *pool, int64_t pool_items,
                             const int64_t *dst, int64_t n, int64_t group, int64_t A, int64_t L, int64_t B,
                             int64_t nbytes, int64_t code_bytes, int fp8) {
    if (runs_inside(src, n, group, x_items) || runs_inside(dst, n, group, pool_items)) return 2;
    const float top = fp8 ? 448.0f : 127.0f;
    const int64_t numel = A * L * B;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < group; j++)
            encode_item(x + (src[i] + j) * numel, pool + (dst[i] + j) * nbytes, A, L, B, code_bytes, fp8, top);
    return 0;
}
