// A hand-written float32 kernel for decoding's few-row linear layers, used only by
// bench/gemm_probe.py to check how far a custom kernel gets past the BLAS on this CPU.
//
// y[M, N] = x[M, K] @ W[N, K]^T, all row-major float32, W as nn.Linear stores it.
// Each thread takes blocks of NR weight rows; for each block it runs over the rows of x
// in tiles of 8, keeping NR x MR accumulators of 16 lanes (dot products along K, summed
// across lanes at the end). The block's weight rows come from memory once and stay in
// L1 for the other tiles of x; with `prefetch` > 0 the first tile also prefetches the
// weight rows `prefetch` blocks ahead, one cache line per row per 16 columns.
// Needs AVX-512F; build: g++ -O3 -march=native -fopenmp -shared -fPIC.
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int NR = 3;  // weight rows per block
constexpr int MR = 8;  // rows of x per tile

template <int TM, int TN>
inline void tile(const float* __restrict x, const float* __restrict w, float* __restrict y,
                 int K, int ldy, const float* __restrict ahead) {
  __m512 acc[TN][TM];
  for (int i = 0; i < TN; i++)
    for (int j = 0; j < TM; j++) acc[i][j] = _mm512_setzero_ps();
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[TN];
    for (int i = 0; i < TN; i++) wv[i] = _mm512_loadu_ps(w + (int64_t)i * K + k);
    if (ahead)
      for (int i = 0; i < NR; i++)
        _mm_prefetch((const char*)(ahead + (int64_t)i * K + k), _MM_HINT_T0);
    for (int j = 0; j < TM; j++) {
      __m512 xv = _mm512_loadu_ps(x + (int64_t)j * K + k);
      for (int i = 0; i < TN; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (k < K) {
    __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[TN];
    for (int i = 0; i < TN; i++) wv[i] = _mm512_maskz_loadu_ps(mask, w + (int64_t)i * K + k);
    for (int j = 0; j < TM; j++) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + (int64_t)j * K + k);
      for (int i = 0; i < TN; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int j = 0; j < TM; j++)
    for (int i = 0; i < TN; i++) y[(int64_t)j * ldy + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int TN>
void block(const float* x, const float* w, float* y, int M, int K, int ldy, const float* ahead) {
  int m = 0;
  for (; m + MR <= M; m += MR, ahead = nullptr)
    tile<MR, TN>(x + (int64_t)m * K, w, y + (int64_t)m * ldy, K, ldy, ahead);
  const float* xm = x + (int64_t)m * K;
  float* ym = y + (int64_t)m * ldy;
  switch (M - m) {
    case 7: tile<7, TN>(xm, w, ym, K, ldy, ahead); break;
    case 6: tile<6, TN>(xm, w, ym, K, ldy, ahead); break;
    case 5: tile<5, TN>(xm, w, ym, K, ldy, ahead); break;
    case 4: tile<4, TN>(xm, w, ym, K, ldy, ahead); break;
    case 3: tile<3, TN>(xm, w, ym, K, ldy, ahead); break;
    case 2: tile<2, TN>(xm, w, ym, K, ldy, ahead); break;
    case 1: tile<1, TN>(xm, w, ym, K, ldy, ahead); break;
    default: break;
  }
}

}  // namespace

extern "C" void linear_f32(const float* x, const float* w, float* y, int M, int N, int K,
                           int threads, int prefetch) {
  const int blocks = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int b = 0; b < blocks; b++) {
    const int n = b * NR;
    const float* wb = w + (int64_t)n * K;
    const float* ahead =
        prefetch > 0 && n + (prefetch + 1) * NR <= N ? wb + (int64_t)prefetch * NR * K : nullptr;
    if (N - n >= 3)
      block<3>(x, wb, y + n, M, K, N, ahead);
    else if (N - n == 2)
      block<2>(x, wb, y + n, M, K, N, ahead);
    else
      block<1>(x, wb, y + n, M, K, N, ahead);
  }
}
