/* A decode step of a Llama-style model on a CPU, in one call (labsupport.cpu_decode): one to
 * max_batch sequences, each decoding one token.
 *
 * Decode reads every weight once per step, so a step of one sequence is bound by the weights' bytes
 * over the rate the machine reads that many bytes (chapter 13; from memory, or from the last-level
 * cache where the weights fit in it). Through torch, a step of the course's small model also
 * runs thousands of small operators, each a dispatch from Python, that cost about as much as the
 * matrix products (bench_cpu_engine's step profile). This file is the same forward pass written
 * as one function: the weights are read by loops over vectors (float32, bfloat16 or weight-only
 * int8 with one scale per output row), each weight read once for every sequence of the step,
 * everything else is a few loops over vectors of the model's width, and the threads split each
 * matrix's rows and attention's chunks of positions, head by head. It is what CUDA graphs are to a
 * GPU step (one launch instead of hundreds).
 *
 * Every activation is float32 (the residual stream, the norms, attention's sums); only the
 * weights and the paged KV cache keep their own type (the cache: float32 or bfloat16, rounded to
 * nearest even as torch rounds), and a product with int8 weights first rounds its input to int16
 * codes with one scale per input row, so that it sums integers exactly (the note on int8 rows below).
 * The arithmetic is the model's (labsupport.transformer): RMSNorm, rotary embedding in the halves
 * layout from a cos/sin table, grouped-query attention over the paged cache (the softmax taken in
 * chunks and combined online: a running maximum and sum, Milakov and Gimelshein's online softmax as
 * FlashAttention uses it), SwiGLU (its exponential from a polynomial, exp8), a final norm and the
 * output head. -O3 lets the compiler fuse multiplies and adds (FMA) where the CPU has them: float32
 * logits equal torch's up to the order and rounding of the sums, which can differ a little from
 * machine to machine (and between a step of one sequence and a step of several, whose products sum
 * in another order). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>
#if defined(__AVX__)
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
            threads, max_batch;
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

typedef struct {                 /* n sequences, each decoding one token */
    int64_t n, table_width, parts_floats;
    const int64_t *tokens;           /* (n,): the tokens computed */
    const int64_t *positions;        /* (n,): their positions (sequence b then holds positions[b] + 1) */
    const int32_t *block_tables;     /* (n, table_width): each sequence's blocks, logical block 0 first */
    float *logits;                   /* (n, vocab) out */
    float *parts;                    /* attention's partial results: parts_floats floats, at least
                                        (sum over sequences of positions[b] / CHUNK + 1) * n_heads * (head_dim + 2) */
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

/* Matrix times vector, four rows at a time: each load of x serves four rows of weights (four
 * streams from memory at once), and each row keeps its own partial sums in a vector register. GCC's
 * vector extensions, 256 bits wide (AVX2 instructions where -march=native has them; other CPUs get
 * the compiler's own lowering), and VW wide for bfloat16 rows and the batched products below (512
 * bits where the CPU has AVX-512).
 * Every weight matrix has a multiple of 8 columns (cpu_decode.unsupported checks). */
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load_f32(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline v8f load_bf16(const uint16_t *p) {  /* bfloat16 is float32's upper half */
#if defined(__AVX2__)  /* GCC 12 lowers the generic widening below to two halves and an insert: say it in x86's words */
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}
static inline float sum8(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
static inline v8f select8(v8i mask, v8f a, v8f b) {  /* a where mask is set (-1), else b */
    v8i ai, bi, r;
    memcpy(&ai, &a, sizeof ai), memcpy(&bi, &b, sizeof bi);
    r = (ai & mask) | (bi & ~mask);
    memcpy(&a, &r, sizeof a);
    return a;
}

/* Wider vectors where the CPU has AVX-512: VW floats (16; else 8), and BB, the inputs whose sums the
 * batched products below hold in registers. */
#if defined(__AVX512F__)
#define VW 16
#define BB 6  /* 4 x 6 sums + 4 weights + 1 input: 29 of AVX-512's 32 registers */
typedef float vf __attribute__((vector_size(64)));
static inline vf loadw_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf loadw_bf16(const uint16_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline float sumw(vf v) {
    v8f lo, hi;
    memcpy(&lo, &v, sizeof lo), memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return sum8(lo + hi);
}
#else
#define VW 8
#define BB 2  /* 4 x 2 sums + 4 weights + 1 input: 13 of AVX2's 16 registers */
typedef v8f vf;
#define loadw_f32 load_f32
#define loadw_bf16 load_bf16
#define sumw sum8
#endif

/* y[r] = W[r] . x for rows lo .. hi-1 of W (n columns), four rows per pass. While it reads a pass's
 * four rows it asks for the rows AHEAD passes on (__builtin_prefetch, the cache lines holding a later
 * pass's 4 x WIDTH elements at each step, so a pass covers the 4n elements of a later one; only rows of
 * the thread's own share).
 * In a one-off microbenchmark while this was written (one core, 100,000 rows of 576, an AMD EPYC
 * with AVX2, 2026-12-06), the hardware's own prefetcher alone read int8 and bfloat16 rows at 7-8 GB/s
 * against 16 GB/s for float32, and 12-17 GB/s with this (int8 rows were then converted to float32 here;
 * the integer kernels below prefetch the same way). */
#define AHEAD 4
#define MATVEC(NAME, T, LOAD, V, WIDTH, LOADV, XLOADV, SUMV)                                  \
static void NAME(const T *W, int64_t n, const float *x, float *y, int64_t lo, int64_t hi) {    \
    int64_t r = lo, wide = n - n % WIDTH;  /* columns 0 .. wide-1 in WIDTH-wide steps, then 8 */ \
    const char *first = (const char *)(W + lo * n), *end = first + AHEAD * 4 * n * sizeof(T);  \
    for (const char *line = first; line < end; line += 64) __builtin_prefetch(line);  /* the first passes */ \
    for (; r + 4 <= hi; r += 4) {                                                              \
        const T *w0 = W + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;                     \
        V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                              \
        for (int64_t k = 0; k < wide; k += WIDTH) {                                            \
            V xv = XLOADV(x + k);                                                              \
            if (r + 4 * AHEAD < hi) {  /* only rows of this thread's share */                  \
                const char *later = (const char *)w0 + (AHEAD * 4 * n + 4 * k) * sizeof(T);   \
                for (int64_t c = 0; c < 4 * WIDTH * (int64_t)sizeof(T); c += 64) __builtin_prefetch(later + c); \
            }                                                                                  \
            a0 += LOADV(w0 + k) * xv;                                                          \
            a1 += LOADV(w1 + k) * xv;                                                          \
            a2 += LOADV(w2 + k) * xv;                                                          \
            a3 += LOADV(w3 + k) * xv;                                                          \
        }                                                                                      \
        float s0 = SUMV(a0), s1 = SUMV(a1), s2 = SUMV(a2), s3 = SUMV(a3);                      \
        if (wide < n) {  /* the last 8 columns */                                              \
            v8f xv = load_f32(x + wide);                                                       \
            s0 += sum8(LOAD(w0 + wide) * xv), s1 += sum8(LOAD(w1 + wide) * xv);               \
            s2 += sum8(LOAD(w2 + wide) * xv), s3 += sum8(LOAD(w3 + wide) * xv);               \
        }                                                                                      \
        y[r] = s0, y[r + 1] = s1, y[r + 2] = s2, y[r + 3] = s3;                                \
    }                                                                                          \
    for (; r < hi; r++) {                                                                      \
        v8f a = {0};                                                                           \
        for (int64_t k = 0; k < n; k += 8) a += LOAD(W + r * n + k) * load_f32(x + k);         \
        y[r] = sum8(a);                                                                        \
    }                                                                                          \
}
/* float32 rows 8 wide; bfloat16 rows VW wide (int8 rows: integer products, below). In interleaved timings
 * of the whole one-row step on an Intel Xeon VM with AVX-512 (2026-12-07), 512-bit bfloat16 conversions
 * took the bfloat16 step from 6.4 to 5.6-5.9 ms, while the same for float32 was no faster, so it keeps
 * 256 bits. */
MATVEC(matvec_f32, float, load_f32, v8f, 8, load_f32, load_f32, sum8)
MATVEC(matvec_bf16, uint16_t, load_bf16, vf, VW, loadw_bf16, loadw_f32, sumw)

/* The same product for B inputs at once (a step of several decodes): Y[b][r] = W[r] . X[b] for rows
 * lo .. hi-1. Each pass holds four rows of weights (converted to float32 once per group of inputs) and
 * BB inputs' sums in registers, so every weight read from memory serves every input: at 16 inputs the
 * product is no longer bound by the bytes (on the course's Xeon VM, 2026-12-07, a 16-sequence float32
 * step of SmolLM2 took 41-43 ms, about 100 GFLOP/s, where reading its 538 MB takes about 15 ms), and the
 * wider vectors of AVX-512 (VW = 16) count. A short last pass or group repeats a row or an input whose sums it drops. x: (B, xs), y: (B, ys). */
#define MATMUL(NAME, T, LOAD, LOADW)                                                            \
static void NAME(const T *W, int64_t n, const float *x, int64_t xs, int64_t B, float *y, int64_t ys, \
                 int64_t lo, int64_t hi) {                                                      \
    int64_t wide = n - n % VW;  /* columns 0 .. wide-1 in VW-wide steps, then 8 */              \
    for (int64_t r = lo; r < hi; r += 4) {                                                      \
        const T *w[4];                                                                          \
        for (int j = 0; j < 4; j++) w[j] = W + (r + j < hi ? r + j : r) * n;                    \
        for (int64_t b0 = 0; b0 < B; b0 += BB) {                                                \
            const float *xb[BB];                                                                \
            for (int i = 0; i < BB; i++) xb[i] = x + (b0 + i < B ? b0 + i : b0) * xs;           \
            vf acc[4][BB];                                                                      \
            for (int j = 0; j < 4; j++)                                                         \
                for (int i = 0; i < BB; i++) acc[j][i] = (vf){0};                               \
            for (int64_t k = 0; k < wide; k += VW) {                                            \
                if (b0 == 0 && r + 4 * AHEAD < hi) {  /* the rows AHEAD passes on, once */      \
                    const char *later = (const char *)w[0] + (AHEAD * 4 * n + 4 * k) * sizeof(T); \
                    for (int64_t c = 0; c < 4 * VW * (int64_t)sizeof(T); c += 64) __builtin_prefetch(later + c); \
                }                                                                               \
                vf wv[4];                                                                       \
                for (int j = 0; j < 4; j++) wv[j] = LOADW(w[j] + k);                            \
                for (int i = 0; i < BB; i++) {                                                  \
                    vf xv = loadw_f32(xb[i] + k);                                               \
                    for (int j = 0; j < 4; j++) acc[j][i] += wv[j] * xv;                        \
                }                                                                               \
            }                                                                                   \
            for (int j = 0; j < 4 && r + j < hi; j++)                                           \
                for (int i = 0; i < BB && b0 + i < B; i++) {                                    \
                    float sum = sumw(acc[j][i]);                                                \
                    if (wide < n) sum += sum8(LOAD(w[j] + wide) * load_f32(xb[i] + wide));      \
                    y[(b0 + i) * ys + r + j] = sum;                                             \
                }                                                                               \
        }                                                                                       \
    }                                                                                           \
}
MATMUL(matmul_f32, float, load_f32, loadw_f32)
MATMUL(matmul_bf16, uint16_t, load_bf16, loadw_bf16)

/* Int8 rows: integer dot products. Each input row x is first rounded to nearest int16 codes with its own
 * scale, x ~ sx q with |q| <= 32767 (sx = max |x| / 32767): an activation's rounding error is at most
 * 1/65534 of its row's largest |x|, whatever the width, far below the weights' own (half a code in 127).
 * Then y[r] = sx * sum(code * q) (times the row's scale, after), the sum taken in integers: each vector
 * lane adds products of at most 128 * 32767 in int32 over a block of at most BLOCK columns (at most 256
 * products a lane, under 2^31), and the blocks' lanes are added in int64. The sums are exact, so in any
 * order (one sequence or a batch, AVX-512, AVX2 or plain C) the products have the same bits. Per 32
 * weights (16 with AVX2) one instruction widens the codes to int16 and one multiplies them by as many
 * activations and adds the products in pairs into 16 (8) int32 sums: vpdpwssd with AVX512-VNNI or
 * AVX-VNNI, vpmaddwd and vpaddd without. Converting the codes to float32 instead took a widening, a
 * conversion and a multiply-add per 8 weights, and those conversions held int8 rows back (about 46 GB/s
 * from L2 against 153 for float32 rows, in a one-off microbenchmark on the course's Xeon VM, 2026-12-07;
 * in interleaved timings there of the whole one-row int8 step at positions 64 to 192, before the other
 * changes of that day, 3.3 ms with conversions and 2.9 ms with the first integer kernel).
 * IW: int16 lanes per vector. */
#define BLOCK 2048
#if defined(__AVX512BW__)
#define IW 32
typedef __m512i vi;
static inline vi izero(void) { return _mm512_setzero_si512(); }
static inline vi load_codes(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi load_q(const int16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi idot(vi acc, vi a, vi b) {  /* acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] */
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
static inline int64_t isum(vi v) {  /* the lanes' sum, in int64 */
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}
#elif defined(__AVX2__)
#define IW 16
typedef __m256i vi;
static inline vi izero(void) { return _mm256_setzero_si256(); }
static inline vi load_codes(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vi load_q(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi idot(vi acc, vi a, vi b) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
static inline int64_t isum(vi v) {
    __m256i w = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                 _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}
#else
#define IW 8
typedef v8i vi;
typedef int16_t v8s __attribute__((vector_size(16)));
static inline vi izero(void) { return (vi){0}; }
static inline vi load_codes(const int8_t *p) { v8b b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, v8i); }
static inline vi load_q(const int16_t *p) { v8s s; memcpy(&s, p, sizeof s); return __builtin_convertvector(s, v8i); }
static inline vi idot(vi acc, vi a, vi b) { return acc + a * b; }
static inline int64_t isum(vi v) {
    int64_t s = 0;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}
#endif

/* x (n floats) as int16 codes q, x ~ s q with |q| <= 32767; returns s: 0 for a row of zeros, NaN when x
 * holds a NaN or an infinity (so that the products do too, as float products would). The codes follow the
 * thread's rounding mode (to nearest unless a program changed it). A row whose largest |x| is below about
 * 1e-33 gets a subnormal s (fewer bits), below about 2e-41 an s of 0: zeros for its products. */
static float quantize_row(const float *x, int64_t n, int16_t *q) {  /* n: a multiple of 8 */
    v8f big8 = {0};
    v8i bad8 = {0};
    for (int64_t i = 0; i < n; i += 8) {
        v8i bits;
        v8f v = load_f32(x + i), a;
        memcpy(&bits, &v, sizeof bits);
        bits &= 0x7fffffff;  /* |v| */
        memcpy(&a, &bits, sizeof a);
        big8 = select8(a > big8, a, big8);
        bad8 |= ~(a < INFINITY);  /* NaN or infinity */
    }
    float big = 0;
    int bad = 0;
    for (int i = 0; i < 8; i++) big = big8[i] > big ? big8[i] : big, bad |= bad8[i];
    if (bad || big == 0) {
        memset(q, 0, (size_t)n * sizeof *q);
        return bad ? NAN : 0.0f;
    }
    /* 32767 / big overflows for rows below about 1e-34: scale those by 2^64 first (exact, a power of two) */
    float k = big < 0x1p-60f ? 0x1p64f : 1.0f, inv = 32767.0f / (big * k);
    for (int64_t i = 0; i < n; i++)  /* |x k inv| <= 32767 (1 + 2^-24)^2 < 32767.5, so |q| <= 32767; no add */
        q[i] = (int16_t)nearbyintf((x[i] * k) * inv);  /* to fuse with a multiply: the same codes with or without FMA */
    return big / 32767.0f;
}

/* sum(w[k] q[k]) for k in lo .. hi-1: the fewer than IW columns past the last whole vector */
static inline int64_t tail_dot(const int8_t *w, const int16_t *q, int64_t lo, int64_t hi) {
    int32_t s = 0;
    for (int64_t k = lo; k < hi; k++) s += (int32_t)w[k] * q[k];
    return s;
}

/* y[r] = s (W[r] . q) for rows lo .. hi-1, four rows a pass, prefetching AHEAD passes on as MATVEC does;
 * the int32 lanes added into int64 every BLOCK columns. */
static void matvec_i8(const int8_t *W, int64_t n, const int16_t *q, float s, float *y, int64_t lo, int64_t hi) {
    int64_t r = lo, wide = n - n % IW;
    for (const int8_t *line = W + lo * n, *end = line + AHEAD * 4 * n; line < end; line += 64) __builtin_prefetch(line);
    for (; r + 4 <= hi; r += 4) {
        const int8_t *w0 = W + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        int64_t t0 = 0, t1 = 0, t2 = 0, t3 = 0;
        for (int64_t k0 = 0; k0 < wide; k0 += BLOCK) {
            vi a0 = izero(), a1 = izero(), a2 = izero(), a3 = izero();
            for (int64_t k = k0; k < wide && k < k0 + BLOCK; k += IW) {
                vi xv = load_q(q + k);
                if (r + 4 * AHEAD < hi)
                    for (int64_t c = 0; c < 4 * IW; c += 64) __builtin_prefetch(w0 + AHEAD * 4 * n + 4 * k + c);
                a0 = idot(a0, load_codes(w0 + k), xv);
                a1 = idot(a1, load_codes(w1 + k), xv);
                a2 = idot(a2, load_codes(w2 + k), xv);
                a3 = idot(a3, load_codes(w3 + k), xv);
            }
            t0 += isum(a0), t1 += isum(a1), t2 += isum(a2), t3 += isum(a3);
        }
        y[r] = s * (float)(t0 + tail_dot(w0, q, wide, n));
        y[r + 1] = s * (float)(t1 + tail_dot(w1, q, wide, n));
        y[r + 2] = s * (float)(t2 + tail_dot(w2, q, wide, n));
        y[r + 3] = s * (float)(t3 + tail_dot(w3, q, wide, n));
    }
    for (; r < hi; r++) {
        int64_t t = tail_dot(W + r * n, q, wide, n);
        for (int64_t k0 = 0; k0 < wide; k0 += BLOCK) {
            vi a = izero();
            for (int64_t k = k0; k < wide && k < k0 + BLOCK; k += IW) a = idot(a, load_codes(W + r * n + k), load_q(q + k));
            t += isum(a);
        }
        y[r] = s * (float)t;
    }
}

/* The same for B inputs at once, as MATMUL: four rows of codes widened once per group of BB inputs.
 * q: (B, n) codes, s: (B,) their scales, y: (B, ys). */
static void matmul_i8(const int8_t *W, int64_t n, const int16_t *q, const float *s, int64_t B, float *y, int64_t ys,
                      int64_t lo, int64_t hi) {
    int64_t wide = n - n % IW;
    for (int64_t r = lo; r < hi; r += 4) {
        const int8_t *w[4];
        for (int j = 0; j < 4; j++) w[j] = W + (r + j < hi ? r + j : r) * n;
        for (int64_t b0 = 0; b0 < B; b0 += BB) {
            const int16_t *qb[BB];
            for (int i = 0; i < BB; i++) qb[i] = q + (b0 + i < B ? b0 + i : b0) * n;
            int64_t t[4][BB] = {{0}};
            for (int64_t k0 = 0; k0 < wide; k0 += BLOCK) {
                vi acc[4][BB];
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < BB; i++) acc[j][i] = izero();
                for (int64_t k = k0; k < wide && k < k0 + BLOCK; k += IW) {
                    if (b0 == 0 && r + 4 * AHEAD < hi)
                        for (int64_t c = 0; c < 4 * IW; c += 64) __builtin_prefetch(w[0] + AHEAD * 4 * n + 4 * k + c);
                    vi wv[4];
                    for (int j = 0; j < 4; j++) wv[j] = load_codes(w[j] + k);
                    for (int i = 0; i < BB; i++) {
                        vi xv = load_q(qb[i] + k);
                        for (int j = 0; j < 4; j++) acc[j][i] = idot(acc[j][i], wv[j], xv);
                    }
                }
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < BB; i++) t[j][i] += isum(acc[j][i]);
            }
            for (int j = 0; j < 4 && r + j < hi; j++)
                for (int i = 0; i < BB && b0 + i < B; i++)
                    y[(b0 + i) * ys + r + j] = s[b0 + i] * (float)(t[j][i] + tail_dot(w[j], qb[i], wide, n));
        }
    }
}

/* o[r] *= v[r] (add: o[r] += v[r]) for r in lo .. hi-1, v float32 or bfloat16: a loop per type, which the
 * compiler vectorises. */
static void rows_apply(float *o, const void *v, int type, int64_t lo, int64_t hi, int add) {
    if (type == F32) {
        const float *f = v;
        if (add) for (int64_t r = lo; r < hi; r++) o[r] += f[r];
        else for (int64_t r = lo; r < hi; r++) o[r] *= f[r];
    } else {
        const uint16_t *h = v;
        if (add) for (int64_t r = lo; r < hi; r++) o[r] += bf16_to_f32(h[r]);
        else for (int64_t r = lo; r < hi; r++) o[r] *= bf16_to_f32(h[r]);
    }
}

/* This thread's share of n rows: a contiguous range, cut at multiples of 4. */
static void share(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), groups = (n + 3) / 4;
    *lo = groups * t / nt * 4;
    *hi = groups * (t + 1) / nt * 4;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

static inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }  /* floats to a whole 64 bytes */

/* Floats of scratch an int8 product of B inputs of n columns needs: the number of columns of the codes
 * it holds (0 for none) and B scales in the first 64 bytes' worth, then the (B, n) int16 codes. */
static int64_t scratch_floats(int64_t B, int64_t n) { return up16(1 + B) + (B * n + 1) / 2; }

/* This thread's share of Y = X m^T (+ bias), or of Y += X m^T (+ bias) with accumulate, for B rows
 * of X (stride xs) and of Y and tmp (stride ys); returns the share's rows of m through lo, hi. One
 * row: the one-row kernels above; more: the batched ones. Int8 rows first round X to int16 codes, kept
 * in the thread's scratch (scratch_floats) for the next product of the same X: fresh says X is new
 * (false only for k, v and up, which read the X of the product before them). */
static void matvec_share(const Matrix *m, const float *x, int64_t xs, int64_t B, float *y, int64_t ys, int accumulate,
                         float *tmp, float *scratch, int fresh, int64_t *lo_out, int64_t *hi_out) {
    int64_t lo, hi, n = m->cols;
    share(m->rows, &lo, &hi);
    float *out = accumulate ? tmp : y;
    int32_t held = 0;  /* the number of columns of the codes in scratch, 0 for none */
    if (fresh) memcpy(scratch, &held, sizeof held);  /* the codes held, if any, are another X's */
    if (m->type == I8) {
        float *scales = scratch + 1;
        int16_t *q = (int16_t *)(scratch + up16(1 + B));
        memcpy(&held, scratch, sizeof held);
        if (held != n) {
            for (int64_t b = 0; b < B; b++) scales[b] = quantize_row(x + b * xs, n, q + b * n);
            held = (int32_t)n;
            memcpy(scratch, &held, sizeof held);
        }
        if (B == 1) matvec_i8((const int8_t *)m->w, n, q, scales[0], out, lo, hi);
        else matmul_i8((const int8_t *)m->w, n, q, scales, B, out, ys, lo, hi);
    } else if (B == 1) {
        if (m->type == F32) matvec_f32((const float *)m->w, n, x, out, lo, hi);
        else matvec_bf16((const uint16_t *)m->w, n, x, out, lo, hi);
    } else {
        if (m->type == F32) matmul_f32((const float *)m->w, n, x, xs, B, out, ys, lo, hi);
        else matmul_bf16((const uint16_t *)m->w, n, x, xs, B, out, ys, lo, hi);
    }
    for (int64_t b = 0; b < B; b++) {  /* then the rows' scales, biases, and the sum into y: loops of one kind each */
        float *o = out + b * ys, *yb = y + b * ys;
        if (m->scale) rows_apply(o, m->scale, m->vec_type, lo, hi, 0);
        if (m->bias) rows_apply(o, m->bias, m->vec_type, lo, hi, 1);
        if (accumulate)
            for (int64_t r = lo; r < hi; r++) yb[r] += o[r];
    }
    if (lo_out) *lo_out = lo, *hi_out = hi;
}

static void rms_norm(const float *x, const void *weight, int type, float *out, int n, float eps) {  /* n: a multiple of 8 */
    v8f sq = {0};
    for (int i = 0; i < n; i += 8) sq += load_f32(x + i) * load_f32(x + i);
    float ss = sum8(sq);
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

/* Attention is split into work items that the threads share: one item is one sequence's chunk of
 * CHUNK consecutive positions (two of the engine's 16-position blocks) for one KV head and its group of
 * query heads, as Flash-Decoding splits a long context over a GPU's thread blocks. The items are dealt
 * round-robin (chunk by chunk, head by head), so the threads' shares differ by at most one item (and a
 * sequence's last chunk is short) whatever the number of chunks or of KV heads (3 on 2 threads for
 * SmolLM2; dealing whole chunks in two halves left one thread twice the other's positions at some
 * lengths). The chunks are fixed, not one per thread, so the arithmetic and its rounding do not depend
 * on the number of threads. */
#define CHUNK 32

/* Where one sequence's keys and values are: a layer's paged caches, the sequence's block table. */
typedef struct {
    const void *k_cache, *v_cache;  /* (num_blocks, block_size, Hkv, D) of type */
    const int32_t *table;           /* the sequence's blocks, logical block 0 first */
    int type, block_size, n_kv_heads, head_dim, group;  /* group: query heads per key/value head */
} Keys;

/* exp of 8 floats at once: e^x = 2^n e^r with n = round(x / ln 2) and |r| <= ln(2)/2, e^r from its
 * Taylor polynomial to degree 7 (relative error under 2e-7, about expf's), 2^n put into the exponent
 * bits. x below -87 gives 0 (as exp underflows), so e^(-inf) = 0 for a masked score. */
static inline v8f exp8(v8f x) {
    const v8f lo = (v8f){0} - 87.0f, hi = (v8f){0} + 88.0f, half = (v8f){0} + 0.5f;
    v8i under = x < lo;
    x = select8(under, lo, x);
    x = select8(x > hi, hi, x);
    v8f n = x * 1.44269504f;
    n = __builtin_convertvector(__builtin_convertvector(n + select8(n < 0, -half, half), v8i), v8f);  /* round */
    v8f r = x - n * 0.693145752f - n * 1.42860677e-6f;  /* ln 2 in two parts: r is exact to float's rounding */
    v8f p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
    v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8f two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return select8(under, (v8f){0}, p * two_n);
}

/* The sums of 8 vectors, as one vector: out[i] = sum8(a[i]). */
static inline v8f sum8x8(const v8f *a) {
#if defined(__AVX__)
    __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* 0-3 then 4-7, per 128-bit half */
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8f out;
    for (int i = 0; i < 8; i++) out[i] = sum8(a[i]);
    return out;
#endif
}

/* One item: for each query head g of kv's group, over positions t0 .. t1-1 (at most CHUNK) of the
 * paged cache, the scores s = q k / sqrt(D), their maximum m, l = sum exp(s - m) and the unnormalised
 * acc = sum exp(s - m) v, written to part (for each head of the group: m, l, then D floats). The
 * chunk's keys and values of head kv are first gathered from their blocks into float32 rows (each
 * converted once, not once per query head); scores are then taken eight positions at a time (eight
 * dot products summed across in one go), exponentials eight at a time, and each head's sum of values
 * 32 columns at a time in registers. D is a multiple of 8, at most 512; a group at most 16 heads. */
static void attend_chunk(const Keys *c, const float *q, int kv, int64_t t0, int64_t t1, float *part, float *rows) {
    int D = c->head_dim, G = c->group, Hkv = c->n_kv_heads, bs = c->block_size, type = c->type;
    int n = (int)(t1 - t0), blocks = (n + 7) / 8;
    float scale = 1.0f / sqrtf((float)D);
    float *keys = rows, *values = rows + CHUNK * D;  /* (blocks * 8, D) and (n, D): the thread's 2 CHUNK D */
    int64_t at[CHUNK];
    int esize = type == F32 ? 4 : 2;
    for (int i = 0; i < n; i++) {  /* where each position's key and value are; ask for them all first */
        int64_t t = t0 + i, slot = (int64_t)c->table[t / bs] * bs + t % bs;
        at[i] = (slot * Hkv + kv) * D;
        for (int64_t b = 0; b < (int64_t)D * esize; b += 64) {
            __builtin_prefetch((const char *)c->k_cache + at[i] * esize + b);
            __builtin_prefetch((const char *)c->v_cache + at[i] * esize + b);
        }
    }
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < D; j += 8) {
            v8f kv8 = cache_load(c->k_cache, type, at[i] + j), vv8 = cache_load(c->v_cache, type, at[i] + j);
            memcpy(keys + i * D + j, &kv8, sizeof kv8), memcpy(values + i * D + j, &vv8, sizeof vv8);
        }
    }
    memset(keys + n * D, 0, (size_t)(blocks * 8 - n) * D * sizeof(float));  /* their scores are set to -inf; no garbage read */
    v8f s[16][CHUNK / 8];  /* scores, then their exponentials; positions past n: -inf, then 0 */
    for (int g = 0; g < G; g++) {
        const float *qg = q + (int64_t)g * D;
        for (int b = 0; b < blocks; b++) {
            const float *kb = keys + b * 8 * D;
            v8f dots[8] = {{0}};
            for (int j = 0; j < D; j += 8) {
                v8f qv = load_f32(qg + j);
                for (int i = 0; i < 8; i++) dots[i] += qv * load_f32(kb + i * D + j);
            }
            v8f sc = sum8x8(dots) * scale;
            for (int i = n - 8 * b; i < 8; i++) sc[i] = -INFINITY;
            s[g][b] = sc;
        }
    }
    for (int g = 0; g < G; g++) {  /* s becomes exp(s - m) */
        v8f big = s[g][0];
        for (int b = 1; b < blocks; b++) big = select8(big > s[g][b], big, s[g][b]);
        float m = big[0];
        for (int i = 1; i < 8; i++) m = big[i] > m ? big[i] : m;
        v8f l = {0};
        for (int b = 0; b < blocks; b++) s[g][b] = exp8(s[g][b] - m), l += s[g][b];
        part[(int64_t)g * (D + 2)] = m, part[(int64_t)g * (D + 2) + 1] = sum8(l);
    }
    for (int g = 0; g < G; g++) {  /* acc = sum of p v, the values read from the float32 rows */
        float p[CHUNK], *out = part + (int64_t)g * (D + 2) + 2;
        memcpy(p, s[g], sizeof p);
        int j = 0;
        for (; j + 32 <= D; j += 32) {
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int i = 0; i < n; i++) {
                const float *v = values + i * D + j;
                v8f w = (v8f){0} + p[i];
                a0 += w * load_f32(v), a1 += w * load_f32(v + 8), a2 += w * load_f32(v + 16), a3 += w * load_f32(v + 24);
            }
            memcpy(out + j, &a0, sizeof a0), memcpy(out + j + 8, &a1, sizeof a1);
            memcpy(out + j + 16, &a2, sizeof a2), memcpy(out + j + 24, &a3, sizeof a3);
        }
        for (; j < D; j += 8) {
            v8f a = {0};
            for (int i = 0; i < n; i++) a += ((v8f){0} + p[i]) * load_f32(values + i * D + j);
            memcpy(out + j, &a, sizeof a);
        }
    }
}

/* Every query head's output from the items' partial results, chunk by chunk in order: the running
 * maximum and sum of the online softmax (Milakov and Gimelshein), what was summed so far rescaled
 * when the maximum grows. parts: (chunks, H, D + 2). */
static void attend_combine(const float *parts, int64_t chunks, int H, int D, float *out) {
    for (int hd = 0; hd < H; hd++) {
        float m = -INFINITY, l = 0, *o = out + (int64_t)hd * D;
        for (int i = 0; i < D; i++) o[i] = 0;
        for (int64_t c = 0; c < chunks; c++) {
            const float *p = parts + (c * H + hd) * (D + 2);
            float mc = p[0], big = mc > m ? mc : m, a = expf(m - big), b = expf(mc - big);
            for (int i = 0; i < D; i++) o[i] = o[i] * a + p[2 + i] * b;
            l = l * a + p[1] * b, m = big;
        }
        for (int i = 0; i < D; i++) o[i] /= l;
    }
}

/* a[i] = silu(a[i]) up[i] = a[i] / (1 + e^-a[i]) up[i] for i in lo .. hi-1, eight at a time (exp8; a short
 * last group padded), so each element's bits do not depend on where a thread's share starts. */
static void silu_times(float *a, const float *up, int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        v8f g = load_f32(a + i), y = g / (1.0f + exp8(-g)) * load_f32(up + i);
        memcpy(a + i, &y, sizeof y);
    }
    if (i < hi) {
        v8f g = {0}, u = {0};
        memcpy(&g, a + i, (hi - i) * sizeof(float)), memcpy(&u, up + i, (hi - i) * sizeof(float));
        v8f y = g / (1.0f + exp8(-g)) * u;
        memcpy(a + i, &y, (hi - i) * sizeof(float));
    }
}

/* Floats of workspace a step of up to max_batch sequences needs: shared, the residual x, a product
 * before it is added to x, q|k|v, the feed-forward's gate and up (each one row per sequence); then each
 * thread's share (thread_floats). Attention's partial results, which grow with the context, come with
 * each step (Step.parts). The workspace's start is taken to be 64-byte aligned (torch's allocations are). */
static int64_t shared_floats(const Model *M, int64_t B) {  /* x, tmp, qkv, gate and up: (B, ...) each */
    return up16(B * (2 * M->d + (int64_t)(M->n_heads + 2 * M->n_kv_heads) * M->head_dim + 2 * (int64_t)M->d_ff));
}

/* One thread's share for a step of B sequences, each part from a whole 64 bytes: its normed x (B, d), its
 * rotated queries and keys (B, (H + Hkv) D), attention's output (B, H D), an attention item's keys and
 * values as float32 (2 CHUNK D), and the int8 products' scratch for the widest input. */
static int64_t thread_floats(const Model *M, int64_t B) {
    int64_t d = M->d, D = M->head_dim, H = M->n_heads, Hkv = M->n_kv_heads, widest = d;
    widest = M->d_ff > widest ? M->d_ff : widest;
    widest = H * D > widest ? H * D : widest;
    return up16(B * d) + up16(B * (H + Hkv) * D) + up16(B * H * D) + 2 * CHUNK * D + scratch_floats(B, widest);
}

int64_t work_floats(const Model *M) {
    return shared_floats(M, M->max_batch) + M->threads * thread_floats(M, M->max_batch);
}

/* Positions per attention chunk (CHUNK): Step.parts holds (chunks, n_heads, head_dim + 2) floats per sequence. */
int64_t chunk_positions(void) { return CHUNK; }

/* 0 on success; 1 when a position is negative or past the cos/sin table, 3 when a block of a table up
 * to its position is not one of the cache's blocks, 2 when a head is wider than 512 or not a multiple
 * of 8, a group has more than 16 query heads, or the step has no sequence or more than max_batch, 4
 * when Step.parts is smaller than the step's chunks need.
 *
 * Each layer: every thread norms x itself (d floats a sequence: cheaper than waiting for one thread),
 * computes its rows of q, k and v for every sequence; after a barrier it rotates its own copy of every
 * query and key head, takes its attention items (the item holding a sequence's own position first writes
 * that position's key and value of its head to the cache: no other item reads them, since no two sequences
 * of a step write into one block: the engine copies a shared block before writing it); after a barrier it combines
 * the partial results and computes its rows of o att (added to x); after a barrier its rows of gate and
 * up (and silu(gate) * up, the same rows); after a barrier its rows of down a (added to x); a barrier.
 * Five per layer. */
int decode_step(const Model *M, const Step *S) {
    int d = M->d, D = M->head_dim, H = M->n_heads, Hkv = M->n_kv_heads, group = H / Hkv, bs = M->block_size;
    int64_t B = S->n, QKV = (int64_t)(H + 2 * Hkv) * D, F = M->d_ff;
    if (D > 512 || D % 8 || group > 16 || B < 1 || B > M->max_batch) return 2;
    int64_t first[B + 1], slot[B];  /* sequence b's attention items (chunks) are first[b] .. first[b+1]-1 */
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t pos = S->positions[b];
        const int32_t *table = S->block_tables + b * S->table_width;
        if (pos < 0 || pos >= M->rope_len || pos / bs >= S->table_width) return 1;
        for (int64_t j = 0; j <= pos / bs; j++)
            if (table[j] < 0 || table[j] >= M->num_blocks) return 3;
        slot[b] = (int64_t)table[pos / bs] * bs + pos % bs;
        first[b + 1] = first[b] + pos / CHUNK + 1;
    }
    int64_t chunk_floats = (int64_t)H * (D + 2);  /* one chunk's partial results: (H, D + 2) */
    if (first[B] * chunk_floats > S->parts_floats) return 4;
    float *x = M->work, *tmp = x + B * d, *qkv = tmp + B * d;        /* (B, d), (B, d), (B, (H + 2 Hkv) D) */
    float *a = qkv + B * QKV, *up = a + B * F;                       /* (B, d_ff), (B, d_ff) */
    float *own = M->work + shared_floats(M, B);                      /* then each thread's share */
    float *parts = S->parts;  /* sequence b's chunks: (chunks_b, H, D + 2) from first[b] * chunk_floats */

    for (int64_t b = 0; b < B; b++)
        for (int i = 0; i < d; i++) {
            int64_t at = S->tokens[b] * d + i;
            x[b * d + i] = M->embed_type == F32 ? ((const float *)M->embed)[at] : bf16_to_f32(((const uint16_t *)M->embed)[at]);
        }
    #pragma omp parallel num_threads(M->threads)
    {
        float *h = own + omp_get_thread_num() * thread_floats(M, B);  /* this thread's share: thread_floats */
        float *qr = h + up16(B * d), *att = qr + up16(B * (int64_t)(H + Hkv) * D);
        float *rows = att + up16(B * (int64_t)H * D), *scr = rows + 2 * CHUNK * D;
        int64_t QR = (int64_t)(H + Hkv) * D;
        for (int li = 0; li < M->n_layers; li++) {
            const Layer *L = &M->layers[li];
            for (int64_t b = 0; b < B; b++) rms_norm(x + b * d, L->attn_norm, M->norm_type, h + b * d, d, M->eps);
            /* q, k and v: each thread its share of each */
            matvec_share(&L->q, h, d, B, qkv, QKV, 0, NULL, scr, 1, NULL, NULL);
            matvec_share(&L->k, h, d, B, qkv + (int64_t)H * D, QKV, 0, NULL, scr, 0, NULL, NULL);
            matvec_share(&L->v, h, d, B, qkv + (int64_t)(H + Hkv) * D, QKV, 0, NULL, scr, 0, NULL, NULL);
            #pragma omp barrier
            for (int64_t b = 0; b < B; b++) {  /* queries, then keys (k follows q) */
                const float *cos = M->rope_cos + S->positions[b] * D, *sin = M->rope_sin + S->positions[b] * D;
                memcpy(qr + b * QR, qkv + b * QKV, (size_t)QR * sizeof(float));
                for (int hd = 0; hd < H + Hkv; hd++) rope(qr + b * QR + (int64_t)hd * D, cos, sin, D);
            }
            int64_t b = 0;  /* the sequence of this thread's current item */
            #pragma omp for schedule(static, 1)
            for (int64_t it = 0; it < first[B] * Hkv; it++) {  /* item: a sequence's chunk c of positions, KV head kv */
                int64_t ci = it / Hkv;
                int kv = (int)(it % Hkv);
                if (ci < first[b]) b = 0;  /* (OpenMP does not promise a thread its items in order) */
                while (ci >= first[b + 1]) b++;
                int64_t c = ci - first[b], pos = S->positions[b];
                int64_t t0 = c * CHUNK, t1 = t0 + CHUNK > pos + 1 ? pos + 1 : t0 + CHUNK;
                const float *kb = qr + b * QR + (int64_t)(H + kv) * D, *vb = qkv + b * QKV + (int64_t)(H + Hkv + kv) * D;
                if (t1 == pos + 1) {  /* the sequence's own key and value of head kv, read by this item only */
                    cache_store(L->k_cache, M->cache_type, (slot[b] * Hkv + kv) * D, kb, D);
                    cache_store(L->v_cache, M->cache_type, (slot[b] * Hkv + kv) * D, vb, D);
                }
                Keys keys = {L->k_cache, L->v_cache, S->block_tables + b * S->table_width, M->cache_type, bs, Hkv, D, group};
                attend_chunk(&keys, qr + b * QR + (int64_t)kv * group * D, kv, t0, t1,
                             parts + (first[b] + c) * chunk_floats + (int64_t)kv * group * (D + 2), rows);
            }  /* (the end of an omp for is a barrier) */
            for (int64_t s = 0; s < B; s++)
                attend_combine(parts + first[s] * chunk_floats, first[s + 1] - first[s], H, D, att + s * (int64_t)H * D);
            matvec_share(&L->o, att, (int64_t)H * D, B, x, d, 1, tmp, scr, 1, NULL, NULL);  /* x += o att */
            #pragma omp barrier
            for (int64_t s = 0; s < B; s++) rms_norm(x + s * d, L->ffn_norm, M->norm_type, h + s * d, d, M->eps);
            /* gate and up: the same rows of each in one thread, so silu(gate) * up needs no barrier */
            int64_t lo, hi;
            matvec_share(&L->gate, h, d, B, a, F, 0, NULL, scr, 1, &lo, &hi);
            matvec_share(&L->up, h, d, B, up, F, 0, NULL, scr, 0, NULL, NULL);
            for (int64_t s = 0; s < B; s++)
                silu_times(a + s * F, up + s * F, lo, hi);
            #pragma omp barrier
            matvec_share(&L->down, a, F, B, x, d, 1, tmp, scr, 1, NULL, NULL);  /* x += down a */
            #pragma omp barrier
        }
        for (int64_t s = 0; s < B; s++) rms_norm(x + s * d, M->final_norm, M->norm_type, h + s * d, d, M->eps);
        matvec_share(&M->head, h, d, B, S->logits, M->vocab, 0, NULL, scr, 1, NULL, NULL);
    }
    return 0;
}

/* The sum of n floats (a multiple of 64), read by `threads` threads, each a contiguous share, eight
 * vectors per pass and the cache lines 8 KiB ahead asked for: the fastest plain read this file knows
 * how to write, which the bench times to set each format's bound (labsupport.bench_cpu_engine). In a
 * one-off test while this was written (Intel Xeon, 300 MiB L3, 2 threads, 2026-12-07) it read 269 MB
 * at 62 GB/s where torch.sum, which leaves prefetching to the hardware, read 33, and this loop
 * prefetching 2 KiB ahead 42; the bench's run the same morning read that size at 37-44 GB/s (the
 * share of a virtual machine's L3 that holds the buffer varies). */
float read_floats(const float *x, int64_t n, int threads) {
    float total = 0;
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), passes = n / 64;
        int64_t lo = passes * t / nt * 64, hi = passes * (t + 1) / nt * 64;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (int64_t i = lo; i < hi; i += 64) {
            const char *later = (const char *)(x + i) + 8192;
            if (i + 2048 < hi)
                for (int j = 0; j < 4; j++) __builtin_prefetch(later + 64 * j);
            a0 += load_f32(x + i), a1 += load_f32(x + i + 8), a2 += load_f32(x + i + 16), a3 += load_f32(x + i + 24);
            a4 += load_f32(x + i + 32), a5 += load_f32(x + i + 40), a6 += load_f32(x + i + 48), a7 += load_f32(x + i + 56);
        }
        total += sum8(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)));
    }
    return total;
}

/* The int8 product as the step computes it, on one thread, for tests: y (B, rows) = sx (x's codes) W^T
 * before the rows' scales, x (B, cols), scratch int8_scratch_floats(B, cols) floats. One input runs the
 * one-row kernel, more the batched one. */
int64_t int8_scratch_floats(int64_t B, int64_t cols) { return scratch_floats(B, cols); }

void int8_product(const int8_t *W, int64_t rows, int64_t cols, const float *x, int64_t B, float *y, float *scratch) {
    Matrix m = {W, NULL, NULL, rows, cols, I8, F32};
    matvec_share(&m, x, cols, B, y, rows, 0, NULL, scratch, 1, NULL, NULL);
}
