/* The bf16 packed GEMM: AMX tiles (gemm_amx.c) where the CPU has them and the OS grants the
 * tile state, else AVX512-BF16 dot products (gemm_bf16dp.c), else (AVX2 + FMA) gemm.c's panels
 * widened to fp32. All take the same arguments and accumulate in fp32 with one rounding; the
 * first two read VNNI tile panels (linear.pack_amx), the third gemm.c's fp32 panel layout in
 * bf16 (linear.pack_panels): llmsvc_gemm_bf16_layout() says which to pack. Where none is built,
 * the entry point returns -1 and the caller uses oneDNN or F.linear.
 */
#include <stdint.h>

int llmsvc_gemm_bf16_amx_supported(void);
int llmsvc_gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);
int llmsvc_gemm_bf16_dp_supported(void);
int llmsvc_gemm_bf16_dp(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                        uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);
int llmsvc_gemm_bf16_widen_supported(void);
int llmsvc_gemm_bf16_widen(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                           uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);

/* 1: VNNI tile panels (AMX or AVX512-BF16), 2: gemm.c panels widened to fp32, 0: none */
int llmsvc_gemm_bf16_layout(void) {
    if (llmsvc_gemm_bf16_amx_supported() || llmsvc_gemm_bf16_dp_supported()) return 1;
    return llmsvc_gemm_bf16_widen_supported() ? 2 : 0;
}

int llmsvc_gemm_bf16_supported(void) { return llmsvc_gemm_bf16_layout() != 0; }

int llmsvc_gemm_bf16(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                     uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    if (llmsvc_gemm_bf16_amx_supported())
        return llmsvc_gemm_bf16_amx(a, lda, packed, bias, c, ldc, M, N, K, nt);
    if (llmsvc_gemm_bf16_dp_supported())
        return llmsvc_gemm_bf16_dp(a, lda, packed, bias, c, ldc, M, N, K, nt);
    return llmsvc_gemm_bf16_widen(a, lda, packed, bias, c, ldc, M, N, K, nt);
}
