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
