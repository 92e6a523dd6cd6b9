/* One-token decodes of paged attention, read straight from the paged pool (no gather).
 *
 * kv [num_blocks, 2, bs, Hkv, D] (element strides given; D contiguous), block_table [R, W] int32,
 * seq_lens [R] int32. Decode i is request reqs[i], its query row rows[i] of q [T, Hq, D]; it sees
 * keys start..L-1 (L = seq_lens[reqs[i]], start = max(0, L - window) under a window, else 0).
 * Logits of every query head of a GQA group are taken on each K row read, kept (Hq x keys
 * floats), soft-capped, softmaxed (a sink logit per query head joins the denominator when
 * `sinks` is given), then P @ V runs over the V rows with its accumulators in registers; fp32.
 * Returns 0, or -(1 + i) for the first decode i whose block-table entry lies outside the pool
 * (nothing written for it or the ones after), or -(1 + n) when scratch memory is not available.
 *
 * 8-lane vectors through GCC/Clang vector extensions (two AVX/SSE/NEON registers' worth, so the
 * code needs no intrinsics); D not a multiple of 8 takes plain loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* for each key j in 0..keys (position start + j), row = its row in `base` (a K or V column of
 * the pool): block by block, so no division per key */
#define FOR_EACH_KEY(j, row, base, blocks, start, keys, kv_blk, kv_pos, bs)                      \
    for (int64_t b_ = (start) / (bs), j = 0, o_ = (start) % (bs); j < (keys); b_++, o_ = 0)       \
        for (const float *row = (base) + blocks[b_] * (kv_blk) + o_ * (kv_pos),                  \
                         *end_ = row + ((bs) - o_ < (keys) - j ? (bs) - o_ : (keys) - j) * (kv_pos); \
             row < end_; row += (kv_pos), j++)

/* logits[head * stride] = scale * q_head . k for one key row k, every query head */
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
                v8 a = {0}, b = {0}; /* two chains of multiply-adds */
                int64_t x = 0;
                for (; x + 16 <= d; x += 16) {
                    a += load8(qh + x) * load8(kh + x);
                    b += load8(qh + x + 8) * load8(kh + x + 8);
                }
                if (x < d)
                    a += load8(qh + x) * load8(kh + x);
                s = hsum8(a + b);
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

/* logits_1 for 8 consecutive key rows k, k + kv_pos, ... (D a multiple of 8): one horizontal
 * sum per 8 logits instead of one per logit */
static inline void logits_8(const float *qi, int64_t q_head, const float *k, int64_t kv_pos,
                            int64_t kv_head, int64_t hkv, int64_t group, int64_t d, float scale,
                            float *logits, int64_t stride) {
    for (int64_t h = 0; h < hkv; h++) {
        const float *kh = k + h * kv_head;
        for (int64_t g = 0; g < group; g++) {
            const int64_t head = h * group + g;
            const float *qh = qi + head * q_head;
            v8 a[8] = {{0}};
            for (int64_t x = 0; x < d; x += 8) {
                const v8 qv = load8(qh + x);
                for (int t = 0; t < 8; t++)
                    a[t] += qv * load8(kh + t * kv_pos + x);
            }
            const v8 r = hsum8x8(a) * scale;
            memcpy(logits + head * stride, &r, sizeof r);
        }
    }
}

/* logits[head * stride + j] = scale * q_head . k_j for the decode's keys j (position start + j),
 * block by block */
static void logits_of(const float *qi, int64_t q_head, const float *kv, const int32_t *blocks,
                      int64_t start, int64_t keys, int64_t kv_blk, int64_t kv_pos, int64_t kv_head,
                      int64_t hkv, int64_t group, int64_t d, int64_t bs, float scale,
                      float *logits, int64_t stride) {
    int64_t j = 0;
    for (int64_t b = start / bs, o = start % bs; j < keys; b++, o = 0) {
        const int64_t n = bs - o < keys - j ? bs - o : keys - j;
        const float *k = kv + blocks[b] * kv_blk + o * kv_pos;
        int64_t t = 0;
        if (d % 8 == 0)
            for (; t + 8 <= n; t += 8)
                logits_8(qi, q_head, k + t * kv_pos, kv_pos, kv_head, hkv, group, d, scale,
                         logits + j + t, stride);
        for (; t < n; t++)
            logits_1(qi, q_head, k + t * kv_pos, kv_head, hkv, group, d, scale, logits + j + t, stride);
        j += n;
    }
}

/* softmax of s[0..keys) in place (normalised, as the reference); s has room up to keys
 * rounded up to 8 */
static void softmax_row(float *s, int64_t keys, float soft_cap, const float *sink) {
    if (soft_cap > 0.0f)
        for (int64_t j = 0; j < keys; j++)
            s[j] = soft_cap * tanhf(s[j] / soft_cap);
    float m = s[0];
    for (int64_t j = 1; j < keys; j++)
        m = s[j] > m ? s[j] : m;
    if (sink != NULL && *sink > m)
        m = *sink;
    const int64_t padded = (keys + 7) / 8 * 8;
    for (int64_t j = 0; j < padded; j++) {
        float x = j < keys ? s[j] - m : -87.0f;
        s[j] = x < -87.0f ? -87.0f : x; /* e^-87 is below every kept weight's precision */
    }
    v8 sum = {0};
    for (int64_t j = 0; j < padded; j += 8) {
        v8 p = exp8(load8(s + j));
        memcpy(s + j, &p, sizeof p);
    }
    for (int64_t j = keys; j < padded; j++)
        s[j] = 0.0f;
    for (int64_t j = 0; j < padded; j += 8)
        sum += load8(s + j);
    float total = hsum8(sum);
    if (sink != NULL)
        total += expf(*sink - m);
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < keys; j++)
        s[j] *= inv;
}

/* o[t * out_head + 0 .. 8 NV) = sum_j p[t * stride + j] v_j[0 .. 8 NV) for GT query heads of one
 * KV head, over 8 NV columns of V from vcol: the GT x NV accumulators stay in registers */
#define PV_TILE(GT, NV)                                                                          \
    static void pv_##GT##_##NV(const float *p, int64_t stride, const int32_t *blocks,            \
                               int64_t start, int64_t keys, int64_t kv_blk, int64_t kv_pos,      \
                               int64_t bs, const float *vcol, float *o, int64_t out_head) {      \
        v8 a[GT][NV];                                                                            \
        for (int t = 0; t < GT; t++)                                                             \
            for (int c = 0; c < NV; c++)                                                         \
                a[t][c] = (v8){0};                                                               \
        FOR_EACH_KEY(j, v, vcol, blocks, start, keys, kv_blk, kv_pos, bs) {                      \
            v8 vv[NV];                                                                           \
            for (int c = 0; c < NV; c++)                                                         \
                vv[c] = load8(v + 8 * c);                                                        \
            for (int t = 0; t < GT; t++) {                                                       \
                const float w = p[t * stride + j];                                               \
                for (int c = 0; c < NV; c++)                                                     \
                    a[t][c] += w * vv[c];                                                        \
            }                                                                                    \
        }                                                                                        \
        for (int t = 0; t < GT; t++)                                                             \
            for (int c = 0; c < NV; c++)                                                         \
                memcpy(o + t * out_head + 8 * c, &a[t][c], sizeof a[t][c]);                      \
    }
PV_TILE(1, 8)
PV_TILE(2, 4)
PV_TILE(3, 2)
PV_TILE(4, 2)
PV_TILE(1, 1)
PV_TILE(2, 1)
PV_TILE(3, 1)
PV_TILE(4, 1)

/* P @ V for query heads g0 .. g0 + gt (gt <= 4) of one KV head, D a multiple of 8: tiles as wide
 * as 8 accumulators allow, then 8 columns at a time */
static void pv_heads(int64_t gt, const float *p, int64_t stride, const int32_t *blocks,
                     int64_t start, int64_t keys, int64_t kv_blk, int64_t kv_pos, int64_t bs,
                     const float *vcol, float *o, int64_t out_head, int64_t d) {
    const int64_t wide = gt == 1 ? 64 : gt == 2 ? 32 : 16;
    int64_t x = 0;
#define PV_ARGS p, stride, blocks, start, keys, kv_blk, kv_pos, bs, vcol + x, o + x, out_head
    for (; x + wide <= d; x += wide) {
        if (gt == 1)
            pv_1_8(PV_ARGS);
        else if (gt == 2)
            pv_2_4(PV_ARGS);
        else if (gt == 3)
            pv_3_2(PV_ARGS);
        else
            pv_4_2(PV_ARGS);
    }
    for (; x < d; x += 8) {
        if (gt == 1)
            pv_1_1(PV_ARGS);
        else if (gt == 2)
            pv_2_1(PV_ARGS);
        else if (gt == 3)
            pv_3_1(PV_ARGS);
        else
            pv_4_1(PV_ARGS);
    }
#undef PV_ARGS
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
    const int64_t hq = hkv * group;
    int64_t max_keys = 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t len = seq_lens[reqs[i]];
        int64_t keys = (window > 0 && len > window) ? window : len;
        if (keys > max_keys)
            max_keys = keys;
    }
    const int64_t stride = (max_keys + 7) / 8 * 8;
    float *logits = malloc(sizeof(float) * (size_t)(hq * stride));
    float *acc = malloc(sizeof(float) * (size_t)(hq * d));
    if (logits == NULL || acc == NULL) {
        free(logits);
        free(acc);
        return -(1 + n);
    }
    int64_t status = 0;
    for (int64_t i = 0; i < n && status == 0; i++) {
        const int64_t len = seq_lens[reqs[i]];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t keys = len - start;
        const int32_t *blocks = table + (int64_t)reqs[i] * table_row;
        for (int64_t b = start / bs; b <= (len - 1) / bs; b++)
            if (blocks[b] < 0 || blocks[b] >= num_blocks)
                status = -(1 + i);
        if (status != 0 || keys <= 0)
            break;
        const float *qi = q + (int64_t)rows[i] * q_tok;
        float *oi = out + (int64_t)rows[i] * out_tok;
        logits_of(qi, q_head, kv, blocks, start, keys, kv_blk, kv_pos, kv_head, hkv, group, d, bs,
                  scale, logits, stride);
        for (int64_t head = 0; head < hq; head++)
            softmax_row(logits + head * stride, keys, soft_cap, sinks == NULL ? NULL : sinks + head);
        if (d % 8 == 0) {
            for (int64_t h = 0; h < hkv; h++)
                for (int64_t g0 = 0; g0 < group; g0 += 4) {
                    const int64_t head = h * group + g0, gt = group - g0 < 4 ? group - g0 : 4;
                    pv_heads(gt, logits + head * stride, stride, blocks, start, keys, kv_blk, kv_pos, bs,
                             kv + kv_half + h * kv_head, oi + head * out_head, out_head, d);
                }
            continue;
        }
        memset(acc, 0, sizeof(float) * (size_t)(hq * d));
        FOR_EACH_KEY(j, v, kv + kv_half, blocks, start, keys, kv_blk, kv_pos, bs) {
            for (int64_t head = 0; head < hq; head++) {
                const float w = logits[head * stride + j], *vh = v + (head / group) * kv_head;
                for (int64_t x = 0; x < d; x++)
                    acc[head * d + x] += w * vh[x];
            }
        }
        for (int64_t head = 0; head < hq; head++)
            memcpy(oi + head * out_head, acc + head * d, sizeof(float) * (size_t)d);
    }
    free(logits);
    free(acc);
    return status;
}
