/* One-token decodes of paged attention, read straight from the paged pool (no gather).
 *
 * kv [num_blocks, 2, bs, Hkv, D] (element strides given; D contiguous), block_table [R, W] int32,
 * seq_lens [R] int32. Decode i is request reqs[i], its query row rows[i] of q [T, Hq, D]; it sees
 * keys start..L-1 (L = seq_lens[reqs[i]], start = max(0, L - window) under a window, else 0).
 * One pass over the keys, block by block (online softmax): the logits of every query head of a
 * GQA group on each K row of the block, soft-capped, exponentiated against the running maximum
 * (the accumulators rescaled when it grows), then the block's V rows added to fp32 accumulators.
 * K and V rows are read in order, each once (a block's K half, then its V half: two streams).
 * A sink logit per query head joins the denominator at the end when `sinks` is given.
 * Returns 0, or -(1 + i) for the first decode i whose block-table entry lies outside the pool
 * (nothing written for it or the ones after), or -(1 + n) when scratch memory is not available.
 *
 * paged_decode_attention_q reads a quantized pool (int8 / fp8 codes and a scale per token and
 * head) the same way, each block's rows decoded into scratch first.
 *
 * 8-lane vectors through GCC/Clang vector extensions (two AVX/SSE/NEON registers' worth, so the
 * code needs no intrinsics); D not a multiple of 8 takes plain loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_rows.h" /* encode_item: the new K/V written into a quantized pool */

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) for x in [-87, 0] (callers clamp): 2^n * e^r, |r| <= ln2 / 2, Taylor to r^7 (rel. error
 * ~1e-7, like expf) */
static inline v8 exp8(v8 x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v8 t = x * 1.44269504088896341f + magic;
    v8 n = t - magic;
    v8i e = (v8i)t - (v8i){0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000,
                           0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000};
    v8 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    v8 p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (v8)((e + 127) << 23);
}

/* logits[head * stride] = scale * q_head . k for one key row k, every query head */
/* q . k for d a multiple of 8, as 8 lane sums (two chains of multiply-adds, summed) */
static inline v8 dot8(const float *q, const float *k, int64_t d) {
    v8 a = {0}, b = {0};
    int64_t x = 0;
    for (; x + 16 <= d; x += 16) {
        a += load8(q + x) * load8(k + x);
        b += load8(q + x + 8) * load8(k + x + 8);
    }
    if (x < d)
        a += load8(q + x) * load8(k + x);
    return a + b;
}

static inline void logits_1(const float *qi, int64_t q_head, const float *k, int64_t kv_head,
                            int64_t hkv, int64_t group, int64_t d, float scale, float *logits,
                            int64_t stride) {
    for (int64_t h = 0; h < hkv; h++) {
        const float *kh = k + h * kv_head;
        for (int64_t g = 0; g < group; g++) {
            const int64_t head = h * group + g;
            const float *qh = qi + head * q_head;
            float s;
            if (d % 8 == 0) {
                s = hsum8(dot8(qh, kh, d));
            } else {
                s = 0.0f;
                for (int64_t x = 0; x < d; x++)
                    s += qh[x] * kh[x];
            }
            logits[head * stride] = s * scale;
        }
    }
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* pairwise sums within each half: [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
static inline v8 hadd(v8 a, v8 b) {
    return SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* {hsum8(a[0]), ..., hsum8(a[7])} */
static inline v8 hsum8x8(const v8 *a) {
    v8 lo = hadd(hadd(a[0], a[1]), hadd(a[2], a[3])), hi = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
    return SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* logits s[head * stride + t] of n consecutive key rows from k (n <= stride), every query head.
 * The rows are read in order, each once (the block's K half is one stream): per row and head a
 * vector of partial sums goes to part [Hq * stride], reduced 8 rows at a time by one tree. */
static void logits_of(const float *qi, int64_t q_head, const float *k, int64_t n, int64_t kv_pos,
                      int64_t kv_head, int64_t hkv, int64_t group, int64_t d, float scale, float *s,
                      int64_t stride, v8 *part) {
    if (d % 8 != 0) {
        for (int64_t r = 0; r < n; r++)
            logits_1(qi, q_head, k + r * kv_pos, kv_head, hkv, group, d, scale, s + r, stride);
        return;
    }
    for (int64_t r = 0; r < n; r++) {
        for (int64_t h = 0; h < hkv; h++) {
            const float *kh = k + r * kv_pos + h * kv_head;
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = h * group + g;
                const float *qh = qi + head * q_head;
                part[head * stride + r] = dot8(qh, kh, d);
            }
        }
    }
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t head = 0; head < hkv * group; head++) {
        for (int64_t r = n; r < padded; r++)
            part[head * stride + r] = (v8){0};
        for (int64_t r = 0; r < padded; r += 8) {
            const v8 res = hsum8x8(part + head * stride + r) * scale;
            memcpy(s + head * stride + r, &res, sizeof res);
        }
    }
}

/* One head's logits s[0..n) of a block become weights exp(s - m) against the running maximum m
 * (updated); l, the running sum of weights, and acc [D], the running weighted sum of V rows, are
 * rescaled when m grows. s has room up to n rounded up to 8 (those lanes end up 0). */
static void online_softmax(float *s, int64_t n, float soft_cap, float *m, float *l, float *acc,
                           int64_t d) {
    if (soft_cap > 0.0f)
        for (int64_t j = 0; j < n; j++)
            s[j] = soft_cap * tanhf(s[j] / soft_cap);
    float mb = *m;
    for (int64_t j = 0; j < n; j++)
        mb = s[j] > mb ? s[j] : mb;
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t j = 0; j < padded; j++) {
        float x = j < n ? s[j] - mb : -87.0f;
        s[j] = x < -87.0f ? -87.0f : x; /* e^-87 is below every kept weight's precision */
    }
    v8 sum = {0};
    for (int64_t j = 0; j < padded; j += 8) {
        v8 p = exp8(load8(s + j));
        memcpy(s + j, &p, sizeof p);
    }
    for (int64_t j = n; j < padded; j++)
        s[j] = 0.0f;
    for (int64_t j = 0; j < padded; j += 8)
        sum += load8(s + j);
    const float r = expf(*m - mb); /* 0 for the first block (m = -inf) */
    if (r != 1.0f)
        for (int64_t x = 0; x < d; x++)
            acc[x] *= r;
    *l = *l * r + hsum8(sum);
    *m = mb;
}

/* acc[head] += sum_r s[head * stride + r] v_r[head's KV head] over n consecutive V rows from v,
 * every query head: rows read in order, each once (the block's V half is one stream) */
static void weighted_rows(const float *s, int64_t stride, const float *v, int64_t n, int64_t kv_pos,
                          int64_t kv_head, int64_t hkv, int64_t group, int64_t d, float *acc) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < hkv; h++) {
            const float *vh = v + r * kv_pos + h * kv_head;
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = h * group + g;
                const float w = s[head * stride + r];
                float *a = acc + head * d;
                if (d % 8 == 0) {
                    for (int64_t x = 0; x < d; x += 8) {
                        const v8 t = load8(a + x) + w * load8(vh + x);
                        memcpy(a + x, &t, sizeof t);
                    }
                } else {
                    for (int64_t x = 0; x < d; x++)
                        a[x] += w * vh[x];
                }
            }
        }
}

int64_t paged_decode_attention(
    const float *q, int64_t q_tok, int64_t q_head,
    const float *kv, int64_t num_blocks, int64_t kv_blk, int64_t kv_half, int64_t kv_pos,
    int64_t kv_head,
    const int32_t *table, int64_t table_row, const int32_t *seq_lens,
    const int32_t *reqs, const int32_t *rows, int64_t n,
    int64_t hkv, int64_t group, int64_t d, int64_t bs,
    float scale, float soft_cap, int64_t window, const float *sinks,
    float *out, int64_t out_tok, int64_t out_head)
{
    const int64_t hq = hkv * group, stride = (bs + 7) / 8 * 8;
    float *s = malloc(sizeof(float) * (size_t)(hq * stride));
    float *acc = malloc(sizeof(float) * (size_t)(hq * d));
    float *m = malloc(sizeof(float) * (size_t)hq), *l = malloc(sizeof(float) * (size_t)hq);
    v8 *part = aligned_alloc(sizeof(v8), sizeof(v8) * (size_t)(hq * stride)); /* v8 stores are aligned */
    int64_t status = (s == NULL || acc == NULL || m == NULL || l == NULL || part == NULL) ? -(1 + n) : 0;
    for (int64_t i = 0; i < n && status == 0; i++) {
        const int64_t len = seq_lens[reqs[i]];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int32_t *blocks = table + (int64_t)reqs[i] * table_row;
        for (int64_t b = start / bs; b <= (len - 1) / bs; b++)
            if (blocks[b] < 0 || blocks[b] >= num_blocks)
                status = -(1 + i);
        if (status != 0 || len <= 0)
            break;
        const float *qi = q + (int64_t)rows[i] * q_tok;
        for (int64_t head = 0; head < hq; head++)
            m[head] = -INFINITY, l[head] = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)(hq * d));
        for (int64_t b = start / bs, o = start % bs, j = start; j < len; b++, o = 0) {
            const int64_t nk = bs - o < len - j ? bs - o : len - j;
            const float *k = kv + blocks[b] * kv_blk + o * kv_pos, *v = k + kv_half;
            j += nk;
            logits_of(qi, q_head, k, nk, kv_pos, kv_head, hkv, group, d, scale, s, stride, part);
            for (int64_t head = 0; head < hq; head++)
                online_softmax(s + head * stride, nk, soft_cap, m + head, l + head, acc + head * d, d);
            weighted_rows(s, stride, v, nk, kv_pos, kv_head, hkv, group, d, acc);
        }
        float *oi = out + (int64_t)rows[i] * out_tok;
        for (int64_t head = 0; head < hq; head++) {
            const float total = l[head] + (sinks != NULL ? expf(sinks[head] - m[head]) : 0.0f);
            const float inv = 1.0f / total;
            for (int64_t x = 0; x < d; x++)
                oi[head * out_head + x] = acc[head * d + x] * inv;
        }
    }
    free(s);
    free(acc);
    free(m);
    free(l);
    free(part);
    return status;
}

/* One K or V row of a quantized page (hkv items of nbytes: d one-byte codes, then a float32 scale;
 * hybridkv/cache_dtype.py) into dst [hkv][d]: code x scale, as quantize.c's decode. */
static void dequant_row(const uint8_t *items, int64_t nbytes, int64_t code_bytes, const float *fp8_values,
                        int64_t hkv, int64_t d, float *dst) {
    for (int64_t h = 0; h < hkv; h++) {
        const uint8_t *c = items + h * nbytes;
        float sc;
        memcpy(&sc, c + code_bytes, 4);
        float *o = dst + h * d;
        if (fp8_values) {
            for (int64_t x = 0; x < d; x++) o[x] = fp8_values[c[x]] * sc;
        } else {
            const int8_t *ci = (const int8_t *)c;
#pragma omp simd
            for (int64_t x = 0; x < d; x++) o[x] = (float)ci[x] * sc;
        }
    }
}

/* paged_decode_attention over a quantized pool kv [num_blocks, 2, bs, hkv] of items (contiguous)
 * whose codes decode as quantize.c's (fp8_values: the 256 e4m3fn values, NULL for int8), except
 * each decode's own new token (position L - 1), read at full precision from fresh: decode i's K
 * at fresh + rows[i] * fresh_tok, its V hkv * d floats later ([hkv][d] each), as a step that
 * decoded the pages, wrote the new K/V among them and encoded them after would read. First the
 * new K/V of every decode are encoded into the pool at slot_mapping[rows[i]] (write-quantize).
 * A block's K and V rows are decoded into scratch, then the same functions as
 * paged_decode_attention run on them: the same float arithmetic, value for value. Returns as
 * paged_decode_attention (a slot outside the pool counts as its decode's bad block); nothing is
 * written unless every decode's blocks and slot are in the pool. */
int64_t paged_decode_attention_q(
    const float *q, int64_t q_tok, int64_t q_head,
    uint8_t *kv, int64_t num_blocks, int64_t nbytes, int64_t code_bytes, const float *fp8_values,
    const float *fresh, int64_t fresh_tok, const int64_t *slot_mapping,
    const int32_t *table, int64_t table_row, const int32_t *seq_lens,
    const int32_t *reqs, const int32_t *rows, int64_t n,
    int64_t hkv, int64_t group, int64_t d, int64_t bs,
    float scale, float soft_cap, int64_t window, const float *sinks,
    float *out, int64_t out_tok, int64_t out_head)
{
    const int64_t hq = hkv * group, stride = (bs + 7) / 8 * 8, row = hkv * nbytes;
    float *s = malloc(sizeof(float) * (size_t)(hq * stride));
    float *acc = malloc(sizeof(float) * (size_t)(hq * d));
    float *m = malloc(sizeof(float) * (size_t)hq), *l = malloc(sizeof(float) * (size_t)hq);
    float *kf = malloc(sizeof(float) * (size_t)(2 * bs * hkv * d)), *vf = kf + bs * hkv * d;
    v8 *part = aligned_alloc(sizeof(v8), sizeof(v8) * (size_t)(hq * stride));
    int64_t status = (s == NULL || acc == NULL || m == NULL || l == NULL || kf == NULL || part == NULL) ? -(1 + n) : 0;
    for (int64_t i = 0; i < n && status == 0; i++) { /* every block a decode reads and writes, checked first */
        const int64_t len = seq_lens[reqs[i]], slot = slot_mapping[rows[i]];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int32_t *blocks = table + (int64_t)reqs[i] * table_row;
        for (int64_t b = start / bs; b <= (len - 1) / bs; b++)
            if (blocks[b] < 0 || blocks[b] >= num_blocks)
                status = -(1 + i);
        if (slot < 0 || slot / bs >= num_blocks)
            status = -(1 + i);
    }
    /* the new K/V encoded into their slots (quant_rows.h, as quantize.c), every decode's before any reads */
    for (int64_t i = 0; i < n && status == 0; i++) {
        const int64_t slot = slot_mapping[rows[i]];
        for (int64_t p = 0; p < 2; p++)
            for (int64_t h = 0; h < hkv; h++)
                encode_item(fresh + (int64_t)rows[i] * fresh_tok + (p * hkv + h) * d,
                            kv + (((slot / bs) * 2 + p) * bs + slot % bs) * row + h * nbytes, 1, d, 1, code_bytes,
                            fp8_values != NULL, fp8_values != NULL ? 448.0f : 127.0f);
    }
    for (int64_t i = 0; i < n && status == 0; i++) {
        const int64_t len = seq_lens[reqs[i]];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int32_t *blocks = table + (int64_t)reqs[i] * table_row;
        if (len <= 0)
            break;
        const float *qi = q + (int64_t)rows[i] * q_tok, *fk = fresh + (int64_t)rows[i] * fresh_tok;
        for (int64_t head = 0; head < hq; head++)
            m[head] = -INFINITY, l[head] = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)(hq * d));
        for (int64_t b = start / bs, o = start % bs, j = start; j < len; b++, o = 0) {
            const int64_t nk = bs - o < len - j ? bs - o : len - j;
            const uint8_t *page = kv + (int64_t)blocks[b] * 2 * bs * row;
            for (int64_t r = 0; r < nk; r++) {
                if (j + r == len - 1) { /* the new token: at full precision */
                    memcpy(kf + r * hkv * d, fk, sizeof(float) * (size_t)(hkv * d));
                    memcpy(vf + r * hkv * d, fk + hkv * d, sizeof(float) * (size_t)(hkv * d));
                } else {
                    dequant_row(page + (o + r) * row, nbytes, code_bytes, fp8_values, hkv, d, kf + r * hkv * d);
                    dequant_row(page + (bs + o + r) * row, nbytes, code_bytes, fp8_values, hkv, d, vf + r * hkv * d);
                }
            }
            j += nk;
            logits_of(qi, q_head, kf, nk, hkv * d, d, hkv, group, d, scale, s, stride, part);
            for (int64_t head = 0; head < hq; head++)
                online_softmax(s + head * stride, nk, soft_cap, m + head, l + head, acc + head * d, d);
            weighted_rows(s, stride, vf, nk, hkv * d, d, hkv, group, d, acc);
        }
        float *oi = out + (int64_t)rows[i] * out_tok;
        for (int64_t head = 0; head < hq; head++) {
            const float total = l[head] + (sinks != NULL ? expf(sinks[head] - m[head]) : 0.0f);
            const float inv = 1.0f / total;
            for (int64_t x = 0; x < d; x++)
                oi[head * out_head + x] = acc[head * d + x] * inv;
        }
    }
    free(s);
    free(acc);
    free(m);
    free(l);
    free(kf);
    free(part);
    return status;
}
