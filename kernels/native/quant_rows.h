/* One item of a quantized cache row layout (hybridkv/cache_dtype.py) encoded from float32 and
 * decoded back: what quantize.c's functions do per item, and what the decode kernels that keep
 * quantized caches in place (mamba2_decode.c, gdn_decode.c, paged_attention.c) do to a slot, a
 * block of a state's rows (encode_rows) or a page's vector. Included, not built alone:
 * native_cpu.py hashes every header of this folder into each library's name. See quantize.c for
 * the arithmetic; compiled with the same flags everywhere, so the same bytes everywhere.
 */
#ifndef HYBRIDKV_QUANT_ROWS_H
#define HYBRIDKV_QUANT_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* A float's bits read in place: an integer view of float arrays the compiler must not assume apart
 * from them (strict aliasing), as it may for a plain uint32_t pointer. */
typedef uint32_t __attribute__((__may_alias__)) float_bits;

/* float -> float8 e4m3fn (bias 7, no infinities, 0x7F the NaN), round to nearest even; |v| <= 448
 * (larger magnitudes and infinities give 448), in two parts so that loops of it vectorise: a loop
 * computes e4m3_subnormal of its floats (below 2^-6, the subnormal steps of 2^-9 rounded by the
 * float adder; 8 = 2^-6) into one block and the floats into another, a second loop e4m3_code from
 * the floats' bits (a float_bits view: GCC 12 vectorises neither a union's nor memcpy's bits of an
 * element, nor one loop reading the same floats as both types). Else the mantissa's bits are rounded
 * to 3 (a carry moves into the exponent) and the exponent rebiased from 127 to 7. */
static inline uint32_t e4m3_subnormal(float v) {
    const float small = fabsf(v) < 0.015625f ? fabsf(v) : 0.0f;  /* (a NaN: 0, never converted) */
    return (uint32_t)(int32_t)((small * 512.0f + 12582912.0f) - 12582912.0f);
}

static inline uint32_t e4m3_code(uint32_t bits, uint32_t subnormal) {
    const uint32_t sign = (bits >> 24) & 0x80;
    const uint32_t abs_bits = bits & 0x7FFFFFFFu;
    const int nan = abs_bits > 0x7F800000u;
    const uint32_t a = abs_bits > 0x43E00000u ? 0x43E00000u : abs_bits; /* 448 */
    const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    uint32_t code = a < 0x3C800000u ? subnormal : normal; /* 2^-6 */
    code = code > 0x7Eu ? 0x7Eu : code;
    return sign | (nan ? 0x7Fu : code);  /* (as uint32: a loop narrowing it to bytes does not vectorise) */
}

/* Round to nearest even for |v| < 2^22 (codes are within +-448): adding and taking away 1.5 x 2^23
 * leaves the integer the float adder rounds to, in a form the compiler vectorises. */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* The largest |value| of a contiguous row as the bits of a float: an integer max over the bits without
 * the sign orders finite magnitudes as floats, and a NaN or an infinity (bits >= 0x7F800000) above
 * them all, so one reduction finds both the max and whether the row is bad. */
static inline uint32_t row_max_bits(const float *row, int64_t L) {
    const float_bits *bits = (const float_bits *)row;
    uint32_t m = 0;
#pragma omp simd reduction(max : m)
    for (int64_t l = 0; l < L; l++) {
        const uint32_t a = bits[l] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* A row's scale from row_max_bits (a NaN or an infinity in it: the scale is NaN); *inv: what the
 * codes are scaled by (0 for a bad or all-zero row: its codes are 0). */
static inline float row_scale(uint32_t max_bits, float top, float *inv) {
    const int bad = max_bits >= 0x7F800000u;
    float m;
    memcpy(&m, &max_bits, 4);
    const float scale = bad ? NAN : m / top;
    *inv = (!bad && scale > 0.0f) ? 1.0f / scale : 0.0f;
    return scale;
}

/* A row's codes (L values at stride B) given the inverse of its scale. */
static inline void encode_codes(const float *row, uint8_t *codes, int64_t L, int64_t B, float inv, int fp8, float top) {
    if (fp8) {
        /* the scaled values through a block of floats, then their codes (e4m3_subnormal, e4m3_code) */
        for (int64_t l0 = 0; l0 < L; l0 += 64) {
            const int64_t n = L - l0 < 64 ? L - l0 : 64;
            float t[64];
            uint32_t sub[64];
#pragma omp simd
            for (int64_t l = 0; l < n; l++) {
                float v = row[(l0 + l) * B] * inv;
                v = v > top ? top : (v < -top ? -top : v);
                t[l] = inv == 0.0f ? 0.0f : v;
                sub[l] = e4m3_subnormal(t[l]);
            }
            const float_bits *bits = (const float_bits *)t;
#pragma omp simd
            for (int64_t l = 0; l < n; l++) sub[l] = e4m3_code(bits[l], sub[l]);
            for (int64_t l = 0; l < n; l++) codes[(l0 + l) * B] = (uint8_t)sub[l];
        }
    } else if (B == 1 && inv <= 3.4028235e38f) {
        /* inv finite (so is every x inv, within +-127 to rounding): the clamp after the conversion
         * gives the same codes, and the compiler packs int32 -> int8 from it in two instructions
         * (the float clamp's form packs through permutes: ~1.4x slower on rows of 32, measured) */
        int8_t *c = (int8_t *)codes;
#pragma omp simd
        for (int64_t l = 0; l < L; l++) {
            int32_t t = (int32_t)round_even(row[l] * inv);
            t = t > 127 ? 127 : (t < -127 ? -127 : t);
            c[l] = (int8_t)t;
        }
        if (inv == 0.0f) memset(codes, 0, (size_t)L);
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
}

/* One row of L values at stride B: its codes at stride B, its scale returned. */
static inline float encode_row(const float *row, uint8_t *codes, int64_t L, int64_t B, int fp8, float top) {
    uint32_t m = 0;
    if (B == 1) {
        m = row_max_bits(row, L);
    } else {
        for (int64_t l = 0; l < L; l++) {
            uint32_t a;
            memcpy(&a, row + l * B, 4);
            a &= 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
    }
    float inv;
    const float scale = row_scale(m, top, &inv);
    if (B == 1 && L == 32 && !fp8)  /* rows of 32 (a Mamba2 / GDN state's d_state): a copy compiled for that length */
        encode_codes(row, codes, 32, 1, inv, 0, top);
    else
        encode_codes(row, codes, L, B, inv, fp8, top);
    return scale;
}

/* At most this many rows go through encode_rows at once. */
#define ENCODE_ROWS_MAX 64

/* n <= ENCODE_ROWS_MAX contiguous rows of L values (x [n][L] -> codes [n][L], scales [n]) whose
 * row_max_bits are max_bits [n], as encode_row does each: all the scales and inverses in one vector
 * loop, then every row's codes (row by row, each row's divisions would wait on its max and its codes
 * on them; here the rows' chains overlap). */
static inline void encode_rows(const float *x, const uint32_t *max_bits, uint8_t *codes, float *scales, int64_t n,
                               int64_t L, int fp8, float top) {
    float inv[ENCODE_ROWS_MAX];
#pragma omp simd
    for (int64_t r = 0; r < n; r++) scales[r] = row_scale(max_bits[r], top, &inv[r]);
    for (int64_t r = 0; r < n; r++) {
        if (L == 32 && !fp8)
            encode_codes(x + r * 32, codes + r * 32, 32, 1, inv[r], 0, top);
        else
            encode_codes(x + r * L, codes + r * L, L, 1, inv[r], fp8, top);
    }
}

/* One contiguous row's codes [L] and scale into out [L]. fp8_values: the 256 float values of the
 * e4m3fn codes (NULL for int8). */
static inline void decode_contiguous_row(const uint8_t *codes, float scale, float *out, int64_t L,
                                         const float *fp8_values) {
    if (fp8_values) {
#pragma omp simd
        for (int64_t l = 0; l < L; l++) out[l] = fp8_values[codes[l]] * scale;
    } else {
        const int8_t *c = (const int8_t *)codes;
#pragma omp simd
        for (int64_t l = 0; l < L; l++) out[l] = (float)c[l] * scale;
    }
}

/* Items whose rows are interleaved (B > 1: value l of row b at l B + b; a conv window's time steps)
 * are swept in blocks of 16 l's, 16 B contiguous values, lane j of a block always in row j % B: so
 * the loops are contiguous vector loops, each lane's scale from a pattern. Up to this many rows. */
#define INTERLEAVED_ROWS_MAX 8

/* The B interleaved rows of one [L][B] block (x -> codes, scales [B]), as encode_row does each. */
static inline void encode_interleaved(const float *x, uint8_t *codes, float *scales, int64_t L, int64_t B, int fp8,
                                      float top) {
    const int64_t W = 16 * B, total = L * B;
    uint32_t lane_max[16 * INTERLEAVED_ROWS_MAX] = {0}, row_max[INTERLEAVED_ROWS_MAX] = {0};
    float inv[INTERLEAVED_ROWS_MAX], lane_inv[16 * INTERLEAVED_ROWS_MAX];
    const float_bits *bits = (const float_bits *)x;
    for (int64_t i0 = 0; i0 < total; i0 += W) {
        const int64_t w = total - i0 < W ? total - i0 : W;
#pragma omp simd
        for (int64_t j = 0; j < w; j++) {
            const uint32_t a = bits[i0 + j] & 0x7FFFFFFFu;
            lane_max[j] = a > lane_max[j] ? a : lane_max[j];
        }
    }
    for (int64_t j = 0; j < W; j++) row_max[j % B] = lane_max[j] > row_max[j % B] ? lane_max[j] : row_max[j % B];
    for (int64_t b = 0; b < B; b++) scales[b] = row_scale(row_max[b], top, &inv[b]);
    for (int64_t j = 0; j < W; j++) lane_inv[j] = inv[j % B];
    for (int64_t i0 = 0; i0 < total; i0 += W) {
        const int64_t w = total - i0 < W ? total - i0 : W;
        if (fp8) {  /* as encode_codes: through a block of floats, then their codes */
            float t[16 * INTERLEAVED_ROWS_MAX];
            uint32_t sub[16 * INTERLEAVED_ROWS_MAX];
#pragma omp simd
            for (int64_t j = 0; j < w; j++) {
                float v = x[i0 + j] * lane_inv[j];
                v = v > top ? top : (v < -top ? -top : v);
                t[j] = lane_inv[j] == 0.0f ? 0.0f : v;
                sub[j] = e4m3_subnormal(t[j]);
            }
            const float_bits *bits = (const float_bits *)t;
#pragma omp simd
            for (int64_t j = 0; j < w; j++) sub[j] = e4m3_code(bits[j], sub[j]);
#pragma omp simd
            for (int64_t j = 0; j < w; j++) codes[i0 + j] = (uint8_t)sub[j];
        } else {
            int32_t t[16 * INTERLEAVED_ROWS_MAX];  /* through int32, as encode_codes does */
#pragma omp simd
            for (int64_t j = 0; j < w; j++) {
                float v = lane_inv[j] == 0.0f ? 0.0f : round_even(x[i0 + j] * lane_inv[j]);
                v = v > top ? top : (v < -top ? -top : v);
                t[j] = (int32_t)v;
            }
#pragma omp simd
            for (int64_t j = 0; j < w; j++) codes[i0 + j] = (uint8_t)t[j];
        }
    }
}

/* The B interleaved rows of one [L][B] block's codes and scales [B] into out [L][B]. */
static inline void decode_interleaved(const uint8_t *codes, const float *scales, float *out, int64_t L, int64_t B,
                                      const float *fp8_values) {
    const int64_t W = 16 * B, total = L * B;
    float lane_scale[16 * INTERLEAVED_ROWS_MAX];
    for (int64_t j = 0; j < W; j++) lane_scale[j] = scales[j % B];
    const int8_t *c = (const int8_t *)codes;
    for (int64_t i0 = 0; i0 < total; i0 += W) {
        const int64_t w = total - i0 < W ? total - i0 : W;
        if (fp8_values) {
#pragma omp simd
            for (int64_t j = 0; j < w; j++) out[i0 + j] = fp8_values[codes[i0 + j]] * lane_scale[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < w; j++) out[i0 + j] = (float)c[i0 + j] * lane_scale[j];
        }
    }
}

/* One item of float32 [A][L][B] into its bytes (codes, padding, scales). */
static inline void encode_item(const float *xi, uint8_t *ri, int64_t A, int64_t L, int64_t B, int64_t code_bytes,
                        int fp8, float top) {
    const int64_t numel = A * L * B;
    if (code_bytes > numel) memset(ri + numel, 0, (size_t)(code_bytes - numel));
    for (int64_t a = 0; a < A; a++) {
        if (B > 1 && B <= INTERLEAVED_ROWS_MAX) {
            float scales[INTERLEAVED_ROWS_MAX];
            encode_interleaved(xi + a * L * B, ri + a * L * B, scales, L, B, fp8, top);
            memcpy(ri + code_bytes + 4 * a * B, scales, (size_t)(4 * B));
            continue;
        }
        for (int64_t b = 0; b < B; b++) {
            float scale = encode_row(xi + a * L * B + b, ri + a * L * B + b, L, B, fp8, top);
            memcpy(ri + code_bytes + 4 * (a * B + b), &scale, 4);
        }
    }
}

/* One item's bytes into float32 [A][L][B]. fp8_values: the 256 float values of the e4m3fn codes
 * (NULL for int8). */
static inline void decode_item(const uint8_t *ri, float *yi, int64_t A, int64_t L, int64_t B, int64_t code_bytes,
                        const float *fp8_values) {
    for (int64_t a = 0; a < A; a++) {
        if (B > 1 && B <= INTERLEAVED_ROWS_MAX) {
            float scales[INTERLEAVED_ROWS_MAX];
            memcpy(scales, ri + code_bytes + 4 * a * B, (size_t)(4 * B));
            decode_interleaved(ri + a * L * B, scales, yi + a * L * B, L, B, fp8_values);
            continue;
        }
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

#endif
