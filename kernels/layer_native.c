/* A decoder layer's small steps on the CPU, in C: RMSNorm, SiLU(gate) * up, rotary + the
KV write, and the decode step's tag check.

Theory of operation. A decode step's non-matmul work is a few thousand numbers per layer,
yet in torch each of these steps is several calls (a norm is five: a norm of the rows in
fp32, an add, a square root, a multiply, a cast; rotary and the KV write five), each
paying 10-20 us in caches that the layer's weights just streamed through, 30 layers a
step. Here each is one call that reads its input once. The results are rounded exactly
where the torch references (kernels/layer.py) round them, so the two differ only by the
order of fp32 additions inside a sum and by the last bit of exp:
- rms_norm: y = x * (1 / sqrt(mean(x^2) + eps)) in fp32, rounded once to the dtype
  (transformers' LlamaRMSNorm before its weight; the engine folds the weight into the
  next projection).
- silu_mul: round(round(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in fp32:
  F.silu(gate).mul_(up) rounds twice, so this does too.
- rotary_write_kv: round(round(x * cos) + roll(x) * signed_sin), as x * cos and then
  addcmul round; then K and V copied to the pool rows given, each checked first.
- tags_match: tags[ids] == expected, ids checked against the pool.

Tensors come in by element strides, so both of the engine's layouts (rows, and the
feature-major h^T of engine/model.py) come in as views. dtype codes: 0 fp32, 1 bf16, 2
fp16, for every tensor of a call. Compiled by kernels/native.py (-O3 -march=native
-fopenmp-simd; no -ffast-math, so inf and NaN keep their IEEE meaning). Single-threaded:
kernels/__init__.py sends only small calls here (NATIVE_ELEMENTS_MAX).
*/

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

/* Per dtype, branch-free (so loops over them vectorize): load to fp32, round an fp32 to
   the dtype's nearest value (ties to even; NaN stays NaN), store rounded. */
static inline float f32_load(const float *p) { return *p; }
static inline float f32_round(float x) { return x; }
static inline void f32_store(float *p, float x) { *p = x; }

static inline float f16_load(const _Float16 *p) { return (float)*p; }
static inline float f16_round(float x) { return (float)(_Float16)x; }
static inline void f16_store(_Float16 *p, float x) { *p = (_Float16)x; }

static inline uint32_t bf16_rounded_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t nan = (bits & 0x7fffffffu) > 0x7f800000u;
    uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    return (nan ? bits | 0x400000u : rounded) & 0xffff0000u;
}
static inline float bf16_load(const uint16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline float bf16_round(float x) {
    uint32_t bits = bf16_rounded_bits(x);
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline void bf16_store(uint16_t *p, float x) { *p = (uint16_t)(bf16_rounded_bits(x) >> 16); }

#define MAX_TOKENS_AT_ONCE 64

/* y = x / sqrt(mean(x^2) + eps) for each of `tokens` tokens over `features` features, in
   one of the engine's two layouts, x and y alike: rows (token t's features contiguous
   from t * token_stride) or feature-major (feature f's tokens contiguous from f *
   feature_stride, h^T). Each is its own plain loop nest: that is what the compiler
   vectorizes (a loop that chose its layout inside ran 5x slower). */
#define DEFINE_RMS_NORM(NAME, X, LOAD, STORE)                                               \
    static void NAME##_rows(const X *restrict x, int64_t x_token_stride, X *restrict y,    \
                            int64_t y_token_stride, int64_t tokens, int64_t features,      \
                            float eps) {                                                   \
        for (int64_t t = 0; t < tokens; t++) {                                             \
            const X *row = x + t * x_token_stride;                                         \
            float sum = 0.0f;                                                              \
            _Pragma("omp simd reduction(+:sum)")                                           \
            for (int64_t f = 0; f < features; f++) sum += LOAD(row + f) * LOAD(row + f);  \
            float scale = 1.0f / sqrtf(sum / (float)features + eps);                       \
            X *out = y + t * y_token_stride;                                               \
            for (int64_t f = 0; f < features; f++) STORE(out + f, LOAD(row + f) * scale);  \
        }                                                                                  \
    }                                                                                      \
    static void NAME##_columns(const X *restrict x, int64_t x_feature_stride,              \
                               X *restrict y, int64_t y_feature_stride, int64_t tokens,    \
                               int64_t features, float eps) {                              \
        float scales[MAX_TOKENS_AT_ONCE];                                                  \
        for (int64_t first = 0; first < tokens; first += MAX_TOKENS_AT_ONCE) {            \
            int64_t count = tokens - first;                                                \
            count = count < MAX_TOKENS_AT_ONCE ? count : MAX_TOKENS_AT_ONCE;               \
            for (int64_t t = 0; t < count; t++) scales[t] = 0.0f;                          \
            for (int64_t f = 0; f < features; f++) {                                       \
                const X *column = x + f * x_feature_stride + first;                        \
                for (int64_t t = 0; t < count; t++)                                        \
                    scales[t] += LOAD(column + t) * LOAD(column + t);                      \
            }                                                                              \
            for (int64_t t = 0; t < count; t++)                                            \
                scales[t] = 1.0f / sqrtf(scales[t] / (float)features + eps);               \
            for (int64_t f = 0; f < features; f++) {                                       \
                const X *column = x + f * x_feature_stride + first;                        \
                X *out = y + f * y_feature_stride + first;                                 \
                for (int64_t t = 0; t < count; t++)                                        \
                    STORE(out + t, LOAD(column + t) * scales[t]);                          \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_RMS_NORM(rms_norm_f32, float, f32_load, f32_store)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_RMS_NORM(rms_norm_f16, _Float16, f16_load, f16_store)

/* The norm of x into y (both of `dtype`, not overlapping): by rows when feature_major is
   0 (strides: each token's row start), feature-major otherwise (strides: each feature's
   start). Returns 0, or -1 for arguments no caller may pass (then nothing was written). */
int kvproof_rms_norm(const void *x, int64_t x_stride, void *y, int64_t y_stride,
                     int64_t tokens, int64_t features, int feature_major, float eps,
                     int dtype) {
    if (tokens < 0 || features <= 0) return -1;
#define NORM(PREFIX, T)                                                                     \
    (feature_major ? PREFIX##_columns((const T *)x, x_stride, (T *)y, y_stride, tokens,   \
                                      features, eps)                                      \
                   : PREFIX##_rows((const T *)x, x_stride, (T *)y, y_stride, tokens,      \
                                   features, eps))
    if (dtype == DTYPE_F32) NORM(rms_norm_f32, float);
    else if (dtype == DTYPE_BF16) NORM(rms_norm_bf16, uint16_t);
    else if (dtype == DTYPE_F16) NORM(rms_norm_f16, _Float16);
    else return -1;
#undef NORM
    return 0;
}

/* exp(x) in fp32 within 2 ulp for finite results, written so the compiler vectorizes it
   (libm's expf is a call per element): x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor
   polynomial to r^7, times 2^k built from k's bits. x is clamped to [-87, 88], where 2^k
   stays a normal float: exp of a smaller x gives 1.6e-38 instead of a subnormal or 0, of
   a larger one 1.65e38 instead of inf (neither changes silu); NaN stays NaN. */
static inline float exp_vectorizable(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float k = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693145751953125f - k * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t exponent = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &exponent, sizeof scale);
    return p * scale;
}

/* out = round(round(silu(gate)) * up) over `count` contiguous elements of each. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, ROUND, STORE)                                       \
    static void NAME(const T *restrict gate, const T *restrict up, T *restrict out,       \
                     int64_t count) {                                                     \
        for (int64_t i = 0; i < count; i++) {                                             \
            float g = LOAD(gate + i);                                                     \
            float silu = ROUND(g / (1.0f + exp_vectorizable(-g)));                        \
            STORE(out + i, silu * LOAD(up + i));                                          \
        }                                                                                 \
    }

DEFINE_SILU_MUL(silu_mul_f32, float, f32_load, f32_round, f32_store)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_load, bf16_round, bf16_store)
DEFINE_SILU_MUL(silu_mul_f16, _Float16, f16_load, f16_round, f16_store)

/* gate, up, out: [tokens, features] with a contiguous feature axis, each with its own
   token stride (in elements): the two halves of each gate_up row, or of the
   feature-major gate_up block passed as one token of features * tokens elements. */
int kvproof_silu_mul(const void *gate, int64_t gate_token_stride, const void *up,
                     int64_t up_token_stride, void *out, int64_t out_token_stride,
                     int64_t tokens, int64_t features, int dtype) {
    if (tokens < 0 || features < 0 || dtype < DTYPE_F32 || dtype > DTYPE_F16) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        if (dtype == DTYPE_F32)
            silu_mul_f32((const float *)gate + t * gate_token_stride,
                         (const float *)up + t * up_token_stride,
                         (float *)out + t * out_token_stride, features);
        else if (dtype == DTYPE_BF16)
            silu_mul_bf16((const uint16_t *)gate + t * gate_token_stride,
                          (const uint16_t *)up + t * up_token_stride,
                          (uint16_t *)out + t * out_token_stride, features);
        else
            silu_mul_f16((const _Float16 *)gate + t * gate_token_stride,
                         (const _Float16 *)up + t * up_token_stride,
                         (_Float16 *)out + t * out_token_stride, features);
    }
    return 0;
}

/* Rotary embedding of the query and key heads of each token, in place, then the token's
   key and value heads copied into the KV pool. x is [tokens, heads, dim] by element
   strides (heads: q_heads queries, kv_heads keys, kv_heads values); cos and signed_sin are
   [tokens, dim] (row stride given, contiguous rows) laid out as rotate_in_place's
   ([cos_i | cos_i], [-sin_i | sin_i]): each head becomes x * cos + roll(x, dim / 2) *
   signed_sin, rounded after the product and after the sum as torch rounds x * cos and
   then addcmul. rows [tokens * 2 * kv_heads] are the pool rows (of dim elements each,
   [token, K|V, head] order) to write; any row outside [0, pool_rows) makes the call
   return -1 before anything is written. */
#define MAX_HEAD_DIM 512

#define DEFINE_ROTARY_WRITE(NAME, T, LOAD, ROUND, STORE)                                   \
    static void NAME(T *x, int64_t token_stride, int64_t head_stride, int64_t dim_stride,  \
                     int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t dim,        \
                     const T *cos, const T *signed_sin, int64_t table_stride, T *pool,      \
                     const int64_t *rows) {                                                 \
        int64_t half = dim / 2;                                                            \
        float a[MAX_HEAD_DIM];                                                             \
        for (int64_t t = 0; t < tokens; t++) {                                             \
            const T *c = cos + t * table_stride, *s = signed_sin + t * table_stride;       \
            for (int64_t h = 0; h < q_heads + kv_heads; h++) {                             \
                T *head = x + t * token_stride + h * head_stride;                          \
                for (int64_t d = 0; d < dim; d++) a[d] = LOAD(head + d * dim_stride);      \
                for (int64_t d = 0; d < half; d++)                                         \
                    STORE(head + d * dim_stride,                                           \
                          ROUND(a[d] * LOAD(c + d)) + a[d + half] * LOAD(s + d));          \
                for (int64_t d = half; d < dim; d++)                                       \
                    STORE(head + d * dim_stride,                                           \
                          ROUND(a[d] * LOAD(c + d)) + a[d - half] * LOAD(s + d));          \
            }                                                                              \
            for (int64_t which = 0; which < 2; which++)                                    \
                for (int64_t h = 0; h < kv_heads; h++) {                                   \
                    const T *head = x + t * token_stride                                   \
                                    + (q_heads + which * kv_heads + h) * head_stride;      \
                    T *target = pool + rows[(t * 2 + which) * kv_heads + h] * dim;         \
                    for (int64_t d = 0; d < dim; d++) target[d] = head[d * dim_stride];    \
                }                                                                          \
        }                                                                                  \
    }

DEFINE_ROTARY_WRITE(rotary_write_f32, float, f32_load, f32_round, f32_store)
DEFINE_ROTARY_WRITE(rotary_write_bf16, uint16_t, bf16_load, bf16_round, bf16_store)
DEFINE_ROTARY_WRITE(rotary_write_f16, _Float16, f16_load, f16_round, f16_store)

int kvproof_rotary_write_kv(void *x, int64_t token_stride, int64_t head_stride,
                            int64_t dim_stride, int64_t tokens, int64_t q_heads,
                            int64_t kv_heads, int64_t dim, const void *cos,
                            const void *signed_sin, int64_t table_stride, void *pool,
                            int64_t pool_rows, const int64_t *rows, int dtype) {
    if (tokens < 0 || q_heads < 0 || kv_heads < 0 || dim <= 0 || dim % 2 != 0 ||
        dim > MAX_HEAD_DIM)
        return -1;
    for (int64_t i = 0; i < tokens * 2 * kv_heads; i++)
        if (rows[i] < 0 || rows[i] >= pool_rows) return -1;
    if (dtype == DTYPE_F32)
        rotary_write_f32(x, token_stride, head_stride, dim_stride, tokens, q_heads, kv_heads,
                         dim, cos, signed_sin, table_stride, pool, rows);
    else if (dtype == DTYPE_BF16)
        rotary_write_bf16(x, token_stride, head_stride, dim_stride, tokens, q_heads,
                          kv_heads, dim, cos, signed_sin, table_stride, pool, rows);
    else if (dtype == DTYPE_F16)
        rotary_write_f16(x, token_stride, head_stride, dim_stride, tokens, q_heads, kv_heads,
                         dim, cos, signed_sin, table_stride, pool, rows);
    else
        return -1;
    return 0;
}

/* 1 when tags[ids[i]] == expected[i] for every i (ids already inside the pool: the
   caller's plan clamped them and knows which were not), else 0; -1 for an id outside
   [0, num_pages). The decode step's tag check in one call a layer. */
int kvproof_tags_match(const int64_t *tags, int64_t num_pages, const int64_t *ids,
                       const int64_t *expected, int64_t count) {
    int match = 1;
    for (int64_t i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= num_pages) return -1;
        match &= tags[ids[i]] == expected[i];
    }
    return match;
}

/* Page digests (kernels/checksum.py has the definition and its guarantees): a page's bytes
   as N 16-bit units h_j, A = sum h_j mod p, B = sum (N - j) h_j mod p = N A - sum j h_j,
   p = 2^31 - 1, digest (B << 32) | A. One pass over each page, in blocks of 256 units
   whose sums fit 32 bits (sum h < 2^24, sum c h_c < 255 * 65535 * 256 < 2^32), so the
   inner loop is plain vectorizable integer arithmetic; the torch reference gathers the
   pages and widens every unit to int32 first (three passes and two copies). */
#define CHECKSUM_MODULUS 2147483647ull
#define CHECKSUM_BLOCK 256

static uint64_t page_digest(const uint16_t *restrict units, int64_t count) {
    uint64_t sum = 0, weighted = 0; /* sum h mod p, sum j h_j mod p */
    for (int64_t start = 0; start < count; start += CHECKSUM_BLOCK) {
        int64_t length = count - start < CHECKSUM_BLOCK ? count - start : CHECKSUM_BLOCK;
        const uint16_t *block = units + start;
        uint32_t block_sum = 0, block_weighted = 0;
        for (int64_t c = 0; c < length; c++) {
            block_sum += block[c];
            block_weighted += (uint32_t)c * block[c];
        }
        sum += block_sum;
        /* sum over the block of (start + c) h_c = start * block_sum + block_weighted */
        weighted = (weighted + ((uint64_t)start % CHECKSUM_MODULUS) * block_sum +
                    block_weighted) % CHECKSUM_MODULUS;
    }
    sum %= CHECKSUM_MODULUS;
    uint64_t by_count = ((uint64_t)count % CHECKSUM_MODULUS) * sum % CHECKSUM_MODULUS;
    uint64_t b = (by_count + CHECKSUM_MODULUS - weighted) % CHECKSUM_MODULUS;
    return (b << 32) | sum;
}

/* digests[i] = the digest of page pages[i] of a pool of num_pages pages of page_bytes
   bytes each (even); -1 (nothing written) for a page id outside the pool. */
int kvproof_page_checksum(const void *pool, int64_t num_pages, int64_t page_bytes,
                          const int64_t *pages, int64_t count, int64_t *digests) {
    if (page_bytes % 2 != 0 || page_bytes / 2 >= (int64_t)CHECKSUM_MODULUS) return -1;
    for (int64_t i = 0; i < count; i++)
        if (pages[i] < 0 || pages[i] >= num_pages) return -1;
    for (int64_t i = 0; i < count; i++)
        digests[i] = (int64_t)page_digest(
            (const uint16_t *)((const char *)pool + pages[i] * page_bytes), page_bytes / 2);
    return 0;
}
