/* The bf16 packed GEMM: AMX tiles (gemm_amx.c) where the CPU has them and the OS grants the
 * tile state, else AVX512-BF16 dot products (gemm_bf16dp.c). Both read the same packed panels
 * (linear.pack_amx), take the same arguments and accumulate in fp32 with one rounding; where
 * neither is built, the entry point returns -1 and the caller uses oneDNN.
 */
#include <stdint.h>

int llmsvc_gemm_bf16_amx_supported(void);
int llmsvc_gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);
int llmsvc_gemm_bf16_dp_supported(void);
int llmsvc_gemm_bf16_dp(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                        uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt);

int llmsvc_gemm_bf16_supported(void) {
    return llmsvc_gemm_bf16_amx_supported() || llmsvc_gemm_bf16_dp_supported();
}

int llmsvc_gemm_bf16(const uint16_t *a, int64_t lda, const uint16_t *packed, const uint16_t *bias,
                     uint16_t *c, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    if (llmsvc_gemm_bf16_amx_supported())
        return llmsvc_gemm_bf16_amx(a, lda, packed, bias, c, ldc, M, N, K, nt);
    return llmsvc_gemm_bf16_dp(a, lda, packed, bias, c, ldc, M, N, K, nt);
}
