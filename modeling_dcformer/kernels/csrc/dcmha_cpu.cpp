
// DCMHA between the two matrix products, on CPU: Compose, mask, softmax, Compose in place on a chunk's raw q.k
// scores (the "cpu" implementation of modeling_dcformer; see dcmha_cpu.py). Registered as the PyTorch operator
// dcformer::compose_softmax_compose_ (in place on `scores`), whose tiles run on PyTorch's intra-op thread pool.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define BLOCK 128      /* keys per block: the rows of a tile share the block's key factors, copied to L1 */
/* Floats from one row of a block buffer to the next: BLOCK + 16. Rows a power of two apart (512 bytes) would put
   every eighth row at the same address modulo 4 KiB, and a load whose address matches a recent store's low 12
   bits waits for that store to retire (4K aliasing): Compose stores each head's output while it loads the others'
   inputs and the key factors. With an offset a row, the forward operator took 0.74-0.80x its time at 16 and 32
   heads a group, about the same at 4-12 (docs/performance.md). The offset is one 64-byte cache line: with the
   buffers on a line's start, a 16-float vector of any row never straddles two lines. */
#define STRIDE (BLOCK + 16)
#define MAX_RANK 8
#define MAX_HEADS 256  /* heads per group the backward pass supports */
#define FEW_ROWS 4     /* the dynamic-weight projection's products are the operator's own up to this many rows */

/* exp(x) for x <= 0 (Cephes' expf polynomial, within 2 ulp), 0 below -87.3; written so that loops vectorise */
static inline float exp_nonpos(float x) {
    float xc = x < -87.3f ? -87.3f : x;
    float fx = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - fx * 0.693359375f + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)fx + 127) << 23;
    return x < -87.3f ? 0.0f : y * u.f;
}

#define VW 16  /* lanes of a row's running maximum; a block's keys are rounded up to a multiple of it */

/* A buffer of n floats whose first lies on a 64-byte cache line (vectors loaded from it never straddle two lines) */
struct AlignedFloats {
    std::vector<float> storage;
    float *data;
    explicit AlignedFloats(size_t n) : storage(n + 16) {
        data = reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
    }
};

/* Asks for the n floats at p in the cache (one request per 64-byte line) */
static inline void prefetch_span(const float *p, int n) {
    for (int j = 0; j < n; j += 16) __builtin_prefetch(p + j, 1, 3);
}

/* One vector register of VL floats: 16 (AVX-512) where the compiler targets AVX-512 (-march=native on such a CPU),
   else 8 (AVX). Compose keeps its hidden values in registers, so it works on VL keys at a time (on AVX2, 16-float
   vectors, two registers each, made the compiler spill them to the stack; AVX-512 has 32 registers of 16). On an
   AVX-512 CPU the 16-float vectors (with the buffers on cache lines) took the forward operator to 0.73-0.83x its
   time and the backward to 0.83-0.96x (docs/performance.md). */
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#define VL 16
static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define VL 8
static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
static inline vf loadv(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* One Compose (spec, step 6) of VL keys j..j+VL-1 of one query row, the one both operators use. The M heads' values
   x[n] = a[n][j] * sc[n] (a: [M][stride]; sc: the scale or the softmax's 1 / sum of each head, or NULL for 1) give
       out[m] = x[m] (1 + qdd[m]) + sum_i hq_i qw2[i][m] + x[m] kdd[m][j] + sum_i hk_i[j] kw2[i][m][j]
   where hq_i = sum_n x[n] qw1[i][n] and hk_i[j] = sum_n x[n] kw1[i][n][j]. q: the row's query factors [2I+1][M];
   k: the keys' factors [2I+1][M][kstride], or NULL (query-wise). Each head's output goes to store(m, out), in head
   order, after every head's input is read (so it may write over a). The hidden values stay in registers: each
   score is read twice. Inlined with M and I constant where they can be (the loops unroll). */
template <typename Store>
static inline __attribute__((always_inline)) void compose_vec(const float *a, int64_t stride, int j, const int M,
                                                           const int I, const float *q, const float *k, int kstride,
                                                           const float *sc, Store store) {
    vf hq[MAX_RANK], hk[MAX_RANK];
    for (int i = 0; i < I; i++) hq[i] = hk[i] = vf{};
    for (int n = 0; n < M; n++) {
        const vf x = sc ? loadv(a + n * stride + j) * sc[n] : loadv(a + n * stride + j);
        for (int i = 0; i < I; i++) {
            hq[i] += x * q[i * M + n];
            if (k) hk[i] += x * loadv(k + (i * M + n) * kstride + j);
        }
    }
    for (int m = 0; m < M; m++) {
        const vf x = sc ? loadv(a + m * stride + j) * sc[m] : loadv(a + m * stride + j);
        vf out = x * (1.0f + q[2 * I * M + m]);
        for (int i = 0; i < I; i++) out += hq[i] * q[(I + i) * M + m];
        if (k) {
            out += x * loadv(k + (2 * I * M + m) * kstride + j);
            for (int i = 0; i < I; i++) out += hk[i] * loadv(k + ((I + i) * M + m) * kstride + j);
        }
        store(m, out);
    }
}

/* Runs SHAPE(HEADS, RANK) with the heads a group and the rank as compile-time constants where the presets need them
   (rank 2 with 4, 8, 12 or 16 heads a group: the loops over the heads and the rank unroll) and the rank alone for
   ranks 1-4; other shapes run the generic code. Both operators dispatch their Compose loops with it. */
#define DISPATCH_SHAPES(SHAPE)                    \
    if (I == 2 && M == 4) { SHAPE(4, 2); }        \
    else if (I == 2 && M == 8) { SHAPE(8, 2); }   \
    else if (I == 2 && M == 12) { SHAPE(12, 2); } \
    else if (I == 2 && M == 16) { SHAPE(16, 2); } \
    else switch (I) {                             \
        case 1: SHAPE(M, 1); break;               \
        case 2: SHAPE(M, 2); break;               \
        case 3: SHAPE(M, 3); break;               \
        case 4: SHAPE(M, 4); break;               \
        default: SHAPE(M, I);                     \
    }

/* Compose in place on the keys [0, L) of a block (a: head m's keys at a + m * astride, L a multiple of 16; k: the
   block's key factors [2I+1][M][STRIDE] or NULL), with keys outside [lo, hi) or padding (pad[j] == 0, where pad)
   set to `fill`; mx, where given, each head's running maximum in 16 lanes ([M][16]; keys j..j+VL-1 update lanes
   j % 16 ..). Compiled apart with and without key-wise factors and masked keys. */
static void compose_block(float *a, int64_t astride, int L, int M, int I, const float *q, const float *k,
                          const float *sc, int lo, int hi, const uint8_t *pad, float fill, float *mx) {
    const int masked = lo > 0 || hi < L || pad;
    const vi fillv = (vi)(vf{} + fill);
#define COMPOSE_LOOP(HEADS, RANK, K, MASKED)                                                        \
    for (int j = 0; j < L; j += VL) {                                                               \
        vi keep = {0};                                                                              \
        if (MASKED) {                                                                               \
            const vi idx = IOTA + j;                                                                \
            keep = (idx >= lo) & (idx < hi);                                                        \
            if (pad) {                                                                              \
                vi p;                                                                               \
                for (int l = 0; l < VL; l++) p[l] = pad[j + l];                                     \
                keep &= p != 0;                                                                     \
            }                                                                                       \
        }                                                                                           \
        compose_vec(a, astride, j, HEADS, RANK, q, K, STRIDE, sc, [&](int m, vf out) {              \
            if (MASKED) out = (vf)(((vi)out & keep) | (fillv & ~keep));                             \
            if (mx) {                                                                               \
                float *lane = mx + m * VW + (j & (VW - 1));                                         \
                const vf top = loadv(lane);                                                         \
                const vi up = out > top;                                                            \
                storev(lane, (vf)(((vi)out & up) | ((vi)top & ~up)));                               \
            }                                                                                       \
            storev(a + m * astride + j, out);                                                       \
        });                                                                                         \
    }
#define COMPOSE_KM(HEADS, RANK)                                                          \
    if (k && masked) COMPOSE_LOOP(HEADS, RANK, k, 1)                                     \
    else if (k) COMPOSE_LOOP(HEADS, RANK, k, 0)                                          \
    else if (masked) COMPOSE_LOOP(HEADS, RANK, static_cast<const float *>(nullptr), 1)   \
    else COMPOSE_LOOP(HEADS, RANK, static_cast<const float *>(nullptr), 0)
    DISPATCH_SHAPES(COMPOSE_KM)
#undef COMPOSE_KM
#undef COMPOSE_LOOP
}

/* The keys [lo, hi) of a block of L keys, the first at absolute position k0, that the query at absolute position
   qpos sees (causal; within the window where window > 0), padding aside; hi <= lo when it sees none. */
static inline void visible_span(int64_t qpos, int64_t k0, int64_t window, int L, int64_t *lo, int64_t *hi) {
    const int64_t first = window > 0 ? qpos - window + 1 - k0 : 0, last = qpos + 1 - k0;
    *lo = first < 0 ? 0 : first;
    *hi = last > L ? L : last;
}

/* The exponentials of the softmax of one row of n values, in place, given the row's maximum (16 lanes); returns
   1 / (sum of exp(x - max)): the caller multiplies by it (in the Compose that follows). Partial sums in 16 lanes,
   so that the loop vectorises. */
static float softmax_row(float *__restrict__ x, int n, const float *mx) {
    float lane[16], top = -FLT_MAX;
    for (int l = 0; l < VW; l++) top = mx[l] > top ? mx[l] : top;
    for (int l = 0; l < 16; l++) lane[l] = 0.0f;
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) {
            const float e = exp_nonpos(x[j + l] - top);
            x[j + l] = e;
            lane[l] += e;
        }
    float sum = 0.0f;
    for (; j < n; j++) {
        x[j] = exp_nonpos(x[j] - top);
        sum += x[j];
    }
    for (int l = 0; l < 16; l++) sum += lane[l];
    return 1.0f / sum;
}

/* Where a chunk's scores lie: head n of batch b, row r at b * batch + n * head + r * row (floats). `staggered`: one
   head's rows lie STRIDE floats after the previous head's modulo 4 KiB (head % 1024 == STRIDE), as the rows of a
   block buffer do, so Compose works on the scores where they are. Otherwise (a contiguous chunk: at 1,024 keys
   the heads' rows lie a multiple of 4 KiB apart) it works on copies of each block (`dcmha_tile`). The model's
   chunks are laid out staggered (dcmha_cpu.score_layout): the copies cost 10-16% of the forward operator's time
   at 64-512 keys (docs/performance.md). */
struct ScoreLayout {
    int64_t batch, head, row;
    bool staggered;
};

static ScoreLayout contiguous_layout(int64_t N, int64_t c, int64_t s) { return {N * c * s, c * s, s, false}; }

/* One tile of DCMHA between the two matrix products, in place: rows [r0, r1) of the chunk for batch x group bg.
   scores: [B, G*M, c, s] laid out as `lay` says, the raw q.k products; on return the composed probabilities.
   qt: [B, G, 2, 2I+1, M, T] (slots pre, post; time last), the chunk's first query at time index t0.
   kt: [B, G, 2, 2I+1, M, S] (time last), the chunk's first key at index s0; nullptr for query-wise composition.
   pad: [B, pad_stride] bytes, 1 for a real key, the chunk's first key at index s0; or nullptr. Query r of the chunk
   sits at absolute position qpos0 + r, key j at kpos0 + j; the query sees the key when kpos <= qpos,
   kpos > qpos - window (window > 0) and the key is real.
   The tile is done in three steps: Compose before the softmax (masked keys -FLT_MAX), the softmax of each head's
   row, Compose after it (masked keys 0; the softmax's division folded into it). Compose works on blocks of BLOCK
   keys; the block's key factors and the row's query factors are copied to contiguous buffers (in place, the rows
   of the factors lie a multiple of 4 KiB apart and would compete for the same few L1 cache sets), and so are the
   heads' scores unless the layout is staggered and the block holds a whole number of 16-key vectors (Compose
   writes whole vectors; in place, the lanes past the block's keys would be another row's). */
static void dcmha_tile(float *scores, ScoreLayout lay, int G, int M, int c, int s, int I, const float *qt, int64_t T,
                       int64_t t0, const float *kt, int64_t S, int64_t s0, const uint8_t *pad, int64_t pad_stride,
                       int64_t qpos0, int64_t kpos0, int64_t window, float scale, int64_t bg, int r0, int r1) {
    const int W = 2 * I + 1, R = r1 - r0;
    const int64_t b = bg / G;
    /* per row and head: 1 / sum of the softmax; the scale; a block of scores, of key factors; the query factors of
       each row; per row and head, the running max of the composed scores (16 lanes) */
    AlignedFloats buffer((size_t)(1 + W) * M * STRIDE + (size_t)(R + 1) * M + (size_t)R * W * M);
    AlignedFloats maxima((size_t)VW * R * M);
    float *xb = buffer.data, *kb = xb + (size_t)M * STRIDE, *mx = maxima.data;
    float *sc = kb + (size_t)W * M * STRIDE, *pre = sc + (size_t)R * M, *qb = pre + M;
    uint8_t pb[BLOCK];  /* the block's padding bytes */
    for (int n = 0; n < M; n++) pre[n] = scale;
    /* head n, row r: base + n * head + r * row */
    const int64_t head = lay.head, row = lay.row;
    float *base = scores + b * lay.batch + (bg % G) * M * head;
    const uint8_t *pd = pad ? pad + b * pad_stride + s0 : nullptr;
    for (int slot = 0; slot < 2; slot++) {
        const float *qs = qt + (bg * 2 + slot) * W * M * T + t0;
        const float *ks = kt ? kt + (bg * 2 + slot) * W * M * S + s0 : nullptr;
        const float fill = slot == 0 ? -FLT_MAX : 0.0f;
        for (int r = 0; r < R; r++)
            for (int w = 0; w < W * M; w++) qb[r * W * M + w] = qs[(int64_t)w * T + r0 + r];
        if (slot == 0)
            for (int i = 0; i < R * M * VW; i++) mx[i] = -FLT_MAX;
        else
            for (int r = r0; r < r1; r++)
                for (int n = 0; n < M; n++)
                    sc[(r - r0) * M + n] = softmax_row(base + n * head + r * row, s, mx + ((r - r0) * M + n) * VW);
        for (int j0 = 0; j0 < s; j0 += BLOCK) {
            /* L keys, Lv rounded up to the vector width: the lanes past L are zero, masked, not written */
            const int L = s - j0 < BLOCK ? s - j0 : BLOCK, Lv = (L + VW - 1) / VW * VW;
            const bool direct = lay.staggered && L == Lv;  /* Compose on the scores where they are, not on a copy */
            if (ks)
                for (int w = 0; w < W * M; w++)
                    for (int j = 0; j < Lv; j++) kb[w * STRIDE + j] = j < L ? ks[(int64_t)w * S + j0 + j] : 0.0f;
            if (pd)
                for (int j = 0; j < Lv; j++) pb[j] = j < L ? pd[j0 + j] : 0;
            for (int r = r0; r < r1; r++) {
                if (r + 1 < r1)  /* the next row's block, from L3 while this one is worked on */
                    for (int n = 0; n < M; n++) prefetch_span(base + n * head + (r + 1) * row + j0, L);
                int64_t lo, hi;  /* this row's visible keys in the block, before padding */
                visible_span(qpos0 + r, kpos0 + j0, window, L, &lo, &hi);
                if (hi <= lo) { /* the row sees no key of the block */
                    for (int n = 0; n < M; n++) {
                        float *x = base + n * head + r * row + j0;
                        for (int j = 0; j < L; j++) x[j] = fill;
                    }
                    continue;
                }
                float *a = direct ? base + r * row + j0 : xb;
                const int64_t astride = direct ? head : STRIDE;
                if (!direct)
                    for (int n = 0; n < M; n++) {
                        std::memcpy(xb + n * STRIDE, base + n * head + r * row + j0, sizeof(float) * L);
                        for (int j = L; j < Lv; j++) xb[n * STRIDE + j] = 0.0f;
                    }
                compose_block(a, astride, Lv, M, I, qb + (r - r0) * W * M, ks ? kb : nullptr,
                              slot == 0 ? pre : sc + (r - r0) * M, (int)lo, (int)hi, pd ? pb : nullptr, fill,
                              slot == 0 ? mx + (r - r0) * M * VW : nullptr);
                if (!direct)
                    for (int n = 0; n < M; n++)
                        std::memcpy(base + n * head + r * row + j0, xb + n * STRIDE, sizeof(float) * L);
            }
        }
    }
}

/* The checks both operators make on a chunk's operands (the loops trust these bounds), and what they read off them.
   scores: [B, G*M, c, s] fp32 contiguous (named `name` in errors); query_terms [B, G, 2, 2I+1, M, T], key_terms
   [B, G, 2, 2I+1, M, S] or none, fp32 contiguous, the chunk's queries at t0, its keys at s0; key_padding_mask
   [B, >= s0 + s] uint8 or none. */
struct ChunkOperands {
    int64_t B, G, M, c, s, T, S = 0, pad_stride = 0;
    const float *qt = nullptr, *kt = nullptr;
    const uint8_t *pad = nullptr;
};

static void fp32_cpu(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "the DCMHA CPU kernel takes contiguous float32 CPU tensors; ", name, " is not");
}

static ChunkOperands check_chunk(const at::Tensor &scores, const char *name, const at::Tensor &query_terms,
                                 int64_t t0, const std::optional<at::Tensor> &key_terms, int64_t s0,
                                 const std::optional<at::Tensor> &key_padding_mask, int64_t rank,
                                 int64_t num_groups, bool strided_scores = false) {
    ChunkOperands x;
    if (strided_scores) {
        TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat,
                    "the DCMHA CPU kernel takes float32 CPU tensors; ", name, " is not");
    } else {
        fp32_cpu(scores, name);
    }
    fp32_cpu(query_terms, "query_terms");
    TORCH_CHECK(scores.dim() == 4, name, " must be [B, N, c, s]");
    const int64_t N = scores.size(1);
    x.B = scores.size(0), x.c = scores.size(2), x.s = scores.size(3), x.G = num_groups;
    TORCH_CHECK(rank >= 1 && rank <= MAX_RANK, "the DCMHA CPU kernel supports 1 <= dynamic_rank <= ", MAX_RANK);
    TORCH_CHECK(x.G >= 1 && N % x.G == 0, "bad num_groups");
    x.M = N / x.G;
    TORCH_CHECK(query_terms.dim() == 6 && query_terms.size(0) == x.B && query_terms.size(1) == x.G &&
                    query_terms.size(2) == 2 && query_terms.size(3) == 2 * rank + 1 && query_terms.size(4) == x.M,
                "scores ", scores.sizes(), " do not match the query factors ", query_terms.sizes());
    x.T = query_terms.size(5);
    TORCH_CHECK(t0 >= 0 && t0 + x.c <= x.T, "queries [", t0, ", ", t0 + x.c, ") outside the ", x.T, " of query_terms");
    x.qt = query_terms.data_ptr<float>();
    if (key_terms.has_value()) {
        fp32_cpu(*key_terms, "key_terms");
        TORCH_CHECK(key_terms->dim() == 6 && key_terms->sizes().slice(0, 5).equals(query_terms.sizes().slice(0, 5)),
                    "key factors ", key_terms->sizes(), " do not match the query factors ", query_terms.sizes());
        x.S = key_terms->size(5);
        TORCH_CHECK(s0 >= 0 && s0 + x.s <= x.S, "keys [", s0, ", ", s0 + x.s, ") outside the ", x.S, " of key_terms");
        x.kt = key_terms->data_ptr<float>();
    }
    if (key_padding_mask.has_value()) {
        const at::Tensor &p = *key_padding_mask;
        TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kByte && p.is_contiguous() && p.dim() == 2 &&
                        p.size(0) == x.B && s0 >= 0 && s0 + x.s <= p.size(1),
                    "key_padding_mask ", p.sizes(), " must be contiguous uint8 covering batch ", x.B, ", keys [", s0,
                    ", ", s0 + x.s, ")");
        x.pad = p.data_ptr<uint8_t>();
        x.pad_stride = p.size(1);
    }
    return x;
}

/* dcformer::compose_softmax_compose_: the whole chunk, in place on `scores` ([B, G*M, c, s] fp32, each row of keys
   contiguous, rows that do not overlap: contiguous, or staggered as dcmha_cpu.score_layout lays it out).
   Every argument is checked here: the loops trust these bounds. Tiles of `rows` query rows (per batch x group)
   are spread over PyTorch's intra-op threads when `parallel` (each tile is computed alone: the numbers do not
   depend on the threads). */
static void compose_softmax_compose_(const at::Tensor &scores, const at::Tensor &query_terms, int64_t t0,
                                     const std::optional<at::Tensor> &key_terms, int64_t s0,
                                     const std::optional<at::Tensor> &key_padding_mask, int64_t query_pos0,
                                     int64_t key_pos0, int64_t window, double scale, int64_t rank, int64_t num_groups,
                                     int64_t rows, bool parallel) {
    const ChunkOperands x = check_chunk(scores, "scores", query_terms, t0, key_terms, s0, key_padding_mask, rank,
                                        num_groups, true);
    TORCH_CHECK(rows >= 1, "bad rows");
    /* rows of keys, each contiguous, that do not overlap: each row after the previous one, each head after the
       previous head's rows, each batch after the previous batch's heads (in the strides' own order) */
    const int64_t st0 = scores.stride(0), st1 = scores.stride(1), st2 = scores.stride(2);
    const int64_t last_row = (x.c - 1) * st2 + x.s, last_head = (x.G * x.M - 1) * st1 + last_row;
    TORCH_CHECK(scores.stride(3) == 1 && (x.c == 1 || st2 >= x.s) && (x.G * x.M == 1 || st1 >= last_row) &&
                    (x.B == 1 || st0 >= last_head),
                "scores must be laid out batch after batch, head after head, row after row, each row's keys "
                "contiguous (strides ", scores.strides(), ")");
    const ScoreLayout layout{st0, st1, st2, x.G * x.M > 1 && st1 % 1024 == STRIDE};
    const int64_t B = x.B, G = x.G, M = x.M, c = x.c, s = x.s, T = x.T, S = x.S, pad_stride = x.pad_stride;
    const float *qt = x.qt, *kt = x.kt;
    const uint8_t *pad = x.pad;
    float *sp = scores.data_ptr<float>();
    const int64_t ntiles = (c + rows - 1) / rows;
    auto run = [&](int64_t begin, int64_t end) {
        for (int64_t index = begin; index < end; index++) {
            const int64_t bg = index / ntiles, tile = index % ntiles;
            const int r0 = (int)(tile * rows), r1 = (int)std::min<int64_t>(c, (tile + 1) * rows);
            dcmha_tile(sp, layout, (int)G, (int)M, (int)c, (int)s, (int)rank, qt, T, t0, kt, S, s0, pad, pad_stride,
                       query_pos0, key_pos0, window, (float)scale, bg, r0, r1);
        }
    };
    if (parallel)
        at::parallel_for(0, B * G * ntiles, 1, run);
    else
        run(0, B * G * ntiles);
}

/* ---------------------------------------------------------------------------------------------------------------
   The backward pass (training): dcformer::compose_softmax_compose_backward_. For each query row it recomputes the
   row's forward pass from the raw q.k scores (Compose before the softmax, mask, softmax, Compose after it: the
   probabilities, returned for the values' gradient), then takes the gradient of the probabilities back through
   Compose after the softmax, the softmax and Compose before it. A row's M x s values stay in the core's cache; each
   Compose and its gradient work on VL keys at a time with the hidden values and their gradients in registers; the
   row's factor gradients are summed in VL lanes, the keys' factor gradients (summed over the rows) in a buffer. */

/* max_j x[j] over n values (VL lanes, so that the loop vectorises), -FLT_MAX when n is 0 */
static inline float maximum(const float *__restrict__ x, int n) {
    vf top = vf{} - FLT_MAX;
    int j = 0;
    for (; j + VL <= n; j += VL) {
        const vf y = loadv(x + j);
        top = y > top ? y : top;
    }
    float m = -FLT_MAX;
    for (int l = 0; l < VL; l++) m = top[l] > m ? top[l] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* sum_j x[j] over n values, n a multiple of 16 */
static inline float total(const float *__restrict__ x, int n) {
    vf acc = vf{};
    for (int j = 0; j < n; j += VL) acc += loadv(x + j);
    float sum = 0.0f;
    for (int l = 0; l < VL; l++) sum += acc[l];
    return sum;
}

/* The gradient of Compose (compose_vec without scale) for keys j..j+VL-1 of one row: given the input a and the
   output's gradient g ([M][sv]), writes
   the input's gradient da; adds the row's factor gradients to dq ([W][M] accumulators of VL lanes) and the keys'
   to dk (laid out like k). */
static inline __attribute__((always_inline)) void compose_vec_backward(
        const float *__restrict__ a, const float *__restrict__ g, float *__restrict__ da, int sv, int j, int M, int I,
        const float *q, const float *k, vf *__restrict__ dq, float *__restrict__ dk) {
    vf hq[MAX_RANK], hk[MAX_RANK], gq[MAX_RANK], gk[MAX_RANK];  /* hidden values and their gradients */
    for (int i = 0; i < I; i++) hq[i] = hk[i] = gq[i] = gk[i] = vf{};
    for (int n = 0; n < M; n++) {
        const vf x = loadv(a + n * sv + j), y = loadv(g + n * sv + j);
        for (int i = 0; i < I; i++) {
            hq[i] += x * q[i * M + n];
            gq[i] += y * q[(I + i) * M + n];
            if (k) {
                hk[i] += x * loadv(k + (i * M + n) * sv + j);
                gk[i] += y * loadv(k + ((I + i) * M + n) * sv + j);
            }
        }
    }
    for (int n = 0; n < M; n++) {
        const vf x = loadv(a + n * sv + j), y = loadv(g + n * sv + j);
        vf d = y * (1.0f + q[2 * I * M + n]);
        dq[2 * I * M + n] += y * x;
        for (int i = 0; i < I; i++) {
            d += gq[i] * q[i * M + n];
            dq[i * M + n] += gq[i] * x;
            dq[(I + i) * M + n] += y * hq[i];
        }
        if (k) {
            d += y * loadv(k + (2 * I * M + n) * sv + j);
            float *dd = dk + (2 * I * M + n) * sv + j;
            storev(dd, loadv(dd) + y * x);
            for (int i = 0; i < I; i++) {
                d += gk[i] * loadv(k + (i * M + n) * sv + j);
                float *w1 = dk + (i * M + n) * sv + j, *w2 = dk + ((I + i) * M + n) * sv + j;
                storev(w1, loadv(w1) + gk[i] * x);
                storev(w2, loadv(w2) + y * hk[i]);
            }
        }
        storev(da + n * sv + j, d);
    }
}

/* Compose and its gradient over the first len keys of a row (len a multiple of 16): a, out, g, da [M][sv], q
   [2I+1][M] the row's factors, k [2I+1][M][sv] the keys' or NULL; dq, dk as compose_vec_backward's. */
static void compose_row(const float *a, float *out, int len, int sv, int M, int I, const float *q, const float *k) {
#define ROW(HEADS, RANK, K)                                                                    \
    for (int j = 0; j < len; j += VL)                                                          \
        compose_vec(a, sv, j, HEADS, RANK, q, K, sv, static_cast<const float *>(nullptr),      \
                 [&](int m, vf o) { storev(out + m * sv + j, o); })
#define ROW_K(HEADS, RANK) if (k) ROW(HEADS, RANK, k); else ROW(HEADS, RANK, static_cast<const float *>(nullptr));
    DISPATCH_SHAPES(ROW_K)
#undef ROW_K
#undef ROW
}

static void compose_row_backward(const float *a, const float *g, float *da, int len, int sv, int M, int I,
                                 const float *q, const float *k, vf *dq, float *dk) {
#define ROW(HEADS, RANK, K) \
    for (int j = 0; j < len; j += VL) compose_vec_backward(a, g, da, sv, j, HEADS, RANK, q, K, dq, dk)
#define ROW_K(HEADS, RANK) if (k) ROW(HEADS, RANK, k); else ROW(HEADS, RANK, static_cast<const float *>(nullptr));
    DISPATCH_SHAPES(ROW_K)
#undef ROW_K
#undef ROW
}
#undef DISPATCH_SHAPES

/* The backward pass of one batch x group bg over the chunk's c query rows: raw [B, G*M, c, s], the q.k products,
   overwritten with the probabilities (the forward pass's output); grad [B, G*M, c, s], the gradient of the
   probabilities on entry and of raw on return. Factors and their gradients: [B, G, 2, 2I+1, M, T or S], time last
   (dkt NULL when kt is). A tile of BWD_ROWS rows goes over the keys in blocks of BWD_BLOCK three times, so that a block's
   key factors and their gradients stay in cache for all the tile's rows (a whole row's would not, at thousands of
   keys): (0) Compose before the softmax, kept for the tile (`kept`), each row's running maximum and sum (an online
   softmax); (1) the softmax (over `kept`), the gradient through Compose after it (dP -> dp, written over grad) and
   each row's sum of p dp; (2) Compose after the softmax (the probabilities, written over raw once read), the
   softmax's gradient and the gradient through Compose before it (written over grad). */
#define BWD_ROWS 16
#define BWD_BLOCK 64   /* keys per block in the backward pass: a block's key factors and their gradients stay near L1 */
/* floats from one row of a block buffer to the next: BWD_BLOCK + 16 (one cache line), not a power of two, as STRIDE (4K aliasing
   between the Compose gradients' stores and loads: 0.83-0.90x the time at 4-12 heads a group, 0.62-0.77x at 16
   and 32, docs/performance.md) */
#define BWD_STRIDE (BWD_BLOCK + 16)
static void dcmha_backward_bg(float *raw, float *grad, int G, int M, int c, int s, int I, const float *qt, float *dqt,
                              int64_t T, int64_t t0, const float *kt, float *dkt, int64_t S, int64_t s0,
                              const uint8_t *pad, int64_t pad_stride, int64_t qpos0, int64_t kpos0, int64_t window,
                              float scale, int64_t bg) {
    const int W = 2 * I + 1, F = W * M, P = BWD_STRIDE;
    const size_t rowb = (size_t)M * BWD_STRIDE, kfb = kt ? (size_t)F * BWD_STRIDE : 0, stats = (size_t)BWD_ROWS * M;
    /* per row and block: x0 the scaled products, p the probabilities (before Compose after the softmax), gp a
       gradient, d an input's gradient or an output; the block's key factors of both slots and their gradients;
       the tile's factors; the block's visible keys of a row (1 or 0); per row and head: the running maximum, the
       sum (then its inverse), the sum of p dp; per row: its factor gradients (VL lanes each) */
    AlignedFloats buffer(4 * rowb + 4 * kfb + (size_t)2 * F * BWD_ROWS + BWD_BLOCK + 3 * stats);
    std::vector<vf> dqv((size_t)BWD_ROWS * 2 * F);
    /* the tile's rows after Compose before the softmax, masked ([BWD_ROWS][M][s]; about 0.5 MiB at 8 heads and 1024
       keys: it stays in L2), written in pass 0; pass 1 turns them into the probabilities, which pass 2 reads */
    AlignedFloats kept((size_t)BWD_ROWS * M * s);
    float *x0 = buffer.data, *p = x0 + rowb, *gp = p + rowb, *d = gp + rowb;
    float *kf = d + rowb, *dkf = kf + 2 * kfb, *qf = dkf + 2 * kfb, *vis = qf + (size_t)2 * F * BWD_ROWS;
    float *top = vis + BWD_BLOCK, *sum = top + stats, *mean = sum + stats;
    const int64_t b = bg / G;
    const uint8_t *pd = pad ? pad + b * pad_stride + s0 : nullptr;
    for (int r0 = 0; r0 < c; r0 += BWD_ROWS) {
        const int R = c - r0 < BWD_ROWS ? c - r0 : BWD_ROWS;
        for (int rr = 0; rr < R; rr++)
            for (int w = 0; w < 2 * F; w++) {
                const int slot = w / F;
                qf[rr * 2 * F + w] = qt[((bg * 2 + slot) * F + w % F) * T + t0 + r0 + rr];
                dqv[rr * 2 * F + w] = vf{};
            }
        for (size_t i = 0; i < stats; i++) top[i] = -FLT_MAX, sum[i] = 0.0f, mean[i] = 0.0f;
        for (int phase = 0; phase < 3; phase++) {
            for (int j0 = 0; j0 < s; j0 += BWD_BLOCK) {
                const int L = s - j0 < BWD_BLOCK ? s - j0 : BWD_BLOCK, Lv = (L + VW - 1) / VW * VW;
                for (int slot = 0; slot < 2 && kt; slot++)
                    for (int w = 0; w < F; w++) {
                        const float *src = kt + ((bg * 2 + slot) * F + w) * S + s0 + j0;
                        float *dst = kf + slot * kfb + (size_t)w * P, *dd = dkf + slot * kfb + (size_t)w * P;
                        std::memcpy(dst, src, sizeof(float) * L);
                        for (int j = L; j < Lv; j++) dst[j] = 0.0f;
                        std::memset(dd, 0, sizeof(float) * Lv);
                    }
                const float *k0 = kt ? kf : nullptr, *k1 = kt ? kf + kfb : nullptr;
                for (int rr = 0; rr < R; rr++) {
                    const int r = r0 + rr;
                    int64_t lo, hi;
                    visible_span(qpos0 + r, kpos0 + j0, window, L, &lo, &hi);
                    for (int j = 0; j < Lv; j++) vis[j] = (float)((j >= lo) & (j < hi));
                    if (pd)
                        for (int j = 0; j < L; j++) vis[j] *= (float)(pd[j0 + j] != 0);
                    float *raw_row[MAX_HEADS], *grad_row[MAX_HEADS];
                    if (rr + 1 < R)  /* the next row's block, from L3 while this one is worked on */
                        for (int n = 0; n < M; n++) {
                            const int64_t next = ((bg * M + n) * (int64_t)c + r + 1) * s + j0;
                            if (phase != 1) prefetch_span(raw + next, L);
                            if (phase > 0) prefetch_span(grad + next, L);
                        }
                    for (int n = 0; n < M; n++) {
                        raw_row[n] = raw + ((bg * M + n) * (int64_t)c + r) * s + j0;
                        grad_row[n] = grad + ((bg * M + n) * (int64_t)c + r) * s + j0;
                        if (phase == 1) continue;  /* pass 1 needs no input of Compose before the softmax */
                        for (int j = 0; j < L; j++) x0[n * P + j] = raw_row[n][j] * scale;
                        for (int j = L; j < Lv; j++) x0[n * P + j] = 0.0f;
                    }
                    const float *q0 = qf + rr * 2 * F, *q1 = q0 + F;
                    float *tp = top + rr * M, *sm = sum + rr * M, *mn = mean + rr * M;
                    float *kr = kept.data + (size_t)rr * M * s + j0;  /* head m: kr + m * s */
                    if (phase == 0) {  /* Compose before the softmax, kept; the running maximum and sum */
                        compose_row(x0, p, Lv, P, M, I, q0, k0);
                        for (int m = 0; m < M; m++) {
                            float *o = p + (size_t)m * P;
                            for (int j = 0; j < L; j++) o[j] = vis[j] != 0.0f ? o[j] : -FLT_MAX;
                            std::memcpy(kr + (size_t)m * s, o, sizeof(float) * L);
                            const float bm = maximum(o, L);
                            const float nm = bm > tp[m] ? bm : tp[m];
                            for (int j = 0; j < L; j++) o[j] = exp_nonpos(o[j] - nm);
                            for (int j = L; j < Lv; j++) o[j] = 0.0f;
                            sm[m] = sm[m] * exp_nonpos(tp[m] - nm) + total(o, Lv);
                            tp[m] = nm;
                        }
                        continue;
                    }
                    for (int m = 0; m < M; m++) {  /* the probabilities: computed in pass 1 (sm holds 1 / sum), kept */
                        float *o = p + (size_t)m * P, *k_m = kr + (size_t)m * s;
                        if (phase == 1)
                            for (int j = 0; j < L; j++) k_m[j] = o[j] = exp_nonpos(k_m[j] - tp[m]) * sm[m];
                        else
                            std::memcpy(o, k_m, sizeof(float) * L);
                        for (int j = L; j < Lv; j++) o[j] = 0.0f;
                    }
                    vf *dq = dqv.data() + rr * 2 * F;
                    if (phase == 1) {  /* dP -> dp through Compose after the softmax; sum of p dp */
                        for (int n = 0; n < M; n++) {
                            for (int j = 0; j < L; j++) gp[n * P + j] = grad_row[n][j] * vis[j];
                            for (int j = L; j < Lv; j++) gp[n * P + j] = 0.0f;
                        }
                        compose_row_backward(p, gp, d, Lv, P, M, I, q1, k1, dq + F, dkf + kfb);
                        for (int n = 0; n < M; n++) {
                            vf acc = vf{};
                            for (int j = 0; j < Lv; j += VL) acc += loadv(p + n * P + j) * loadv(d + n * P + j);
                            for (int l = 0; l < VL; l++) mn[n] += acc[l];
                            for (int j = 0; j < L; j++) grad_row[n][j] = d[n * P + j];
                        }
                        continue;
                    }
                    /* phase 2: the probabilities over raw; the softmax's gradient; Compose before it */
                    compose_row(p, d, Lv, P, M, I, q1, k1);
                    for (int n = 0; n < M; n++) {
                        for (int j = 0; j < L; j++) raw_row[n][j] = d[n * P + j] * vis[j];
                        for (int j = 0; j < L; j++) gp[n * P + j] = p[n * P + j] * (grad_row[n][j] - mn[n]) * vis[j];
                        for (int j = L; j < Lv; j++) gp[n * P + j] = 0.0f;
                    }
                    compose_row_backward(x0, gp, d, Lv, P, M, I, q0, k0, dq, dkf);
                    for (int n = 0; n < M; n++)
                        for (int j = 0; j < L; j++) grad_row[n][j] = d[n * P + j] * scale;
                }
                if (phase > 0 && kt) {  /* the block's key factor gradients of this slot, summed over the tile */
                    const int slot = phase == 1 ? 1 : 0;
                    for (int w = 0; w < F; w++) {
                        float *dst = dkt + ((bg * 2 + slot) * F + w) * S + s0 + j0;
                        const float *src = dkf + slot * kfb + (size_t)w * P;
                        for (int j = 0; j < L; j++) dst[j] += src[j];
                    }
                }
            }
            if (phase == 0)
                for (size_t i = 0; i < stats; i++) sum[i] = 1.0f / sum[i];
        }
        for (int rr = 0; rr < R; rr++)
            for (int w = 0; w < 2 * F; w++) {
                float total_w = 0.0f;
                for (int l = 0; l < VL; l++) total_w += dqv[rr * 2 * F + w][l];
                const int slot = w / F;
                dqt[((bg * 2 + slot) * F + w % F) * T + t0 + r0 + rr] += total_w;
            }
    }
}

/* dcformer::compose_softmax_compose_backward_: the chunk's gradient. raw: the chunk's q.k products (as the forward
   pass got them), overwritten with the probabilities (the values' gradient needs them); grad: the gradient of the
   probabilities, overwritten with the gradient of raw;
   query_terms_grad, key_terms_grad: the factors' gradients, added to (laid out like the factors). Batch x group
   pairs run on PyTorch's intra-op threads when `parallel` (each writes only its own factors' gradients). */
static void compose_softmax_compose_backward_(const at::Tensor &raw, const at::Tensor &grad,
                                              const at::Tensor &query_terms, int64_t t0,
                                              const std::optional<at::Tensor> &key_terms, int64_t s0,
                                              const std::optional<at::Tensor> &key_padding_mask, int64_t query_pos0,
                                              int64_t key_pos0, int64_t window, double scale, int64_t rank,
                                              int64_t num_groups, const at::Tensor &query_terms_grad,
                                              const std::optional<at::Tensor> &key_terms_grad, bool parallel) {
    const ChunkOperands x = check_chunk(raw, "raw", query_terms, t0, key_terms, s0, key_padding_mask, rank,
                                        num_groups);
    fp32_cpu(grad, "grad");
    fp32_cpu(query_terms_grad, "query_terms_grad");
    TORCH_CHECK(grad.sizes().equals(raw.sizes()), "grad must match raw");
    TORCH_CHECK(x.M <= MAX_HEADS, "the DCMHA CPU kernel's backward pass supports up to ", MAX_HEADS, " heads a group");
    TORCH_CHECK(query_terms_grad.sizes().equals(query_terms.sizes()), "query_terms_grad must match query_terms");
    TORCH_CHECK(key_terms.has_value() == key_terms_grad.has_value(), "key_terms and key_terms_grad go together");
    float *dkt = nullptr;
    if (key_terms_grad.has_value()) {
        fp32_cpu(*key_terms_grad, "key_terms_grad");
        TORCH_CHECK(key_terms_grad->sizes().equals(key_terms->sizes()), "key_terms_grad must match key_terms");
        dkt = key_terms_grad->data_ptr<float>();
    }
    const int64_t B = x.B, G = x.G, M = x.M, c = x.c, s = x.s, T = x.T, S = x.S;
    float *rp = raw.data_ptr<float>(), *gp = grad.data_ptr<float>(), *dqt = query_terms_grad.data_ptr<float>();
    auto run = [&](int64_t begin, int64_t end) {
        for (int64_t bg = begin; bg < end; bg++)
            dcmha_backward_bg(rp, gp, (int)G, (int)M, (int)c, (int)s, (int)rank, x.qt, dqt, T, t0, x.kt, dkt, S, s0,
                              x.pad, x.pad_stride, query_pos0, key_pos0, window, (float)scale, bg);
    };
    if (parallel)
        at::parallel_for(0, B * G, 1, run);
    else
        run(0, B * G);
}

/* ---------------------------------------------------------------------------------------------------------------
   The dynamic-weight projection (spec, step 5) for inference, in one call: dcformer::dynamic_terms. x [..., D]
   (R = batch x time rows), dw1 [D, G*C*K] and dd [D, G*C*M] (the parameters, dw1 [D, G, C, K] and dd [D, G, C*M],
   are taken as they are and viewed 2-D here: at a decode step each view in Python costs microseconds) and qkw
   [G, C, K, 2I, M] give, per row, group g and slot c, the factors [w1; w2; dd] [2I+1, M], [R, G, C, 2I+1, M], packed
   as DynamicWeightProjection's forward packs them:
       h = x @ dw1,  [w1; w2] = gelu(h[g, c]) @ qkw[g, c],  w1's rows RMS-normalised over M (eps),
       dd = tanh((x @ dd)[g, c]).
   The two products are the operator's own up to FEW_ROWS rows (a decode step: they stream the weights from memory
   once, which ATen's GEMM, made for big products, took 1.5x as long to do at the Pythia-160M and DCPythia-6.9B
   shapes: docs/performance.md), ATen's above; the rest is one pass over each row instead of the dozen
   PyTorch ops (and their dispatch) of the Python forward, which at a decode step cost several times the products. */
/* out [R, N] = x [R, D] (rows x_stride floats apart, each contiguous) times w [D, N] (contiguous), reading w once,
   row by row, for the few rows of a decode step: every row of w is used by all R rows of x while it is in L1. */
static void few_rows_times(const float *x, int64_t x_stride, int64_t R, const float *w, int64_t D, int64_t N,
                           float *out) {
    for (int64_t i = 0; i < R * N; i++) out[i] = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        const float *wd = w + d * N;
        for (int64_t r = 0; r < R; r++) {
            const float a = x[r * x_stride + d];
            float *__restrict__ o = out + r * N;
            for (int64_t j = 0; j < N; j++) o[j] += a * wd[j];
        }
    }
}

static at::Tensor dynamic_terms(const at::Tensor &x_in, const at::Tensor &dw1_in, const at::Tensor &dd_in,
                                const at::Tensor &qkw, int64_t rank, double eps, bool parallel) {
    auto check_2d = [](const at::Tensor &t, const char *name) {
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2,
                    "the dynamic-weight projection's operator takes float32 CPU tensors x [..., D], dw1 [D, ...] and "
                    "dd [D, ...]; ", name, " ", t.sizes(), " is not");
    };
    auto flat = [](const at::Tensor &t, bool rows) {  // x as [R, D], a parameter as [D, N]
        if (t.dim() == 2 || t.dim() == 0 || (!rows && t.dim() == 1)) return t;
        return rows ? t.reshape({-1, t.size(-1)}) : t.reshape({t.size(0), -1});
    };
    const at::Tensor x = flat(x_in, true), dw1 = flat(dw1_in, false), dd = flat(dd_in, false);
    check_2d(x, "x");
    check_2d(dw1, "dw1");
    check_2d(dd, "dd");
    fp32_cpu(qkw, "qkw");
    TORCH_CHECK(rank >= 1 && qkw.dim() == 5 && qkw.size(3) == 2 * rank, "qkw ", qkw.sizes(),
                " must be [G, C, K, 2 * rank, M] with rank ", rank);
    const int64_t G = qkw.size(0), C = qkw.size(1), K = qkw.size(2), M = qkw.size(4), I = rank;
    TORCH_CHECK(dw1.size(1) == G * C * K && dd.size(1) == G * C * M && dw1.size(0) == x.size(1) &&
                    dd.size(0) == x.size(1),
                "x ", x.sizes(), ", dw1 ", dw1.sizes(), " and dd ", dd.sizes(), " do not match qkw ", qkw.sizes());
    const int64_t R = x.size(0), D = x.size(1);
    at::Tensor h, diag;
    if (R <= FEW_ROWS && x.stride(1) == 1 && dw1.is_contiguous() && dd.is_contiguous()) {
        h = at::empty({R, G * C * K}, x.options()), diag = at::empty({R, G * C * M}, x.options());
        few_rows_times(x.data_ptr<float>(), x.stride(0), R, dw1.data_ptr<float>(), D, G * C * K, h.data_ptr<float>());
        few_rows_times(x.data_ptr<float>(), x.stride(0), R, dd.data_ptr<float>(), D, G * C * M,
                       diag.data_ptr<float>());
    } else {
        h = at::mm(x, dw1).contiguous(), diag = at::mm(x, dd).contiguous();
    }
    at::Tensor out = at::empty({R, G, C, 2 * I + 1, M}, h.options());
    const float *hp = h.data_ptr<float>(), *dp = diag.data_ptr<float>(), *wp = qkw.data_ptr<float>();
    float *op = out.data_ptr<float>();
    const int64_t W = 2 * I * M, slot = (2 * I + 1) * M;
    const float epsf = (float)eps;
    auto run = [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
            for (int64_t gc = 0; gc < G * C; gc++) {
                const float *a = hp + (r * G * C + gc) * K, *w = wp + gc * K * W, *d = dp + (r * G * C + gc) * M;
                float *o = op + (r * G * C + gc) * slot;
                for (int64_t j = 0; j < W; j++) o[j] = 0.0f;
                for (int64_t k = 0; k < K; k++) {
                    const float x = a[k], g = 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));  // exact GELU
                    const float *wk = w + k * W;
                    for (int64_t j = 0; j < W; j++) o[j] += g * wk[j];
                }
                for (int64_t i = 0; i < I; i++) {
                    float ss = 0.0f;
                    for (int64_t m = 0; m < M; m++) ss += o[i * M + m] * o[i * M + m];
                    const float inv = 1.0f / std::sqrt(ss / (float)M + epsf);
                    for (int64_t m = 0; m < M; m++) o[i * M + m] *= inv;
                }
                for (int64_t m = 0; m < M; m++) o[W + m] = std::tanh(d[m]);
            }
        }
    };
    if (parallel)
        at::parallel_for(0, R, 1, run);
    else
        run(0, R);
    return out;
}

/* ---------------------------------------------------------------------------------------------------------------
   A few queries (a decode step) in one operator, for inference: dcformer::dcmha_decode. The whole attention of T
   queries against S keys: q.k, Compose, mask, softmax, Compose (dcmha_tile, as in compose_softmax_compose_), then
   the probabilities times the values, per batch x group, with the factors read in the layouts the model and its
   cache hold them (time second, any strides) and copied time-last here. At a decode step the Python around the
   chunked path (its matrix products, the factors' time-last copies, the checks) costs several times the
   operator's own work; here it is one call.
   query [B, N, T, Dh], key and value [B, Nkv, S, Dh] with Nkv dividing N, query head n reading key/value head
   n / (N / Nkv) (fp32, the last dimension contiguous); query_terms
   [B, T, G, 2, 2I+1, M], key_terms [B, S, G, 2, 2I+1, M] or none (fp32); key_padding_mask [B, S] uint8 contiguous
   or none; query t at absolute position query_pos0 + t, key j at key_pos0 + j. Returns [B, T, N, Dh]. */
static void fp32_rows(const at::Tensor &t, const char *name, int64_t dims) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dims && t.stride(dims - 1) == 1,
                "the DCMHA CPU kernel takes float32 CPU tensors of ", dims, " dimensions, the last contiguous; ",
                name, " ", t.sizes(), " is not");
}

static at::Tensor dcmha_decode(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                               const at::Tensor &query_terms, const std::optional<at::Tensor> &key_terms,
                               const std::optional<at::Tensor> &key_padding_mask, int64_t query_pos0, int64_t key_pos0,
                               int64_t window, double scale, int64_t rank, int64_t num_groups, bool parallel) {
    fp32_rows(query, "query", 4);
    fp32_rows(key, "key", 4);
    fp32_rows(value, "value", 4);
    const int64_t B = query.size(0), N = query.size(1), T = query.size(2), Dh = query.size(3), S = key.size(2);
    const int64_t Nkv = key.size(1);
    TORCH_CHECK(key.size(0) == B && Nkv >= 1 && N % Nkv == 0 && key.size(3) == Dh && value.sizes().equals(key.sizes()),
                "query ", query.sizes(), ", key ", key.sizes(), " and value ", value.sizes(), " do not match");
    const int64_t rep = N / Nkv; /* query head n reads key/value head n / rep */
    TORCH_CHECK(rank >= 1 && rank <= MAX_RANK, "the DCMHA CPU kernel supports 1 <= dynamic_rank <= ", MAX_RANK);
    TORCH_CHECK(num_groups >= 1 && N % num_groups == 0, "bad num_groups");
    const int64_t G = num_groups, M = N / G, I = rank, W = 2 * I + 1;
    TORCH_CHECK(query_terms.device().is_cpu() && query_terms.scalar_type() == at::kFloat,
                "query_terms must be float32 on CPU");
    TORCH_CHECK(query_terms.dim() == 6 && query_terms.size(0) == B && query_terms.size(1) == T &&
                    query_terms.size(2) == G && query_terms.size(3) == 2 && query_terms.size(4) == W &&
                    query_terms.size(5) == M,
                "query_terms ", query_terms.sizes(), " must be [", B, ", ", T, ", ", G, ", 2, ", W, ", ", M, "]");
    if (key_terms.has_value()) {
        const at::Tensor &k = *key_terms;
        TORCH_CHECK(k.device().is_cpu() && k.scalar_type() == at::kFloat, "key_terms must be float32 on CPU");
        TORCH_CHECK(k.dim() == 6 && k.size(0) == B && k.size(1) == S && k.size(2) == G && k.size(3) == 2 &&
                        k.size(4) == W && k.size(5) == M,
                    "key_terms ", k.sizes(), " must be [", B, ", ", S, ", ", G, ", 2, ", W, ", ", M, "]");
    }
    const uint8_t *pad = nullptr;
    if (key_padding_mask.has_value()) {
        const at::Tensor &p = *key_padding_mask;
        TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kByte && p.is_contiguous() && p.dim() == 2 &&
                        p.size(0) == B && p.size(1) == S,
                    "key_padding_mask ", p.sizes(), " must be contiguous uint8 [", B, ", ", S, "]");
        pad = p.data_ptr<uint8_t>();
    }
    at::Tensor out = at::empty({B, T, N, Dh}, query.options());
    float *op = out.data_ptr<float>();
    const float *qp = query.data_ptr<float>(), *kp = key.data_ptr<float>(), *vp = value.data_ptr<float>();
    const float *qtp = query_terms.data_ptr<float>(), *ktp = key_terms ? key_terms->data_ptr<float>() : nullptr;
    const auto qs = query.strides(), ks = key.strides(), vs = value.strides(), qts = query_terms.strides();
    const std::vector<int64_t> kts = key_terms ? key_terms->strides().vec() : std::vector<int64_t>(6, 0);
    auto run = [&](int64_t begin, int64_t end) {
        /* one batch x group's scores [M, T, S] (laid out as dcmha_tile reads a chunk with bg = 0) and factors */
        std::vector<float> scores((size_t)M * T * S), qt((size_t)2 * W * M * T), kt(ktp ? (size_t)2 * W * M * S : 0);
        for (int64_t bg = begin; bg < end; bg++) {
            const int64_t b = bg / G, g = bg % G;
            for (int64_t slot = 0; slot < 2; slot++)
                for (int64_t w = 0; w < W; w++)
                    for (int64_t m = 0; m < M; m++) {
                        const int64_t row = (slot * W + w) * M + m;
                        const float *src = qtp + b * qts[0] + g * qts[2] + slot * qts[3] + w * qts[4] + m * qts[5];
                        for (int64_t t = 0; t < T; t++) qt[row * T + t] = src[t * qts[1]];
                        if (ktp) {
                            const float *ksrc = ktp + b * kts[0] + g * kts[2] + slot * kts[3] + w * kts[4] + m * kts[5];
                            for (int64_t j = 0; j < S; j++) kt[row * S + j] = ksrc[j * kts[1]];
                        }
                    }
            for (int64_t m = 0; m < M; m++) {  /* the raw q.k products, VL lanes at a time */
                const int64_t n = g * M + m;
                for (int64_t t = 0; t < T; t++) {
                    const float *q = qp + b * qs[0] + n * qs[1] + t * qs[2];
                    float *row = scores.data() + (m * T + t) * S;
                    for (int64_t j = 0; j < S; j++) {
                        const float *k = kp + b * ks[0] + (n / rep) * ks[1] + j * ks[2];
                        vf acc = vf{};
                        int64_t d = 0;
                        for (; d + VL <= Dh; d += VL) acc += loadv(q + d) * loadv(k + d);
                        float sum = 0.0f;
                        for (; d < Dh; d++) sum += q[d] * k[d];
                        for (int l = 0; l < VL; l++) sum += acc[l];
                        row[j] = sum;
                    }
                }
            }
            dcmha_tile(scores.data(), contiguous_layout(M, T, S), 1, (int)M, (int)T, (int)S, (int)I, qt.data(), T, 0,
                       ktp ? kt.data() : nullptr, S,
                       0, pad ? pad + b * S : nullptr, 0, query_pos0, key_pos0, window, (float)scale, 0, 0, (int)T);
            for (int64_t m = 0; m < M; m++) {  /* the probabilities times the values */
                const int64_t n = g * M + m;
                for (int64_t t = 0; t < T; t++) {
                    const float *p = scores.data() + (m * T + t) * S;
                    float *o = op + ((b * T + t) * N + n) * Dh;
                    for (int64_t d = 0; d < Dh; d++) o[d] = 0.0f;
                    for (int64_t j = 0; j < S; j++) {
                        const float pj = p[j], *v = vp + b * vs[0] + (n / rep) * vs[1] + j * vs[2];
                        if (pj != 0.0f)
                            for (int64_t d = 0; d < Dh; d++) o[d] += pj * v[d];
                    }
                }
            }
        }
    };
    if (parallel)
        at::parallel_for(0, B * G, 1, run);
    else
        run(0, B * G);
    return out;
}

/* dcformer::vector_width: the floats Compose works on at once in this build (VL: 16 with AVX-512, else 8) */
static int64_t vector_width() { return VL; }
/* dcformer::block_stride: STRIDE, the head stagger (modulo 4 KiB) at which the forward operator composes the scores
   in place; dcmha_cpu.HEAD_STAGGER lays the model's scores out so, and a test holds the two equal */
static int64_t block_stride() { return STRIDE; }

TORCH_LIBRARY(dcformer, m) {
    m.def("vector_width() -> int", &vector_width);
    m.def("block_stride() -> int", &block_stride);
    m.def("compose_softmax_compose_(Tensor(a!) scores, Tensor query_terms, int t0, Tensor? key_terms, int s0, "
          "Tensor? key_padding_mask, int query_pos0, int key_pos0, int window, float scale, int rank, "
          "int num_groups, int rows, bool parallel) -> ()");
    m.def("compose_softmax_compose_backward_(Tensor(a!) raw, Tensor(b!) grad, Tensor query_terms, int t0, "
          "Tensor? key_terms, int s0, Tensor? key_padding_mask, int query_pos0, int key_pos0, int window, "
          "float scale, int rank, int num_groups, Tensor(c!) query_terms_grad, Tensor(d!)? key_terms_grad, "
          "bool parallel) -> ()");
    m.def("dynamic_terms(Tensor x, Tensor dw1, Tensor dd, Tensor qkw, int rank, float eps, bool parallel) -> Tensor");
    m.def("dcmha_decode(Tensor query, Tensor key, Tensor value, Tensor query_terms, Tensor? key_terms, "
          "Tensor? key_padding_mask, int query_pos0, int key_pos0, int window, float scale, int rank, "
          "int num_groups, bool parallel) -> Tensor");
}

TORCH_LIBRARY_IMPL(dcformer, CPU, m) {
    m.impl("compose_softmax_compose_", compose_softmax_compose_);
    m.impl("compose_softmax_compose_backward_", compose_softmax_compose_backward_);
    m.impl("dynamic_terms", dynamic_terms);
    m.impl("dcmha_decode", dcmha_decode);
}
