/* One batch-1 decode step of a Llama-style model on a CPU, in one call (labsupport.cpu_decode).
 *
 * Decode reads every weight once per token, so a step's floor is the weights' bytes over the
 * memory's read bandwidth (chapter 13). Through torch, a step of the course's small model also
 * runs thousands of small operators, each a dispatch from Python, that cost about as much as the
 * matrix products (bench_cpu_engine's step profile). This file is the same forward pass written
 * as one function: the weights are read by loops over 256-bit vectors (float32, bfloat16 or
 * weight-only int8 with one scale per output row), everything else is a few loops over vectors of
 * the model's width, and the threads split each matrix's rows. It is what CUDA graphs are to a GPU
 * step (one launch instead of hundreds).
 *
 * Every activation is float32 (the residual stream, the norms, attention's sums); only the
 * weights and the paged KV cache keep their own type (the cache: float32 or bfloat16, rounded to
 * nearest even as torch rounds). The arithmetic is the model's (labsupport.transformer):
 * RMSNorm, rotary embedding in the halves layout from a cos/sin table, grouped-query attention
 * over the paged cache (the softmax taken online: a running maximum and sum, Milakov and
 * Gimelshein's online softmax as FlashAttention uses it), SwiGLU, a final norm and the output head.
 * -O3 lets the compiler fuse multiplies and adds (FMA) where the CPU has them: float32 logits equal
 * torch's up to the order and rounding of the sums, which can differ a little from machine to machine. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, I8 = 2 };  /* a weight's or the cache's element type */

typedef struct {           /* rows x cols, row-major */
    const void *w;         /* float, uint16_t (bfloat16 bits) or int8_t */
    const void *scale;     /* I8: one per row (y = scale * sum(code * x)); otherwise NULL */
    const void *bias;      /* one per row, or NULL */
    int64_t rows, cols;
    int32_t type, vec_type;  /* the weights' element type; the scales' and the bias's (F32 or BF16) */
} Matrix;

typedef struct {
    const void *attn_norm, *ffn_norm;   /* (d,) of the model's norm_type */
    Matrix q, k, v, o;                  /* (H*D, d), (Hkv*D, d), (Hkv*D, d), (d, H*D) */
    Matrix gate, up, down;              /* (d_ff, d), (d_ff, d), (d, d_ff) */
    void *k_cache, *v_cache;            /* (num_blocks, block_size, Hkv, D), of cache_type */
} Layer;

typedef struct {
    int32_t n_layers, d, n_heads, n_kv_heads, head_dim, d_ff, vocab, block_size, num_blocks, cache_type, norm_type,
            threads;
    float eps;
    const void *embed;       /* (vocab, d) of embed_type */
    int32_t embed_type;
    const void *final_norm;  /* (d,) of norm_type */
    Matrix head;             /* (vocab, d) */
    const Layer *layers;
    const float *rope_cos, *rope_sin;  /* (rope_len, D): the model's table, float32 */
    int64_t rope_len;
    float *work;             /* at least work_floats(model) floats */
} Model;

typedef struct {
    int64_t token, position;     /* the token computed and its position (the sequence then holds position + 1) */
    const int32_t *block_table;  /* the sequence's blocks, logical block 0 first */
    float *logits;               /* (vocab,) out */
} Step;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float vec_at(const void *v, int type, int64_t i) {  /* one element of a float32 or bfloat16 vector */
    return type == F32 ? ((const float *)v)[i] : bf16_to_f32(((const uint16_t *)v)[i]);
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest, ties to even (NaN stays NaN) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Matrix times vector, four rows at a time: each 8-wide load of x serves four rows of weights
 * (four streams from memory at once), and each row keeps its own 8 partial sums in a vector
 * register. GCC's vector extensions, 256 bits wide whatever the CPU (AVX2 instructions where
 * -march=native has them; other CPUs get the compiler's own lowering).
 * Every weight matrix has a multiple of 8 columns (cpu_decode.unsupported checks). */
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load_f32(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline v8f load_bf16(const uint16_t *p) {  /* bfloat16 is float32's upper half */
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline v8f load_i8(const int8_t *p) {
#if defined(__AVX2__)  /* GCC 12 lowers the generic conversion below to scalar code: say it in x86's words */
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, v8i), v8f);
#endif
}
static inline float sum8(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* y[r] = W[r] . x for rows lo .. hi-1 of W (n columns), four rows per pass. While it reads a pass's
 * four rows it asks for the rows AHEAD passes on (__builtin_prefetch, two cache lines per step of 8
 * columns, so a pass covers the 4n elements of a later one; only rows of the thread's own share).
 * In a one-off microbenchmark while this was written (one core, 100,000 rows of 576, an AMD EPYC
 * with AVX2, 2026-12-06), the hardware's own prefetcher alone read int8 and bfloat16 rows at 7-8 GB/s
 * against 16 GB/s for float32, and 12-17 GB/s with this. */
#define AHEAD 4
#define MATVEC(NAME, T, LOAD)                                                                  \
static void NAME(const T *W, int64_t n, const float *x, float *y, int64_t lo, int64_t hi) {    \
    int64_t r = lo;                                                                            \
    const char *first = (const char *)(W + lo * n), *end = first + AHEAD * 4 * n * sizeof(T);  \
    for (const char *line = first; line < end; line += 64) __builtin_prefetch(line);  /* the first passes */ \
    for (; r + 4 <= hi; r += 4) {                                                              \
        const T *w0 = W + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;                     \
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                            \
        for (int64_t k = 0; k < n; k += 8) {                                                   \
            v8f xv = load_f32(x + k);                                                          \
            if (r + 4 * AHEAD < hi) {  /* only rows of this thread's share */                  \
                const char *later = (const char *)w0 + (AHEAD * 4 * n + 4 * k) * sizeof(T);   \
                __builtin_prefetch(later);                                                     \
                __builtin_prefetch(later + 64);                                                \
            }                                                                                  \
            a0 += LOAD(w0 + k) * xv;                                                           \
            a1 += LOAD(w1 + k) * xv;                                                           \
            a2 += LOAD(w2 + k) * xv;                                                           \
            a3 += LOAD(w3 + k) * xv;                                                           \
        }                                                                                      \
        y[r] = sum8(a0), y[r + 1] = sum8(a1), y[r + 2] = sum8(a2), y[r + 3] = sum8(a3);        \
    }                                                                                          \
    for (; r < hi; r++) {                                                                      \
        v8f a = {0};                                                                           \
        for (int64_t k = 0; k < n; k += 8) a += LOAD(W + r * n + k) * load_f32(x + k);         \
        y[r] = sum8(a);                                                                        \
    }                                                                                          \
}
MATVEC(matvec_f32, float, load_f32)
MATVEC(matvec_bf16, uint16_t, load_bf16)
MATVEC(matvec_i8, int8_t, load_i8)

/* This thread's share of n rows: a contiguous range, cut at multiples of 4. */
static void share(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), groups = (n + 3) / 4;
    *lo = groups * t / nt * 4;
    *hi = groups * (t + 1) / nt * 4;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* This thread's share of y = m x (+ bias), or of y += m x (+ bias) with accumulate; returns the
 * share's rows through lo, hi. */
static void matvec_share(const Matrix *m, const float *x, float *y, int accumulate, float *tmp,
                         int64_t *lo_out, int64_t *hi_out) {
    int64_t lo, hi;
    share(m->rows, &lo, &hi);
    float *out = accumulate ? tmp : y;
    if (m->type == F32) matvec_f32((const float *)m->w, m->cols, x, out, lo, hi);
    else if (m->type == BF16) matvec_bf16((const uint16_t *)m->w, m->cols, x, out, lo, hi);
    else matvec_i8((const int8_t *)m->w, m->cols, x, out, lo, hi);
    for (int64_t r = lo; r < hi; r++) {
        float v = out[r];
        if (m->scale) v *= vec_at(m->scale, m->vec_type, r);
        if (m->bias) v += vec_at(m->bias, m->vec_type, r);
        y[r] = accumulate ? y[r] + v : v;
    }
    if (lo_out) *lo_out = lo, *hi_out = hi;
}

static void rms_norm(const float *x, const void *weight, int type, float *out, int n, float eps) {
    float ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = (x[i] * inv) * vec_at(weight, type, i);
}

/* x (D,) rotated in place by the angles of one position: pairs (x[i], x[i + D/2]). */
static void rope(float *x, const float *cos, const float *sin, int D) {
    int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static inline v8f cache_load(const void *cache, int type, int64_t i) {  /* 8 elements of a cache, as float32 */
    return type == F32 ? load_f32((const float *)cache + i) : load_bf16((const uint16_t *)cache + i);
}

static void cache_store(void *cache, int type, int64_t at, const float *x, int n) {
    if (type == F32) memcpy((float *)cache + at, x, n * sizeof(float));
    else for (int i = 0; i < n; i++) ((uint16_t *)cache)[at + i] = f32_to_bf16(x[i]);
}

/* The query heads that share key/value head kv (GQA's group) over positions 0 .. len-1 of the paged
 * cache: softmax(q k / sqrt(D)) v for each, every key and value read once for the whole group (as
 * flash-decoding's kernels do for a group). The softmax is taken online: a running maximum m and sum l per
 * head, what was summed so far rescaled when m grows. Eight elements of a head at a time (D is a
 * multiple of 8, at most 512; a group at most 16 heads). */
static void attend_group(const Model *M, const Layer *L, const Step *S, const float *q, int kv, float *out) {
    int D = M->head_dim, V = D / 8, G = M->n_heads / M->n_kv_heads, Hkv = M->n_kv_heads;
    int bs = M->block_size, type = M->cache_type;
    float scale = 1.0f / sqrtf((float)D), m[16], l[16];
    v8f acc[16][64];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY, l[g] = 0;
        for (int j = 0; j < V; j++) acc[g][j] = (v8f){0};
    }
    for (int64_t t = 0; t <= S->position; t++) {
        int64_t slot = (int64_t)S->block_table[t / bs] * bs + t % bs;
        int64_t at = (slot * Hkv + kv) * D;  /* this position's key (and value) of head kv */
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * D;
            v8f dot = {0};
            for (int j = 0; j < V; j++) dot += load_f32(qg + 8 * j) * cache_load(L->k_cache, type, at + 8 * j);
            float s = sum8(dot) * scale;
            if (s > m[g]) {  /* a new maximum: what was summed so far shrinks by exp(m_old - m_new) */
                float shrink = expf(m[g] - s);
                l[g] *= shrink;
                for (int j = 0; j < V; j++) acc[g][j] *= shrink;
                m[g] = s;
            }
            float p = expf(s - m[g]);
            l[g] += p;
            for (int j = 0; j < V; j++) acc[g][j] += p * cache_load(L->v_cache, type, at + 8 * j);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < V; j++) {
            v8f o = acc[g][j] / l[g];
            memcpy(out + (int64_t)g * D + 8 * j, &o, sizeof o);
        }
}

static float silu(float g) { return g / (1.0f + expf(-g)); }

/* Floats of workspace a step needs: the residual x, the normed h, q|k|v, attention's output, the
 * feed-forward's gate and up, and a product before it is added to x. */
int64_t work_floats(const Model *M) {
    int64_t d = M->d, D = M->head_dim;
    return 3 * d + (M->n_heads + 2 * (int64_t)M->n_kv_heads) * D + M->n_heads * D + 2 * (int64_t)M->d_ff;
}

/* 0 on success; 1 when the position is negative or past the cos/sin table, 3 when a block of the
 * table up to the position is not one of the cache's blocks, 2 when a head is wider than 512 or
 * not a multiple of 8, or a group has more than 16 query heads. */
int decode_step(const Model *M, const Step *S) {
    int d = M->d, D = M->head_dim, H = M->n_heads, Hkv = M->n_kv_heads, group = H / Hkv;
    if (S->position < 0 || S->position >= M->rope_len) return 1;
    for (int64_t b = 0; b <= S->position / M->block_size; b++)
        if (S->block_table[b] < 0 || S->block_table[b] >= M->num_blocks) return 3;
    if (D > 512 || D % 8 || group > 16) return 2;
    float *x = M->work, *h = x + d, *qkv = h + d;           /* (d,), (d,), ((H + 2 Hkv) D,) */
    float *att = qkv + (int64_t)(H + 2 * Hkv) * D, *a = att + (int64_t)H * D;  /* (H D,), (d_ff,) */
    float *up = a + M->d_ff, *tmp = up + M->d_ff;                                /* (d_ff,), (d,) */
    float *q = qkv, *k = qkv + (int64_t)H * D, *v = k + (int64_t)Hkv * D;
    const float *cos = M->rope_cos + S->position * D, *sin = M->rope_sin + S->position * D;
    int64_t slot = (int64_t)S->block_table[S->position / M->block_size] * M->block_size
                   + S->position % M->block_size;

    for (int i = 0; i < d; i++) x[i] = M->embed_type == F32 ? ((const float *)M->embed)[S->token * d + i]
                                                              : bf16_to_f32(((const uint16_t *)M->embed)[S->token * d + i]);
    #pragma omp parallel num_threads(M->threads)
    {
        for (int li = 0; li < M->n_layers; li++) {
            const Layer *L = &M->layers[li];
            #pragma omp single
            rms_norm(x, L->attn_norm, M->norm_type, h, d, M->eps);
            /* q, k and v: each thread its share of each */
            matvec_share(&L->q, h, q, 0, NULL, NULL, NULL);
            matvec_share(&L->k, h, k, 0, NULL, NULL, NULL);
            matvec_share(&L->v, h, v, 0, NULL, NULL, NULL);
            #pragma omp barrier
            #pragma omp single
            {
                for (int hd = 0; hd < H + Hkv; hd++) rope(qkv + (int64_t)hd * D, cos, sin, D);  /* queries, then keys */
                cache_store(L->k_cache, M->cache_type, slot * Hkv * D, k, Hkv * D);
                cache_store(L->v_cache, M->cache_type, slot * Hkv * D, v, Hkv * D);
            }
            #pragma omp for schedule(static)
            for (int kv = 0; kv < Hkv; kv++)  /* query heads kv*group .. (kv+1)*group - 1 share key/value head kv */
                attend_group(M, L, S, q + (int64_t)kv * group * D, kv, att + (int64_t)kv * group * D);
            matvec_share(&L->o, att, x, 1, tmp, NULL, NULL);  /* x += o att */
            #pragma omp barrier
            #pragma omp single
            rms_norm(x, L->ffn_norm, M->norm_type, h, d, M->eps);
            /* gate and up: the same rows of each in one thread, so silu(gate) * up needs no barrier */
            int64_t lo, hi;
            matvec_share(&L->gate, h, a, 0, NULL, &lo, &hi);
            matvec_share(&L->up, h, up, 0, NULL, NULL, NULL);
            for (int64_t i = lo; i < hi; i++) a[i] = silu(a[i]) * up[i];
            #pragma omp barrier
            matvec_share(&L->down, a, x, 1, tmp, NULL, NULL);  /* x += down a */
            #pragma omp barrier
        }
        #pragma omp single
        rms_norm(x, M->final_norm, M->norm_type, h, d, M->eps);
        matvec_share(&M->head, h, S->logits, 0, NULL, NULL, NULL);
    }
    return 0;
}
