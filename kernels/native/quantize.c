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

/* float -> float8 e4m3fn (bias 7, no infinities, 0x7F the NaN), round to nearest even; |v| <= 448. */
static inline uint8_t to_e4m3(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float a = fabsf(v);
    if (isnan(a)) return sign | 0x7F;
    if (a > 448.0f) a = 448.0f;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f); /* subnormal steps of 2^-9; 8 = 2^-6 */
    int e;
    float f = frexpf(a, &e); /* a = f 2^e, f in [0.5, 1) */
    float mant = nearbyintf((2.0f * f - 1.0f) * 8.0f);
    int biased = e - 1 + 7;
    if (mant == 8.0f) {
        mant = 0.0f;
        biased += 1;
    }
    uint8_t code = (uint8_t)((biased << 3) | (int)mant);
    return sign | (code > 0x7E ? 0x7E : code);
}

/* Round to nearest even for |v| < 2^22 (codes are within +-448): adding and taking away 1.5 x 2^23
 * leaves the integer the float adder rounds to, in a form the compiler vectorises. */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* One row of L values at stride B: its codes at stride B, its scale returned. */
static inline float encode_row(const float *row, uint8_t *codes, int64_t L, int64_t B, int fp8, float top) {
    float m = 0.0f;
    int bad = 0;
    if (B == 1) {
#pragma omp simd reduction(max : m) reduction(| : bad)
        for (int64_t l = 0; l < L; l++) {
            float a = fabsf(row[l]);
            m = a > m ? a : m;
            bad |= !(a <= 3.4028235e38f); /* NaN or infinity */
        }
    } else {
        for (int64_t l = 0; l < L; l++) {
            float a = fabsf(row[l * B]);
            m = a > m ? a : m;
            bad |= !(a <= 3.4028235e38f);
        }
    }
    float scale = bad ? NAN : m / top;
    float inv = (!bad && scale > 0.0f) ? 1.0f / scale : 0.0f;
    if (fp8) {
        for (int64_t l = 0; l < L; l++) {
            float v = row[l * B] * inv;
            v = v > top ? top : (v < -top ? -top : v);
            codes[l * B] = to_e4m3(inv == 0.0f ? 0.0f : v);
        }
    } else if (B == 1) {
        /* through an int32 block of 32: the compiler's direct float -> byte loop packs poorly
         * (~1.5x slower on a Mamba2 state's rows of 32, measured); the same values */
        for (int64_t l0 = 0; l0 < L; l0 += 32) {
            const int64_t n = L - l0 < 32 ? L - l0 : 32;
            int32_t t[32];
#pragma omp simd
            for (int64_t l = 0; l < n; l++) {
                float v = round_even(row[l0 + l] * inv);
                v = v > top ? top : (v < -top ? -top : v);
                t[l] = (int32_t)v;
            }
#pragma omp simd
            for (int64_t l = 0; l < n; l++) codes[l0 + l] = (uint8_t)t[l];
        }
        if (inv == 0.0f) memset(codes, 0, (size_t)L);
    } else {
        for (int64_t l = 0; l < L; l++) {
            float v = inv == 0.0f ? 0.0f : round_even(row[l * B] * inv);
            v = v > top ? top : (v < -top ? -top : v);
            codes[l * B] = (uint8_t)(int8_t)(int32_t)v;
        }
    }
    return scale;
}

/* One item of float32 [A][L][B] into its bytes (codes, padding, scales). */
static void encode_item(const float *xi, uint8_t *ri, int64_t A, int64_t L, int64_t B, int64_t code_bytes,
                        int fp8, float top) {
    const int64_t numel = A * L * B;
    if (code_bytes > numel) memset(ri + numel, 0, (size_t)(code_bytes - numel));
    for (int64_t a = 0; a < A; a++) {
        for (int64_t b = 0; b < B; b++) {
            /* rows of 32 (a Mamba2 / GDN state's d_state): a copy compiled for that length */
            float scale = B == 1 && L == 32 && !fp8 ? encode_row(xi + a * L, ri + a * L, 32, 1, 0, top)
                                                    : encode_row(xi + a * L * B + b, ri + a * L * B + b, L, B, fp8, top);
            memcpy(ri + code_bytes + 4 * (a * B + b), &scale, 4);
        }
    }
}

void quant_encode_f32(const float *x, uint8_t *raw, int64_t items, int64_t A, int64_t L, int64_t B,
                      int64_t nbytes, int64_t code_bytes, int fp8) {
    const float top = fp8 ? 448.0f : 127.0f;
    for (int64_t i = 0; i < items; i++) encode_item(x + i * A * L * B, raw + i * nbytes, A, L, B, code_bytes, fp8, top);
}

/* One item's bytes into float32 [A][L][B]. fp8_values: the 256 float values of the e4m3fn codes
 * (NULL for int8). */
static void decode_item(const uint8_t *ri, float *yi, int64_t A, int64_t L, int64_t B, int64_t code_bytes,
                        const float *fp8_values) {
    for (int64_t a = 0; a < A; a++) {
        for (int64_t b = 0; b < B; b++) {
            float scale;
            memcpy(&scale, ri + code_bytes + 4 * (a * B + b), 4);
            const uint8_t *codes = ri + a * L * B + b;
            float *out = yi + a * L * B + b;
            if (fp8_values) {
                for (int64_t l = 0; l < L; l++) out[l * B] = fp8_values[codes[l * B]] * scale;
            } else if (B == 1) {
                const int8_t *c = (const int8_t *)codes;
#pragma omp simd
                for (int64_t l = 0; l < L; l++) out[l] = (float)c[l] * scale;
            } else {
                for (int64_t l = 0; l < L; l++) out[l * B] = (float)(int8_t)codes[l * B] * scale;
            }
        }
    }
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
