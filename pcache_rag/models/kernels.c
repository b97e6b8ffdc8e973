/* The fused decode step's CPU kernels (pcache_rag/models/kernels.py compiles and loads this).
 *
 * A decode step is one token: every linear layer is a matrix-vector product whose time is the
 * time to stream its weights, and attention reads each layer's cached keys and values once.
 * Measured on the 2-core AVX-512 machine this project runs on, over the embedded model's 121
 * decode matrices: oneDNN's prepacked bf16 19 GB/s, aten._weight_int8pack_mm 13 GB/s, fbgemm
 * dynamic int8 20 GB/s, torch.compile's generated reduction 24 GB/s; these loops 40 GB/s
 * (bf16), the machine's read bandwidth. Hence our own.
 *
 * Every function takes raw pointers to contiguous float32/bf16/int8 buffers; kernels.py checks
 * dtypes, shapes and contiguity before any call. Rows are split across the OpenMP threads
 * (libgomp: the same runtime torch loads, so one thread pool). Without AVX-512 the loops are
 * plain C, correct and slower.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a . b over K floats (K a multiple of 16 on the AVX-512 path). */
static inline float dot_f32(const float* a, const float* b, int64_t K) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
    return _mm512_reduce_add_ps(acc);
#else
    float acc = 0.f;
    for (int64_t k = 0; k < K; k++) acc += a[k] * b[k];
    return acc;
#endif
}

static inline float round_bf16(float f) {  /* to the nearest bfloat16, ties to even (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* The matrix-vector products: y[N] = W[N, K] . x[K] (+ bias[N]), added to y when ``add``
 * (a residual connection). K a multiple of 16; W row-major. The bf16 and int8 products round
 * W . x to bfloat16 before the bias, as torch's bf16 kernels return it. */
#define PC_STORE(y, n, v) y[n] = (add ? y[n] : 0.f) + (bias ? (v) + bias[n] : (v))

/* w . x for one bfloat16 row w. */
static inline float dot_bf16(const uint16_t* w, const float* x, int64_t K) {
    float acc = 0.f;
#ifdef __AVX512F__
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {  /* bf16 -> fp32 is a 16-bit shift */
        __m512i wi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + k))), 16);
        a = _mm512_fmadd_ps(_mm512_castsi512_ps(wi), _mm512_loadu_ps(x + k), a);
    }
    acc = _mm512_reduce_add_ps(a);
#else
    for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(w[k]) * x[k];
#endif
    return acc;
}

/* w . x for one int8 row w (unscaled). */
static inline float dot_int8(const int8_t* w, const float* x, int64_t K) {
#ifdef __AVX512F__
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k)))),
                            _mm512_loadu_ps(x + k), a);
    return _mm512_reduce_add_ps(a);
#else
    float acc = 0.f;
    for (int64_t k = 0; k < K; k++) acc += (float)w[k] * x[k];
    return acc;
#endif
}

/* x rounded to bfloat16 precision, as the batch path's torch kernels read it: into ``buf``
 * when K fits, else into a fresh allocation (the caller frees what differs from buf). */
static float* rounded(const float* x, int64_t K, float* buf, int64_t cap) {
    float* out = K <= cap ? buf : (float*)malloc(sizeof(float) * K);
    if (out) for (int64_t k = 0; k < K; k++) out[k] = round_bf16(x[k]);
    return out;
}
#define PC_ROUND_CAP 8192

/* W in bfloat16. */
void pc_gemv_bf16(const uint16_t* W, const float* x, float* y, const float* bias, int64_t N, int64_t K, int add) {
    float buf[PC_ROUND_CAP];
    float* xr = rounded(x, K, buf, PC_ROUND_CAP);
    if (!xr) return;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float v = round_bf16(dot_bf16(W + n * K, xr, K));
        PC_STORE(y, n, v);
    }
    if (xr != buf) free(xr);
}

/* W int8 with one scale a row: y[n] = (W[n] . x) * scale[n]. */
void pc_gemv_int8(const int8_t* W, const float* scale, const float* x, float* y, const float* bias, int64_t N,
                  int64_t K, int add) {
    float buf[PC_ROUND_CAP];
    float* xr = rounded(x, K, buf, PC_ROUND_CAP);
    if (!xr) return;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float v = round_bf16(dot_int8(W + n * K, xr, K) * scale[n]);
        PC_STORE(y, n, v);
    }
    if (xr != buf) free(xr);
}

/* W float32. */
void pc_gemv_f32(const float* W, const float* x, float* y, const float* bias, int64_t N, int64_t K, int add) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float acc = dot_f32(W + n * K, x, K);
        PC_STORE(y, n, acc);
    }
}

/* The matrix-matrix products of a decode step over several sequences: Y[M, N] = X[M, K] . W[N, K]^T
 * (+ bias), added to Y when ``add``. Each row of W is read from memory once for all M rows of X
 * (it stays in L1 while they pass), and every (m, n) is accumulated step for step as the
 * matrix-vector product above computes it, so a sequence decodes to the same bits alone or
 * batched. PC_MB rows of X share one pass over a row of W. */
#define PC_MB 8

/* dots_<fmt>(w, X, mb, K, out): out[i] = w . X[i] for the mb (<= PC_MB) rows of X, each summed
 * as dot_<fmt> sums it. The switch makes mb a constant in each copy of the loop, so the
 * accumulators stay in registers. */
#ifdef __AVX512F__
#define PC_DOTS_BODY(WLOAD, DOT)                                                                      \
    __m512 a[PC_MB];                                                                                  \
    for (int64_t i = 0; i < mb; i++) a[i] = _mm512_setzero_ps();                                      \
    for (int64_t k = 0; k < K; k += 16) {                                                             \
        __m512 wv = WLOAD;                                                                            \
        for (int64_t i = 0; i < mb; i++) a[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(X + i * K + k), a[i]); \
    }                                                                                                 \
    for (int64_t i = 0; i < mb; i++) out[i] = _mm512_reduce_add_ps(a[i]);
#else
#define PC_DOTS_BODY(WLOAD, DOT) for (int64_t i = 0; i < mb; i++) out[i] = DOT(w, X + i * K, K);
#endif
#define PC_DOTS(NAME, WT, WLOAD, DOT)                                                                 \
    static inline __attribute__((always_inline)) void NAME##_k(const WT* w, const float* X,          \
                                                               const int64_t mb, int64_t K, float* out) { \
        PC_DOTS_BODY(WLOAD, DOT)                                                                      \
    }                                                                                                 \
    static void NAME(const WT* w, const float* X, int64_t mb, int64_t K, float* out) {              \
        switch (mb) {                                                                                 \
            case 1: NAME##_k(w, X, 1, K, out); break;                                                 \
            case 2: NAME##_k(w, X, 2, K, out); break;                                                 \
            case 3: NAME##_k(w, X, 3, K, out); break;                                                 \
            case 4: NAME##_k(w, X, 4, K, out); break;                                                 \
            case 5: NAME##_k(w, X, 5, K, out); break;                                                 \
            case 6: NAME##_k(w, X, 6, K, out); break;                                                 \
            case 7: NAME##_k(w, X, 7, K, out); break;                                                 \
            default: NAME##_k(w, X, PC_MB, K, out); break;                                            \
        }                                                                                             \
    }

PC_DOTS(dots_f32, float, _mm512_loadu_ps(w + k), dot_f32)
/* bf16 -> fp32 is a 16-bit shift */
PC_DOTS(dots_bf16, uint16_t,
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + k))), 16)),
        dot_bf16)
PC_DOTS(dots_int8, int8_t, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k)))), dot_int8)

/* fmt 0: fp32 W; 1: bf16 W; 2: int8 W with one scale a row. The bf16 and int8 products read X
 * rounded to bfloat16 and round each product to bfloat16 before the bias, as pc_gemv_* do. */
static void gemm(int fmt, const void* W, const float* scale, const float* X, float* Y, const float* bias,
                 int64_t N, int64_t K, int64_t M, int add) {
    const float* xs = X;
    float* xr = NULL;
    if (fmt != 0) {
        xr = (float*)malloc(sizeof(float) * M * K);
        if (!xr) return;
        for (int64_t i = 0; i < M * K; i++) xr[i] = round_bf16(X[i]);
        xs = xr;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float d[PC_MB];
        for (int64_t m0 = 0; m0 < M; m0 += PC_MB) {
            int64_t mb = M - m0 < PC_MB ? M - m0 : PC_MB;
            if (fmt == 0) dots_f32((const float*)W + n * K, xs + m0 * K, mb, K, d);
            else if (fmt == 1) dots_bf16((const uint16_t*)W + n * K, xs + m0 * K, mb, K, d);
            else dots_int8((const int8_t*)W + n * K, xs + m0 * K, mb, K, d);
            for (int64_t i = 0; i < mb; i++) {
                float v = fmt == 0 ? d[i] : round_bf16(fmt == 1 ? d[i] : d[i] * scale[n]);
                float* y = Y + (m0 + i) * N;
                PC_STORE(y, n, v);
            }
        }
    }
    free(xr);
}

void pc_gemm_f32(const float* W, const float* X, float* Y, const float* bias, int64_t N, int64_t K, int64_t M,
                 int add) {
    gemm(0, W, NULL, X, Y, bias, N, K, M, add);
}

void pc_gemm_bf16(const uint16_t* W, const float* X, float* Y, const float* bias, int64_t N, int64_t K, int64_t M,
                  int add) {
    gemm(1, W, NULL, X, Y, bias, N, K, M, add);
}

void pc_gemm_int8(const int8_t* W, const float* scale, const float* X, float* Y, const float* bias, int64_t N,
                  int64_t K, int64_t M, int add) {
    gemm(2, W, scale, X, Y, bias, N, K, M, add);
}

/* Attention scores of one query token: s[h, g, j] = scale * q[h, g, :] . K[h, j, :] for the
 * G query heads g of each of the H key heads h (grouped-query attention: no head repeated),
 * keys j < n. q: (H, G, D); K: head h's rows start at K + h * head_stride, D floats a row;
 * s: (H, G, n). D a multiple of 16 and at most 256; G at most 16. */
void pc_scores(const float* q, const float* K, int64_t head_stride, float* s, int64_t H, int64_t G, int64_t D,
               int64_t n, float scale) {
    const int64_t B = 64;  /* keys a work item */
    const int64_t nb = (n + B - 1) / B;
    #pragma omp parallel for schedule(static)
    for (int64_t it = 0; it < H * nb; it++) {
        int64_t h = it / nb, j0 = (it % nb) * B, j1 = j0 + B < n ? j0 + B : n;
        const float* qh = q + h * G * D;
        for (int64_t j = j0; j < j1; j++) {
            const float* k = K + h * head_stride + j * D;
            for (int64_t g = 0; g < G; g++) s[(h * G + g) * n + j] = dot_f32(qh + g * D, k, D) * scale;
        }
    }
}

/* The attention output: out[h, g, :] = sum_j p[h, g, j] V[h, j, :] (p: softmaxed scores,
 * (H, G, n); V laid out as K in pc_scores; out: (H, G, D)). Each thread sums a contiguous
 * range of keys of every head into its own partial output, so V is read once, row by row;
 * the partials are added at the end. ``part``: scratch of threads * H * G * D floats. */
void pc_weighted_sum(const float* p, const float* V, int64_t head_stride, float* out, int64_t H, int64_t G,
                     int64_t D, int64_t n, float* part, int64_t threads) {
    int64_t HGD = H * G * D;
    memset(part, 0, sizeof(float) * threads * HGD);
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t j0 = n * t / nt, j1 = n * (t + 1) / nt;
        float* acc = part + t * HGD;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t j = j0; j < j1; j++) {
                const float* v = V + h * head_stride + j * D;
                for (int64_t g = 0; g < G; g++) {
                    float w = p[(h * G + g) * n + j];
                    float* a = acc + (h * G + g) * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += w * v[d];
                }
            }
        }
    }
    for (int64_t i = 0; i < HGD; i++) {
        float sum = 0.f;
        for (int64_t t = 0; t < threads; t++) sum += part[t * HGD + i];
        out[i] = sum;
    }
}

/* RoPE (the half-rotation convention) on one token's projections, and its key and value
 * written into the cache: qkv holds H query heads, then Hkv key heads, then Hkv value heads,
 * D floats each. q_out (H, D) <- rotated queries; the rotated keys and the values go to row
 * ``row`` of each head of K and V (laid out as in pc_scores). cos, sin: (D/2,). */
void pc_rope_write(const float* qkv, const float* cos_, const float* sin_, int64_t H, int64_t Hkv, int64_t D,
                   float* q_out, float* K, float* V, int64_t head_stride, int64_t row) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < H + Hkv; i++) {
        const float* x = qkv + i * D;
        float* y = i < H ? q_out + i * D : K + (i - H) * head_stride + row * D;
        for (int64_t d = 0; d < half; d++) {
            float lo = x[d], hi = x[d + half];
            y[d] = lo * cos_[d] - hi * sin_[d];
            y[d + half] = hi * cos_[d] + lo * sin_[d];
        }
    }
    for (int64_t i = 0; i < Hkv; i++) memcpy(V + i * head_stride + row * D, qkv + (H + Hkv + i) * D, D * sizeof(float));
}

/* out[K] = x[K] / rms(x) * w[K] (RMSNorm, eps inside the root). */
void pc_rmsnorm(const float* x, const float* w, float* out, int64_t K, float eps) {
    double ss = 0.0;
    for (int64_t k = 0; k < K; k++) ss += (double)x[k] * x[k];
    float r = 1.0f / sqrtf((float)(ss / K) + eps);
    for (int64_t k = 0; k < K; k++) out[k] = x[k] * r * w[k];
}

/* out[I] = silu(gu[:I]) * gu[I:] (a SiLU-gated MLP's hidden layer). */
void pc_silu_mul(const float* gu, float* out, int64_t I) {
    for (int64_t i = 0; i < I; i++) {
        float g = gu[i];
        out[i] = g / (1.0f + expf(-g)) * gu[I + i];
    }
}
