/* Runs every kernel of pcache_rag/models/kernels.c on fixed inputs and prints each output's
 * raw float bits in hex, one kernel a line. tests/test_kernel_variants.py builds it once per
 * instruction-set variant (the variant's -D flag selects it in kernels.c, included below) and
 * requires every variant's lines to be equal: AVX-512, AVX2 and portable C natively, NEON
 * under qemu-aarch64 when the cross compiler and qemu are installed. */
#include "../../pcache_rag/models/kernels.c"
#include <stdio.h>

static uint32_t seed = 12345u;
static float rnd(void) { /* exact small floats from a fixed sequence: the same on every machine */
    seed = seed * 1664525u + 1013904223u;
    return (float)((int32_t)(seed >> 8) % 20001 - 10000) / 4096.0f;
}
static void fill(float* p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = rnd(); }
static void show(const char* name, const float* p, int64_t n) {
    printf("%s", name);
    for (int64_t i = 0; i < n; i++) { uint32_t u; memcpy(&u, &p[i], 4); printf(" %08x", u); }
    printf("\n");
}
static uint16_t to_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }

int main(int argc, char** argv) {
    pc_set_threads(argc > 1 ? atoi(argv[1]) : 0);
    enum { N = 40, K = 96, M = 5, H = 2, G = 3, D = 32, NK = 300 };
    float* W = malloc(sizeof(float) * N * K), *X = malloc(sizeof(float) * M * K), *bias = malloc(sizeof(float) * N);
    float* Y = malloc(sizeof(float) * M * N), *scale = malloc(sizeof(float) * N);
    uint16_t* Wb = malloc(2 * N * K);
    int8_t* Wi = malloc(N * K);
    fill(W, N * K), fill(X, M * K), fill(bias, N);
    for (int64_t i = 0; i < N * K; i++) Wb[i] = to_bf16(W[i]), Wi[i] = (int8_t)((int)(W[i] * 40.f) % 127);
    for (int64_t i = 0; i < N; i++) scale[i] = 0.0078125f * (float)(i % 7 + 1);
    printf("variant %s\n", pc_variant());
    pc_gemv_f32(W, X, Y, bias, N, K, 0); show("gemv_f32", Y, N);
    pc_gemv_bf16(Wb, X, Y, NULL, N, K, 0); show("gemv_bf16", Y, N);
    pc_gemv_int8(Wi, scale, X, Y, bias, N, K, 0); show("gemv_int8", Y, N);
    pc_gemm_f32(W, X, Y, bias, N, K, M, 0); show("gemm_f32", Y, M * N);
    pc_gemm_bf16(Wb, X, Y, bias, N, K, M, 1); show("gemm_bf16_add", Y, M * N);
    pc_gemm_int8(Wi, scale, X, Y, NULL, N, K, M, 0); show("gemm_int8", Y, M * N);
    /* rows left over after the tiles (37 = 4 * 9 + 1), and one row of X over (3 = 2 + 1) */
    pc_gemm_bf16(Wb, X, Y, bias, N - 3, K, M - 2, 0); show("gemm_bf16_rest", Y, (M - 2) * (N - 3));
    float* q = malloc(sizeof(float) * H * G * D), *Kc = malloc(sizeof(float) * H * NK * D), *Vc = malloc(sizeof(float) * H * NK * D);
    float* s = malloc(sizeof(float) * H * G * NK), *out = malloc(sizeof(float) * H * G * D);
    float* part = malloc(sizeof(float) * pc_weighted_sum_scratch(H, G, D, NK));
    fill(q, H * G * D), fill(Kc, H * NK * D), fill(Vc, H * NK * D);
    pc_scores(q, Kc, NK * D, s, H, G, D, NK, 0.125f); show("scores", s, H * G * NK);
    for (int64_t i = 0; i < H * G * NK; i++) s[i] = (float)(i % 13) / 1024.0f;
    pc_weighted_sum(s, Vc, NK * D, out, H, G, D, NK, part); show("weighted_sum", out, H * G * D);
    pc_rmsnorm(X, X + K, Y, K, 1e-5f); show("rmsnorm", Y, K);
    float cs[D / 2], sn[D / 2], qo[H * G * D];
    for (int i = 0; i < D / 2; i++) cs[i] = (float)(i + 1) / 32.0f, sn[i] = (float)(D / 2 - i) / 32.0f;
    pc_rope_write(X, cs, sn, H * G, H, D, qo, Kc, Vc, NK * D, 7); show("rope_q", qo, H * G * D); show("rope_k", Kc + 7 * D, D);
    pc_silu_mul(X, Y, K / 2); show("silu_mul", Y, K / 2);
    return 0;
}
