// The bfloat16 instructions a CPU may have beyond AVX-512, found at run time: AVX512-BF16
// (vdpbf16ps) and AMX tiles (after quant_gemv.cpp in one translation unit; decode attention and
// the weight panels use them). Functions that use them are compiled for them alone (the target
// attributes below) and called only where the CPU reports them.
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

static bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has && cpu_has_avx512();
}

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_BF16 __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
constexpr int64_t kAmxTileRows = 16;   // rows per tile
constexpr int64_t kAmxTileDepth = 32;  // bfloat16 values of a row (64 bytes): the depth of one tile product

static bool amx_allowed = true;

// AMX-BF16 in CPUID, and Linux's leave to use the tile registers (asked once per process: the
// kernel gives them only to a process that asks, arch_prctl ARCH_REQ_XCOMP_PERM).
static bool cpu_has_amx_bf16() {
  static const bool has = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has && amx_allowed && cpu_has_avx512_bf16();
}

// Lets the tests run the AVX512-BF16 paths where AMX would be taken; returns the previous setting.
bool allow_amx(bool allowed) {
  const bool previous = amx_allowed;
  amx_allowed = allowed;
  return previous;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// All eight tiles 16 rows of 64 bytes, the one shape every kernel here uses (a kernel picks its
// tiles by number). The configuration is per thread: each thread that runs tiles loads it.
AMX_BF16 static void amx_configure() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kAmxTileRows;
  }
  // ldtilecfg's operand, as the intrinsic declares it, is 8 bytes: without this the compiler may
  // drop the stores to the rest of the configuration.
  __asm__ volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

AMX_BF16 static void amx_release() { _tile_release(); }

// 2^t on 16 lanes for t <= 0: t = n + f with |f| <= 1/2, 2^f by its Taylor polynomial of degree 5
// (relative error below 3e-6, far under the bfloat16 rounding the probabilities take next), then
// scaled by 2^n in one instruction: the softmax of the attention kernels on AMX, where the tiles
// spend a fraction of a cycle on a score's products and its exponential is most of its time;
// exp_approx's range reduction and exponent arithmetic take 1.5x the instructions.
AMX_BF16 static inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));  // 2^t is 0 in float32 below; keeps -inf from making NaN
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#else
static bool cpu_has_amx_bf16() { return false; }
bool allow_amx(bool) { return false; }
static void amx_configure() {}
static void amx_release() {}
#endif
