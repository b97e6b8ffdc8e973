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
    fill(q, H * G * D), fill(Kc, H * NK * D), fill(Vc, H * NK * D);
    /* two sequences in one call: NK keys, and NK - 37 keys of buffers with a longer head stride */
    float* K2 = malloc(sizeof(float) * H * (NK + 5) * D), *V2 = malloc(sizeof(float) * H * (NK + 5) * D);
    fill(K2, H * (NK + 5) * D), fill(V2, H * (NK + 5) * D);
    float* out = malloc(sizeof(float) * 2 * H * G * D), *q2 = malloc(sizeof(float) * 2 * H * G * D);
    memcpy(q2, q, sizeof(float) * H * G * D), fill(q2 + H * G * D, H * G * D);
    int64_t kp[2] = {(int64_t)(intptr_t)Kc, (int64_t)(intptr_t)K2}, vp[2] = {(int64_t)(intptr_t)Vc, (int64_t)(intptr_t)V2};
    int64_t hs[2] = {NK * D, (NK + 5) * D}, nn[2] = {NK, NK - 37};
    float* scratch = malloc(sizeof(float) * pc_attention_scratch(2, nn, H, G, D));
    pc_attention(2, q2, H * G * D, kp, vp, hs, nn, out, H * G * D, H, G, D, 0.125f, scratch);
    show("attention", out, 2 * H * G * D);
    float ex[64];
    for (int i = 0; i < 64; i++) ex[i] = pc_expf((float)(i - 40) * 1.37f + rnd() / 64.f);
    show("expf", ex, 64);
    pc_rmsnorm(X, X + K, Y, K, 1e-5f); show("rmsnorm", Y, K);
    float cs[D / 2], sn[D / 2], qo[H * G * D];
    for (int i = 0; i < D / 2; i++) cs[i] = (float)(i + 1) / 32.0f, sn[i] = (float)(D / 2 - i) / 32.0f;
    pc_rope_write(X, cs, sn, H * G, H, D, qo, Kc, Vc, NK * D, 7); show("rope_q", qo, H * G * D); show("rope_k", Kc + 7 * D, D);
    pc_silu_mul(X, Y, K / 2); show("silu_mul", Y, K / 2);
    return 0;
}
