/* The fused decode step's CPU kernels (pcache_rag/models/kernels.py compiles and loads this).
 *
 * A decode step is one token: every linear layer is a matrix-vector product whose time is the
 * time to stream its weights, and attention reads each layer's cached keys and values once.
 * Measured on the 2-core AVX-512 machine this project runs on, over the embedded model's 121
 * decode matrices: oneDNN's prepacked bf16 19 GB/s, aten._weight_int8pack_mm 13 GB/s, fbgemm
 * dynamic int8 20 GB/s, torch.compile's generated reduction 24 GB/s; these loops 40 GB/s
 * (bf16), the machine's read bandwidth. Hence our own.
 *
 * One source, one variant per instruction set, picked at run time by kernels.py from what the
 * CPU reports (PC_AVX512, PC_AVX2 with FMA, PC_NEON, or none: portable C). Every variant sums
 * a dot product the same way: 16 lanes, lane i accumulating elements k = i (mod 16) with a
 * fused multiply-add, then the lanes added as a fixed tree (i + 8, i + 4, i + 2, i + 1). The
 * AVX-512 build holds the 16 lanes in one register, AVX2 in two, NEON in four, portable C in an
 * array with fmaf. So every variant computes the same bits (tested: the portable and AVX2
 * builds against the AVX-512 build on one machine; NEON under qemu), and a sequence decodes to
 * the same bits alone or batched, whatever the variant. Built with -ffp-contract=off so that
 * no compiler fuses the other loops' multiply-adds differently per instruction set.
 *
 * Threads: every parallel loop runs on pc_threads() threads (pc_set_threads: kernels.py fits it
 * to the CPUs that are free; pc_team gives a step's torch ops the same count) and splits its work in a way that does not depend on that count,
 * so the count changes speed, never a result. Rows of a product are independent; attention
 * sums its keys in fixed blocks (PC_KB), added in block order.
 *
 * Every function takes raw pointers to contiguous float32/bf16/int8 buffers; kernels.py checks
 * dtypes, shapes and contiguity before any call. libgomp is the OpenMP runtime torch loads, so
 * one thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(PC_AVX512) || defined(PC_AVX2)
#include <immintrin.h>
#elif defined(PC_NEON)
#include <arm_neon.h>
#endif

/* The variant this library was built as (kernels.py checks it against what it asked for). */
const char* pc_variant(void) {
#if defined(PC_AVX512)
    return "avx512";
#elif defined(PC_AVX2)
    return "avx2";
#elif defined(PC_NEON)
    return "neon";
#else
    return "portable";
#endif
}

static int pc_nthreads = 0; /* 0: the OpenMP default */

/* How many threads the parallel loops use from now on (0 or less: the OpenMP default). */
void pc_set_threads(int n) { __atomic_store_n(&pc_nthreads, n > 0 ? n : 0, __ATOMIC_RELAXED); }

/* Sets the calling thread's OpenMP team size to n (n > 0) and returns the size it had. torch's
 * own parallel loops read it (one libgomp in the process), so a step's torch ops (the softmax)
 * run on the kernels' count for the step's duration; the caller gives the old size back after
 * the step, because a prefill's products round differently on another count. */
int pc_team(int n) {
    int prev = omp_get_max_threads();
    if (n > 0) omp_set_num_threads(n);
    return prev;
}

static inline int pc_threads(void) {
    int n = __atomic_load_n(&pc_nthreads, __ATOMIC_RELAXED);
    return n > 0 ? n : omp_get_max_threads();
}

/* ---- 16 float lanes: v16 ------------------------------------------------------------------ */
#if defined(PC_AVX512)
typedef __m512 v16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_fma(v16 a, v16 b, v16 acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline v16 v16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline v16 v16_bf16(const uint16_t* p) { /* bf16 -> fp32 is a 16-bit shift */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline v16 v16_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m256 v16_fold8(v16 a) { /* lane i + lane i + 8 */
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#elif defined(PC_AVX2)
typedef struct { __m256 lo, hi; } v16; /* lanes 0-7, 8-15 */
static inline v16 v16_zero(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline v16 v16_fma(v16 a, v16 b, v16 acc) {
    v16 r = {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
    return r;
}
static inline v16 v16_f32(const float* p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline __m256 pc_bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline v16 v16_bf16(const uint16_t* p) { v16 r = {pc_bf16x8(p), pc_bf16x8(p + 8)}; return r; }
/* eight lanes of each format, for the batch tiles that take the lanes in two halves */
static inline __m256 v8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 v8_bf16(const uint16_t* p) { return pc_bf16x8(p); }
static inline __m256 v8_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline v16 v16_i8(const int8_t* p) {
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    v16 r = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
    return r;
}
static inline __m256 v16_fold8(v16 a) { return _mm256_add_ps(a.lo, a.hi); }
#elif defined(PC_NEON)
typedef struct { float32x4_t a, b, c, d; } v16; /* lanes 0-3, 4-7, 8-11, 12-15 */
static inline v16 v16_zero(void) { float32x4_t z = vdupq_n_f32(0.f); v16 r = {z, z, z, z}; return r; }
static inline v16 v16_fma(v16 x, v16 y, v16 acc) {
    v16 r = {vfmaq_f32(acc.a, x.a, y.a), vfmaq_f32(acc.b, x.b, y.b), vfmaq_f32(acc.c, x.c, y.c),
             vfmaq_f32(acc.d, x.d, y.d)};
    return r;
}
static inline v16 v16_f32(const float* p) { v16 r = {vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}; return r; }
static inline float32x4_t pc_bf16x4(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
static inline v16 v16_bf16(const uint16_t* p) {
    v16 r = {pc_bf16x4(p), pc_bf16x4(p + 4), pc_bf16x4(p + 8), pc_bf16x4(p + 12)};
    return r;
}
static inline v16 v16_i8(const int8_t* p) {
    int8x16_t b = vld1q_s8(p);
    int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
    v16 r = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
             vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))};
    return r;
}
#else
typedef struct { float l[16]; } v16;
static inline v16 v16_zero(void) { v16 r; for (int i = 0; i < 16; i++) r.l[i] = 0.f; return r; }
static inline v16 v16_fma(v16 a, v16 b, v16 acc) { for (int i = 0; i < 16; i++) acc.l[i] = fmaf(a.l[i], b.l[i], acc.l[i]); return acc; }
static inline v16 v16_f32(const float* p) { v16 r; memcpy(r.l, p, sizeof r.l); return r; }
static inline v16 v16_bf16(const uint16_t* p) {
    v16 r;
    for (int i = 0; i < 16; i++) { uint32_t u = (uint32_t)p[i] << 16; memcpy(&r.l[i], &u, 4); }
    return r;
}
static inline v16 v16_i8(const int8_t* p) { v16 r; for (int i = 0; i < 16; i++) r.l[i] = (float)p[i]; return r; }
#endif

/* The sum of the 16 lanes, as a fixed tree: t[i] = l[i] + l[i + 8]; u[i] = t[i] + t[i + 4];
 * v[i] = u[i] + u[i + 2]; v[0] + v[1]. Every variant adds in exactly this order. */
static inline float v16_sum(v16 a) {
#if defined(PC_AVX512) || defined(PC_AVX2)
    __m256 t = v16_fold8(a);
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
#elif defined(PC_NEON)
    float32x4_t u = vaddq_f32(vaddq_f32(a.a, a.c), vaddq_f32(a.b, a.d));
    float32x2_t v = vadd_f32(vget_low_f32(u), vget_high_f32(u));
    return vget_lane_f32(v, 0) + vget_lane_f32(v, 1);
#else
    float t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) t[i] = a.l[i] + a.l[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++) v[i] = u[i] + u[i + 2];
    return v[0] + v[1];
#endif
}

/* Multiply, add, broadcast and store of 16 lanes (attention's weighted sums: a multiply, then
 * an add, each rounded, as the portable loop computes a[d] += w * v[d]). */
#if defined(PC_AVX512)
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline void v16_st(float* p, v16 a) { _mm512_storeu_ps(p, a); }
#elif defined(PC_AVX2)
static inline v16 v16_mul(v16 a, v16 b) { v16 r = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; return r; }
static inline v16 v16_add(v16 a, v16 b) { v16 r = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; return r; }
static inline v16 v16_set1(float x) { v16 r = {_mm256_set1_ps(x), _mm256_set1_ps(x)}; return r; }
static inline void v16_st(float* p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
#elif defined(PC_NEON)
static inline v16 v16_mul(v16 x, v16 y) {
    v16 r = {vmulq_f32(x.a, y.a), vmulq_f32(x.b, y.b), vmulq_f32(x.c, y.c), vmulq_f32(x.d, y.d)};
    return r;
}
static inline v16 v16_add(v16 x, v16 y) {
    v16 r = {vaddq_f32(x.a, y.a), vaddq_f32(x.b, y.b), vaddq_f32(x.c, y.c), vaddq_f32(x.d, y.d)};
    return r;
}
static inline v16 v16_set1(float x) { float32x4_t a = vdupq_n_f32(x); v16 r = {a, a, a, a}; return r; }
static inline void v16_st(float* p, v16 x) { vst1q_f32(p, x.a); vst1q_f32(p + 4, x.b); vst1q_f32(p + 8, x.c); vst1q_f32(p + 12, x.d); }
#else
static inline v16 v16_mul(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.l[i] *= b.l[i]; return a; }
static inline v16 v16_add(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.l[i] += b.l[i]; return a; }
static inline v16 v16_set1(float x) { v16 r; for (int i = 0; i < 16; i++) r.l[i] = x; return r; }
static inline void v16_st(float* p, v16 a) { memcpy(p, a.l, sizeof a.l); }
#endif

static inline float round_bf16(float f) {  /* to the nearest bfloat16, ties to even (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* w . x over K floats (K a multiple of 16), summed as the header says (attention's scores);
 * tile_<fmt> below sums each of its products exactly so. */
#define PC_DOT(NAME, WT, WLOAD)                                                                       \
    static inline __attribute__((always_inline)) float NAME(const WT* w, const float* x, int64_t K) { \
        v16 acc = v16_zero();                                                                         \
        for (int64_t k = 0; k < K; k += 16) acc = v16_fma(WLOAD(w + k), v16_f32(x + k), acc);         \
        return v16_sum(acc);                                                                          \
    }
PC_DOT(dot_f32, float, v16_f32)

/* The products Y[M, N] = X[M, K] . W[N, K]^T (+ bias[N]), added to Y when ``add`` (a residual
 * connection); one token is M = 1. K a multiple of 16; W row-major. Every (m, n) is one dot
 * product summed as dot_f32 sums it (16 lanes, one chain each, the fixed tree), so a sequence
 * decodes to the same bits alone or batched, whatever the tile it fell in. The bf16 and int8
 * products read X rounded to bfloat16 and round W . x to bfloat16 before the bias, as torch's
 * bf16 kernels return it.
 *
 * They are computed in tiles of nb rows of W by mb rows of X, held in nb * mb accumulators:
 * each W vector loaded serves mb rows of X and each X vector nb rows of W, and the nb * mb
 * chains are independent, so a multiply-add does not wait on the one before it. With one
 * chain a row, one token's products were bound by the FMA's latency and a batch's by its
 * loads. The nb rows of a tile are far apart: each thread splits its rows into nb runs and
 * walks them side by side, so that W is read as nb long sequential streams, which the
 * hardware prefetcher follows. Tiles of nb adjacent rows, nb short streams, read W 2.4x
 * slower on this project's EPYC. PC_NB x PC_MB is what fits the registers; one token runs
 * PC_N1 rows a tile. The tiles change the order in which (m, n) are visited, never a sum. */
#if defined(PC_AVX512)
#define PC_NB 4 /* 32 registers: 16 accumulators, 4 of W, 1 of X */
#define PC_MB 4
#elif defined(PC_AVX2)
#define PC_NB 4 /* 16 registers: a batch tile takes lanes 0-7, then 8-15 (8 accumulators, 4 of W, 1 of X) */
#define PC_MB 2
#else
#define PC_NB 2 /* NEON: 32 registers, four a v16 */
#define PC_MB 2
#endif
#define PC_N1 4
#define PC_MAXT 4
#define PC_STORE(y, n, v) y[n] = (add ? y[n] : 0.f) + (bias ? (v) + bias[n] : (v))
#define PC_UNROLL _Pragma("GCC unroll 4")

/* tile_<fmt>(w, K, X, nb, mb, out): out[j * PC_MAXT + i] = w[j] . X[i] for the nb rows w[j] of W
 * and the mb rows of X at X (each K long). The switch makes nb and mb constants in each copy of
 * the loop, so the accumulators stay in registers. */
/* NAME##_h: the same tile for a batch (mb >= 2). On AVX2 it sums lanes 0-7 over all of K, then
 * lanes 8-15, each lane's chain in the same order as NAME##_k's: 8 registers of accumulators
 * a pass instead of 16, so a 4 x 2 tile fits the 16 registers (21% off an 8-row bf16 step's
 * products against a 2 x 2 tile of whole v16s); one token keeps NAME##_k (one pass over W). */
#if defined(PC_AVX2)
#define PC_HALVES(NAME, WT, WLOAD8)                                                                    \
    static inline __attribute__((always_inline)) void NAME##_h(const WT* const* w, int64_t K,        \
                                                               const float* X, const int nb,          \
                                                               const int mb, float* out) {            \
        __m256 r[2][PC_MAXT][PC_MAXT];                                                                  \
        for (int hf = 0; hf < 2; hf++) {                                                                \
            __m256 a[PC_MAXT][PC_MAXT];                                                                 \
            PC_UNROLL for (int j = 0; j < nb; j++)                                                      \
                PC_UNROLL for (int i = 0; i < mb; i++) a[j][i] = _mm256_setzero_ps();                   \
            for (int64_t k = 8 * hf; k < K; k += 16) {                                                  \
                __m256 wv[PC_MAXT];                                                                     \
                PC_UNROLL for (int j = 0; j < nb; j++) wv[j] = WLOAD8(w[j] + k);                        \
                PC_UNROLL for (int i = 0; i < mb; i++) {                                                \
                    __m256 xv = _mm256_loadu_ps(X + i * K + k);                                         \
                    PC_UNROLL for (int j = 0; j < nb; j++) a[j][i] = _mm256_fmadd_ps(wv[j], xv, a[j][i]); \
                }                                                                                       \
            }                                                                                           \
            PC_UNROLL for (int j = 0; j < nb; j++)                                                      \
                PC_UNROLL for (int i = 0; i < mb; i++) r[hf][j][i] = a[j][i];                           \
        }                                                                                               \
        PC_UNROLL for (int j = 0; j < nb; j++)                                                          \
            PC_UNROLL for (int i = 0; i < mb; i++) {                                                    \
                v16 t = {r[0][j][i], r[1][j][i]};                                                       \
                out[j * PC_MAXT + i] = v16_sum(t);                                                      \
            }                                                                                           \
    }
#else
#define PC_HALVES(NAME, WT, WLOAD8)                                                                    \
    static inline __attribute__((always_inline)) void NAME##_h(const WT* const* w, int64_t K,        \
                                                               const float* X, const int nb,          \
                                                               const int mb, float* out) {            \
        NAME##_k(w, K, X, nb, mb, out);                                                                 \
    }
#endif
#define PC_TILE(NAME, WT, WLOAD, WLOAD8)                                                                 \
    static inline __attribute__((always_inline)) void NAME##_k(const WT* const* w, int64_t K,        \
                                                               const float* X, const int nb,          \
                                                               const int mb, float* out) {            \
        v16 a[PC_MAXT][PC_MAXT];                                                                        \
        PC_UNROLL for (int j = 0; j < nb; j++)                                                          \
            PC_UNROLL for (int i = 0; i < mb; i++) a[j][i] = v16_zero();                                \
        for (int64_t k = 0; k < K; k += 16) {                                                           \
            v16 wv[PC_MAXT];                                                                            \
            PC_UNROLL for (int j = 0; j < nb; j++) wv[j] = WLOAD(w[j] + k);                             \
            PC_UNROLL for (int i = 0; i < mb; i++) {                                                    \
                v16 xv = v16_f32(X + i * K + k);                                                        \
                PC_UNROLL for (int j = 0; j < nb; j++) a[j][i] = v16_fma(wv[j], xv, a[j][i]);           \
            }                                                                                           \
        }                                                                                               \
        PC_UNROLL for (int j = 0; j < nb; j++)                                                          \
            PC_UNROLL for (int i = 0; i < mb; i++) out[j * PC_MAXT + i] = v16_sum(a[j][i]);             \
    }                                                                                                   \
    PC_HALVES(NAME, WT, WLOAD8)                                                                         \
    static inline __attribute__((always_inline)) void NAME(const WT* const* w, int64_t K, const float* X, \
                                                           int nb, int mb, float* out) {               \
        switch (nb * 8 + mb) {                                                                          \
            case 4 * 8 + 1: NAME##_k(w, K, X, 4, 1, out); break;                                        \
            case 4 * 8 + 2: NAME##_h(w, K, X, 4, 2, out); break;                                        \
            case 4 * 8 + 3: NAME##_h(w, K, X, 4, 3, out); break;                                        \
            case 4 * 8 + 4: NAME##_h(w, K, X, 4, 4, out); break;                                        \
            case 2 * 8 + 1: NAME##_k(w, K, X, 2, 1, out); break;                                        \
            case 2 * 8 + 2: NAME##_h(w, K, X, 2, 2, out); break;                                        \
            case 2 * 8 + 3: NAME##_h(w, K, X, 2, 3, out); break;                                        \
            case 2 * 8 + 4: NAME##_h(w, K, X, 2, 4, out); break;                                        \
            case 1 * 8 + 1: NAME##_k(w, K, X, 1, 1, out); break;                                        \
            case 1 * 8 + 2: NAME##_h(w, K, X, 1, 2, out); break;                                        \
            case 1 * 8 + 3: NAME##_h(w, K, X, 1, 3, out); break;                                        \
            case 1 * 8 + 4: NAME##_h(w, K, X, 1, 4, out); break;                                        \
            default: /* not reached: nb and mb come from the tile sizes above */                       \
                for (int j = 0; j < nb; j++)                                                            \
                    for (int i = 0; i < mb; i++) NAME##_k(w + j, K, X + i * K, 1, 1, out + j * PC_MAXT + i); \
        }                                                                                               \
    }
PC_TILE(tile_f32, float, v16_f32, v8_f32)
PC_TILE(tile_bf16, uint16_t, v16_bf16, v8_bf16)
PC_TILE(tile_int8, int8_t, v16_i8, v8_i8)

#if defined(PC_AVX2)
/* One token's bf16 tile on AVX2 (nb rows of W, one row of X): 16 weights in one 256-bit load,
 * widened to fp32 by interleaving zeros below them (one unpack a half, where a widening load and
 * a shift took two each: one token's bf16 products read 41-42 GB/s where AVX-512 read 47-50, on
 * the same minute). The low half then holds weights 0-3 and 8-11 of each 16, the high half 4-7
 * and 12-15; X comes laid out the same way (pc_bf16_x1), and the accumulators are put back in
 * lane order before the sum. Every lane is the chain tile_bf16_k computes, in the same order,
 * so the same bits come out. */
static inline __attribute__((always_inline)) void tile_bf16_1(const uint16_t* const* w, int64_t K, const float* Xp,
                                                              const int nb, float* out) {
    __m256 lo[PC_MAXT], hi[PC_MAXT];
    const __m256i z = _mm256_setzero_si256();
    PC_UNROLL for (int j = 0; j < nb; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256 xl = _mm256_loadu_ps(Xp + k), xh = _mm256_loadu_ps(Xp + k + 8);
        PC_UNROLL for (int j = 0; j < nb; j++) {
            const __m256i b = _mm256_loadu_si256((const __m256i*)(w[j] + k));
            lo[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, b)), xl, lo[j]);
            hi[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, b)), xh, hi[j]);
        }
    }
    PC_UNROLL for (int j = 0; j < nb; j++) {
        v16 a = {_mm256_permute2f128_ps(lo[j], hi[j], 0x20), _mm256_permute2f128_ps(lo[j], hi[j], 0x31)};
        out[j * PC_MAXT] = v16_sum(a);
    }
}

/* x (K, rounded to bf16) into xp in tile_bf16_1's order: each 16 as 0-3, 8-11, 4-7, 12-15 */
static inline void pc_bf16_x1(const float* x, float* xp, int64_t K) {
    for (int64_t k = 0; k < K; k += 16)
        for (int i = 0; i < 4; i++) {
            xp[k + i] = round_bf16(x[k + i]), xp[k + 4 + i] = round_bf16(x[k + 8 + i]);
            xp[k + 8 + i] = round_bf16(x[k + 4 + i]), xp[k + 12 + i] = round_bf16(x[k + 12 + i]);
        }
}
#define PC_BF16_X1 1
#endif

/* fmt 0: fp32 W; 1: bf16 W; 2: int8 W with one scale a row. Y's columns rows[0 .. nb) for every
 * row of X, in tiles of nb x mbt. */
static inline __attribute__((always_inline)) void gemm_rows(int fmt, const void* W, const float* scale,
                                                            const float* xs, float* Y, const float* bias,
                                                            int64_t N, int64_t K, int64_t M, int add,
                                                            const int64_t* rows, int nb, int mbt) {
    float d[PC_MAXT * PC_MAXT];
    const void* w[PC_MAXT] = {0};
    for (int j = 0; j < nb; j++)
        w[j] = fmt == 0 ? (const void*)((const float*)W + rows[j] * K)
             : fmt == 1 ? (const void*)((const uint16_t*)W + rows[j] * K) : (const void*)((const int8_t*)W + rows[j] * K);
    for (int64_t m0 = 0; m0 < M; m0 += mbt) {
        const int mb = M - m0 < mbt ? (int)(M - m0) : mbt;
        if (fmt == 0) tile_f32((const float* const*)w, K, xs + m0 * K, nb, mb, d);
#if defined(PC_BF16_X1)
        else if (fmt == 1 && mbt == 1 && nb == PC_N1) tile_bf16_1((const uint16_t* const*)w, K, xs, PC_N1, d);
        else if (fmt == 1 && mbt == 1) /* the rows after the tiles: one at a time (X is in tile_bf16_1's order) */
            for (int j = 0; j < nb; j++) tile_bf16_1((const uint16_t* const*)w + j, K, xs, 1, d + j * PC_MAXT);
#endif
        else if (fmt == 1) tile_bf16((const uint16_t* const*)w, K, xs + m0 * K, nb, mb, d);
        else tile_int8((const int8_t* const*)w, K, xs + m0 * K, nb, mb, d);
        for (int j = 0; j < nb; j++) {
            const int64_t n = rows[j];
            for (int i = 0; i < mb; i++) {
                float v = d[j * PC_MAXT + i];
                v = fmt == 0 ? v : round_bf16(fmt == 1 ? v : v * scale[n]);
                float* y = Y + (m0 + i) * N;
                PC_STORE(y, n, v);
            }
        }
    }
}

/* X rounded to bf16 into xr (M x K) for a bf16 or int8 W (one token's in tile_bf16_1's order
 * where the build has it); fp32 W reads X as it is. Returns what the products read. */
static inline const float* gemm_x(int fmt, const float* X, float* xr, int64_t M, int64_t K) {
    if (fmt == 0) return X;
#if defined(PC_BF16_X1)
    if (fmt == 1 && M == 1) { pc_bf16_x1(X, xr, K); return xr; } /* one token: tile_bf16_1's order */
#endif
    for (int64_t i = 0; i < M * K; i++) xr[i] = round_bf16(X[i]);
    return xr;
}

/* Thread t of T's rows of a product, inside a parallel region: [lo, hi), as nbt runs of q rows
 * walked side by side, then the rest. Which thread computes a row never changes its bits. */
static inline void gemm_part(int fmt, const void* W, const float* scale, const float* xs, float* Y, const float* bias,
                             int64_t N, int64_t K, int64_t M, int add, int64_t t, int64_t T) {
    const int nbt = M == 1 ? PC_N1 : PC_NB, mbt = M == 1 ? 1 : PC_MB;
    const int64_t lo = N * t / T, hi = N * (t + 1) / T, q = (hi - lo) / nbt;
    int64_t rows[PC_MAXT];
    for (int64_t i = 0; i < q; i++) {
        for (int j = 0; j < nbt; j++) rows[j] = lo + j * q + i;
        gemm_rows(fmt, W, scale, xs, Y, bias, N, K, M, add, rows, nbt, mbt);
    }
    for (int64_t n = lo + nbt * q; n < hi; n++) gemm_rows(fmt, W, scale, xs, Y, bias, N, K, M, add, &n, 1, mbt);
}

static void gemm(int fmt, const void* W, const float* scale, const float* X, float* Y, const float* bias,
                 int64_t N, int64_t K, int64_t M, int add) {
    float* xr = NULL;
    if (fmt != 0) {
        xr = (float*)malloc(sizeof(float) * M * K);
        if (!xr) return;
    }
    const float* xs = gemm_x(fmt, X, xr, M, K);
    int nt = pc_threads();
    #pragma omp parallel num_threads(nt) if (nt > 1)
    gemm_part(fmt, W, scale, xs, Y, bias, N, K, M, add, omp_get_thread_num(), omp_get_num_threads());
    free(xr);
}

/* One token (M = 1): y[N] = W . x (+ bias). */
void pc_gemv_f32(const float* W, const float* x, float* y, const float* bias, int64_t N, int64_t K, int add) {
    gemm(0, W, NULL, x, y, bias, N, K, 1, add);
}

void pc_gemv_bf16(const uint16_t* W, const float* x, float* y, const float* bias, int64_t N, int64_t K, int add) {
    gemm(1, W, NULL, x, y, bias, N, K, 1, add);
}

/* W int8 with one scale a row: y[n] = (W[n] . x) * scale[n]. */
void pc_gemv_int8(const int8_t* W, const float* scale, const float* x, float* y, const float* bias, int64_t N,
                  int64_t K, int add) {
    gemm(2, W, scale, x, y, bias, N, K, 1, add);
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

/* exp(x) from IEEE additions and multiplications only (no library call, no fused multiply-add),
 * so that every build computes the same bits, and a loop of it vectorizes. x is clamped to
 * [-87.3, 88] (2^n stays a normal float); then x = n ln2 + r with n = round(x / ln2) (the
 * 1.5 * 2^23 trick rounds it to the nearest), |r| <= ln2 / 2, exp(r) by its degree-6 Taylor
 * polynomial, and 2^n written into the exponent bits: within 2.5e-7 of exp (relative, measured).
 * libm's expf is not used: its bits may differ between libraries and architectures. */
static inline float pc_expf(float x) {
    x = x < -87.3f ? -87.3f : x; /* two selects, not one nested: GCC then vectorizes the softmax's loop */
    x = x > 88.0f ? 88.0f : x;
    const float big = 12582912.0f; /* 1.5 * 2^23 */
    float t = x * 1.44269504f + big;
    float n = t - big;
    float r = x - n * 0.693359375f; /* ln2 in two parts (Cephes'): n * hi is exact */
    r = r + n * 2.12194440e-4f;
    float e = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f
                  + r * 0.00138888892f)))));
    int32_t i;
    memcpy(&i, &t, 4);
    i = (i - 0x4B400000) + 127; /* n, then its biased exponent */
    uint32_t b = (uint32_t)i << 23;
    float s2;
    memcpy(&s2, &b, 4);
    return e * s2;
}

/* The sum of x[0 .. n) in 16 lanes (lane i takes k = i mod 16), added as v16_sum's tree: the
 * same bits in every build. */
static inline float pc_sum16(const float* x, int64_t n) {
    float l[16] = {0.f};
    int64_t k = 0;
    for (; k + 16 <= n; k += 16)
        for (int i = 0; i < 16; i++) l[i] += x[k + i];
    for (int i = 0; k + i < n; i++) l[i] += x[k + i];
    float t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) t[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++) v[i] = u[i] + u[i + 2];
    return v[0] + v[1];
}

/* s[g * ss + k] = scale * (q[g] . K[k]) for G queries (rows of D floats from q) and nk keys
 * (rows from K), each dot summed exactly as dot_f32 sums it (16 lanes, the fixed tree). Keys
 * are read once, in order, for all G queries. Why not dot_f32 a (query, key): its reduction, four
 * dependent shuffle-and-adds, cost more than the key's multiply-adds. The x86 builds keep
 * PC_RK keys' lane sums and reduce them together: each level of the tree adds two registers that
 * shuffles filled with halves of several keys' lanes, so every key's lanes are still added in
 * the tree's pairs and order, and no result changes its bits. */
#if defined(PC_AVX512)
#define PC_RK 16
static inline void pc_reduce_keys(const v16* a, float scale, float* s) { /* a[16]: 16 keys' lanes -> s[16] */
    /* after the tree, lane 4 r + c holds key 4 c + r */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) /* t = lanes 0-7 + lanes 8-15: keys 2i, 2i+1 */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* u = t 0-3 + t 4-7: keys 4i..4i+3, one a 128-bit lane */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* v = u 0-1 + u 2-3 */
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_permutexvar_ps(order, r), _mm512_set1_ps(scale)));
}
#elif defined(PC_AVX2)
#define PC_RK 8
static inline void pc_reduce4(const v16* a, float scale, float* s) { /* 4 keys */
    __m256 t0 = v16_fold8(a[0]), t1 = v16_fold8(a[1]), t2 = v16_fold8(a[2]), t3 = v16_fold8(a[3]);
    __m256 u0 = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
    __m256 u1 = _mm256_add_ps(_mm256_permute2f128_ps(t2, t3, 0x20), _mm256_permute2f128_ps(t2, t3, 0x31));
    /* v: low 128 bits keys 0 and 2, high keys 1 and 3, two lanes each */
    __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(v, v, _MM_SHUFFLE(3, 1, 3, 1)));
    /* r: low [key 0, key 2, ...], high [key 1, key 3, ...] */
    __m128 o = _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
    _mm_storeu_ps(s, _mm_mul_ps(o, _mm_set1_ps(scale)));
}
static inline void pc_reduce_keys(const v16* a, float scale, float* s) { pc_reduce4(a, scale, s), pc_reduce4(a + 4, scale, s + 4); }
#endif

#define MAX_GROUP_C 16 /* kernels.py's MAX_GROUP */
static inline void pc_dots(const float* q, int64_t G, const float* K, int64_t nk, int64_t D, float scale, float* s,
                           int64_t ss) {
    int64_t k = 0;
#if defined(PC_RK)
    v16 a[MAX_GROUP_C][PC_RK]; /* each (query, key)'s 16 lane sums */
    for (; k + PC_RK <= nk; k += PC_RK) {
        for (int i = 0; i < PC_RK; i++) {
            const float* row = K + (k + i) * D;
            for (int64_t g = 0; g < G; g++) {
                v16 acc = v16_zero();
                for (int64_t d = 0; d < D; d += 16) acc = v16_fma(v16_f32(q + g * D + d), v16_f32(row + d), acc);
                a[g][i] = acc;
            }
        }
        for (int64_t g = 0; g < G; g++) pc_reduce_keys(a[g], scale, s + g * ss + k);
    }
#endif
    for (; k < nk; k++)
        for (int64_t g = 0; g < G; g++) s[g * ss + k] = dot_f32(q + g * D, K + k * D, D) * scale;
}

/* acc[g, :] = sum over the nk keys j, in key order, of p[g * ps + j] * V[j, :] (rows of D floats),
 * for g < G, each lane's sum started from zero, a multiply then an add a key (as a[d] += w * v[d]
 * computes it under -ffp-contract=off). The accumulators stay in registers across the keys, WG
 * query heads by WC 16-lane chunks at a time, and each value row loaded serves WG heads. */
#if defined(PC_AVX512)
#define PC_WG 4
#define PC_WC 4
#else
#define PC_WG 3
#define PC_WC 2
#endif
static inline __attribute__((always_inline)) void pc_wsum_tile(const float* p, int64_t ps, const float* V, int64_t nk,
                                                                int64_t D, float* acc, const int gn, const int cn) {
    v16 a[PC_WG][PC_WC], x[PC_WC];
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < cn; c++) a[g][c] = v16_zero();
    for (int64_t j = 0; j < nk; j++) {
        for (int c = 0; c < cn; c++) x[c] = v16_f32(V + j * D + 16 * c);
        for (int g = 0; g < gn; g++) {
            const v16 w = v16_set1(p[g * ps + j]);
            for (int c = 0; c < cn; c++) a[g][c] = v16_add(a[g][c], v16_mul(w, x[c]));
        }
    }
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < cn; c++) v16_st(acc + g * D + 16 * c, a[g][c]);
}

static void pc_wsum(const float* p, int64_t ps, const float* V, int64_t nk, int64_t G, int64_t D, float* acc) {
    for (int64_t g0 = 0; g0 < G; g0 += PC_WG)
        for (int64_t d0 = 0; d0 < D; d0 += 16 * PC_WC) {
            const int gn = G - g0 < PC_WG ? (int)(G - g0) : PC_WG;
            const int cn = (D - d0) / 16 < PC_WC ? (int)((D - d0) / 16) : PC_WC;
            const float* pg = p + g0 * ps;
            float* ag = acc + g0 * D + d0;
            /* each (gn, cn) its own unrolled copy, so that the accumulators are registers */
#define PC_WCASE(GN, CN) \
    case (GN) * 8 + (CN): pc_wsum_tile(pg, ps, V + d0, nk, D, ag, GN, CN); break;
            switch (gn * 8 + cn) {
#if PC_WC == 4
                PC_WCASE(1, 1) PC_WCASE(1, 2) PC_WCASE(1, 3) PC_WCASE(1, 4) PC_WCASE(2, 1) PC_WCASE(2, 2)
                PC_WCASE(2, 3) PC_WCASE(2, 4) PC_WCASE(3, 1) PC_WCASE(3, 2) PC_WCASE(3, 3) PC_WCASE(3, 4)
                PC_WCASE(4, 1) PC_WCASE(4, 2) PC_WCASE(4, 3) PC_WCASE(4, 4)
#else
                PC_WCASE(1, 1) PC_WCASE(1, 2) PC_WCASE(2, 1) PC_WCASE(2, 2) PC_WCASE(3, 1) PC_WCASE(3, 2)
#endif
            }
#undef PC_WCASE
        }
}

/* The attention of one new token of each of M sequences over its own cached keys, in one
 * parallel region (a decode step's layer: one call for the whole batch, where a call a
 * sequence cost three calls, two thread barriers and a torch softmax, ~27 us each).
 *
 * Sequence i: queries q + i * qs, (H, G, D) (grouped-query attention: the G query heads of
 * key head h read h's keys, never repeated); keys and values at the addresses kp[i] and vp[i],
 * head h's rows from kp[i] + h * hs[i] floats, D a row, the first n[i] of them; output
 * out + i * os, (H, G, D). D a multiple of 16 and at most 256; G at most 16.
 *
 * Each sequence, as it would alone: s[h, g, j] = scale * q[h, g] . K[h, j] (dot_f32); p =
 * softmax over j (the row's max subtracted, pc_expf, pc_sum16, one division a key); out[h, g]
 * = sum_j p[h, g, j] V[h, j], the keys summed in blocks of PC_KB, each block into its own
 * partial, the partials added in block order. No sum depends on the thread count, on M, or on
 * which other sequences share the call. ``scratch``: pc_attention_scratch(...) floats. */
#define PC_KB 128
#define PC_SB 64 /* keys a work item of the scores */
static inline int64_t pc_ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t pc_attention_scratch(int64_t M, const int64_t* n, int64_t H, int64_t G, int64_t D) {
    int64_t f = 0;
    for (int64_t i = 0; i < M; i++) f += H * G * n[i] + pc_ceil(n[i], PC_KB) * H * G * D;
    return f;
}

/* the sequence whose items [first[i], first[i + 1]) hold ``it`` (M is small: a scan) */
static inline int64_t pc_owner(const int64_t* first, int64_t M, int64_t it) {
    int64_t i = 0;
    while (i + 1 < M && first[i + 1] <= it) i++;
    return i;
}

/* pc_attention's work, called by every thread of a parallel region (its loops share the region's
 * threads: orphaned "omp for", each ending at a barrier); each thread lays out the same index. */
static void attention_body(int64_t M, const float* q, int64_t qs, const int64_t* kp, const int64_t* vp,
                           const int64_t* hs, const int64_t* n, float* out, int64_t os, int64_t H, int64_t G,
                           int64_t D, float scale, float* scratch) {
    const int64_t HG = H * G, HGD = H * G * D;
    int64_t idx[5 * (M + 1)]; /* on the stack, each thread's own: M is a batch's size */
    /* per sequence: where its scores and partials start, and its first item of each phase */
    int64_t *s0 = idx, *p0 = idx + (M + 1), *f1 = idx + 2 * (M + 1), *f3 = idx + 3 * (M + 1), *nb = idx + 4 * (M + 1);
    s0[0] = 0, f1[0] = 0, f3[0] = 0;
    for (int64_t i = 0; i < M; i++) {
        nb[i] = pc_ceil(n[i], PC_KB);
        s0[i + 1] = s0[i] + HG * n[i];
        f1[i + 1] = f1[i] + H * pc_ceil(n[i], PC_SB);
        f3[i + 1] = f3[i] + nb[i];
    }
    p0[0] = s0[M];
    for (int64_t i = 0; i < M; i++) p0[i + 1] = p0[i] + nb[i] * HGD;
    {
        /* scores: items (sequence, key head, block of PC_SB keys) */
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < f1[M]; it++) {
            const int64_t i = pc_owner(f1, M, it), r = it - f1[i], bl = pc_ceil(n[i], PC_SB);
            const int64_t h = r / bl, j0 = (r % bl) * PC_SB, j1 = j0 + PC_SB < n[i] ? j0 + PC_SB : n[i];
            const float* qh = q + i * qs + h * G * D;
            const float* K = (const float*)(intptr_t)kp[i] + h * hs[i];
            float* s = scratch + s0[i];
            pc_dots(qh, G, K + j0 * D, j1 - j0, D, scale, s + h * G * n[i] + j0, n[i]);
        }
        /* softmax: items (sequence, query head) */
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < M * HG; it++) {
            const int64_t i = it / HG, row = it % HG, len = n[i];
            float* s = scratch + s0[i] + row * len;
            float mx = s[0]; /* the max is the same in any order: vectorized */
            #pragma omp simd reduction(max : mx)
            for (int64_t j = 1; j < len; j++) mx = s[j] > mx ? s[j] : mx;
            #pragma omp simd
            for (int64_t j = 0; j < len; j++) s[j] = pc_expf(s[j] - mx);
            const float sum = pc_sum16(s, len);
            #pragma omp simd
            for (int64_t j = 0; j < len; j++) s[j] = s[j] / sum;
        }
        /* weighted sums: items (sequence, block of PC_KB keys), each into its own partial */
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < f3[M]; it++) {
            const int64_t i = pc_owner(f3, M, it), b = it - f3[i], len = n[i];
            const int64_t j0 = b * PC_KB, j1 = j0 + PC_KB < len ? j0 + PC_KB : len;
            const float* p = scratch + s0[i];
            float* acc = scratch + p0[i] + b * HGD;
            for (int64_t h = 0; h < H; h++)
                pc_wsum(p + h * G * len + j0, len, (const float*)(intptr_t)vp[i] + h * hs[i] + j0 * D, j1 - j0, G, D,
                        acc + h * G * D);
        }
        /* the partials added in block order: items (sequence, query head) */
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < M * HG; it++) {
            const int64_t i = it / HG, row = it % HG;
            const float* part = scratch + p0[i] + row * D;
            float* o = out + i * os + row * D;
            for (int64_t d = 0; d < D; d++) {
                float sum = 0.f;
                for (int64_t b = 0; b < nb[i]; b++) sum += part[b * HGD + d];
                o[d] = sum;
            }
        }
    }
}

void pc_attention(int64_t M, const float* q, int64_t qs, const int64_t* kp, const int64_t* vp, const int64_t* hs,
                  const int64_t* n, float* out, int64_t os, int64_t H, int64_t G, int64_t D, float scale,
                  float* scratch) {
    int nt = pc_threads();
    #pragma omp parallel num_threads(nt) if (nt > 1)
    attention_body(M, q, qs, kp, vp, hs, n, out, os, H, G, D, scale, scratch);
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

/* pc_rmsnorm of each of the M rows of x (M, K) into out (M, K): one call for a batch. */
void pc_rmsnorm_rows(const float* x, const float* w, float* out, int64_t M, int64_t K, float eps) {
    for (int64_t i = 0; i < M; i++) pc_rmsnorm(x + i * K, w, out + i * K, K, eps);
}

/* out[I] = silu(gu[:I]) * gu[I:] (a SiLU-gated MLP's hidden layer), with pc_expf. */
void pc_silu_mul(const float* gu, float* out, int64_t I) {
    for (int64_t i = 0; i < I; i++) {
        float g = gu[i];
        out[i] = g / (1.0f + pc_expf(-g)) * gu[I + i];
    }
}

/* pc_silu_mul of each of the M rows of gu (M, 2 I) into out (M, I). */
void pc_silu_mul_rows(const float* gu, float* out, int64_t M, int64_t I) {
    for (int64_t i = 0; i < M; i++) pc_silu_mul(gu + i * 2 * I, out + i * I, I);
}

/* One decoder layer's weights (each product's W, its row scales for int8, its bias) and norms,
 * and where the token's key and value go: the layers pc_decode_layers walks. */
typedef struct {
    const void* w[4]; /* qkv, o, gate_up, down */
    const float* s[4];
    const float* b[4];
    const float* norm1;
    const float* norm2;
    float* k; /* (Hkv, capacity, D): the layer's cached keys, rows < n, and the token's at row n */
    float* v;
    int64_t hs; /* floats from one key head to the next */
} pc_layer;

/* One token through nl Llama-style decoder layers, in place on h (hidden,): per layer the calls
 * decode_step.py made one by one (RMSNorm, the fused q/k/v product, RoPE and the cache write,
 * attention over rows <= n, the output product added to h, RMSNorm, the gate/up product, the
 * SiLU gate, the down product added to h), on the same buffers with the same sums, so the same
 * bits, in one parallel region for the whole token: a barrier between steps where each product
 * and each attention opened and closed a region of its own (five a layer). The small steps run
 * on one thread (omp single), the products and attention on all. scratch holds at least
 * pc_attention_scratch(1, {n + 1}, ...) floats. Returns 0, or -1 when it could not allocate its
 * scratch (nothing computed). */
int pc_decode_layers(const pc_layer* L, int64_t nl, int fmt, float* h, float* x, float* qkv, float* q, float* att,
                     float* gu, float* act, const float* cos_, const float* sin_, int64_t hidden, int64_t H,
                     int64_t Hkv, int64_t D, int64_t inter, float eps, float scale, int64_t n, float* scratch) {
    const int64_t G = H / Hkv, nqkv = (H + 2 * Hkv) * D, keys = n + 1, HD = H * D;
    const int64_t widest = hidden > HD ? (hidden > inter ? hidden : inter) : (HD > inter ? HD : inter);
    float* xr = fmt == 0 ? NULL : (float*)malloc(sizeof(float) * widest); /* X rounded for bf16/int8 W */
    if (fmt != 0 && !xr) return -1; /* nothing computed: the caller raises */
    int nt = pc_threads();
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
        for (int64_t l = 0; l < nl; l++) {
            const pc_layer* y = L + l;
            const int64_t kp = (int64_t)(intptr_t)y->k, vp = (int64_t)(intptr_t)y->v, hs = y->hs;
            #pragma omp single
            {
                pc_rmsnorm(h, y->norm1, x, hidden, eps);
                gemm_x(fmt, x, xr, 1, hidden);
            }
            gemm_part(fmt, y->w[0], y->s[0], fmt == 0 ? x : xr, qkv, y->b[0], nqkv, hidden, 1, 0, t, T);
            #pragma omp barrier
            #pragma omp single
            pc_rope_write(qkv, cos_, sin_, H, Hkv, D, q, y->k, y->v, hs, n);
            attention_body(1, q, 0, &kp, &vp, &hs, &keys, att, 0, Hkv, G, D, scale, scratch);
            #pragma omp single
            gemm_x(fmt, att, xr, 1, HD);
            gemm_part(fmt, y->w[1], y->s[1], fmt == 0 ? att : xr, h, y->b[1], hidden, HD, 1, 1, t, T);
            #pragma omp barrier
            #pragma omp single
            {
                pc_rmsnorm(h, y->norm2, x, hidden, eps);
                gemm_x(fmt, x, xr, 1, hidden);
            }
            gemm_part(fmt, y->w[2], y->s[2], fmt == 0 ? x : xr, gu, y->b[2], 2 * inter, hidden, 1, 0, t, T);
            #pragma omp barrier
            #pragma omp single
            {
                pc_silu_mul(gu, act, inter);
                gemm_x(fmt, act, xr, 1, inter);
            }
            gemm_part(fmt, y->w[3], y->s[3], fmt == 0 ? act : xr, h, y->b[3], hidden, inter, 1, 1, t, T);
            #pragma omp barrier
        }
    }
    free(xr);
    return 0;
}
