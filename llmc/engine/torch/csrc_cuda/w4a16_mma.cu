// llmc's W4A16 kernels for decode-sized steps on NVIDIA GPUs (sm_80+): int4 weights x 16-bit activations on the
// tensor cores, one read of the packed weight. Built by llmc/engine/torch/cuda_ext.py (nvcc, loaded with ctypes);
// the layout is made at load by llmc.engine.torch.int4_cuda.pack_mma.
//
// The product is computed transposed, y^T = W x^T, with mma.m16n8k16: the weight is the A operand (16 output
// columns x 16 inputs), the activations the B operand (16 inputs x 8 rows). So 1-8 rows cost one mma per 256
// weights and 9-64 rows cost 2-8 mma that share the weight's registers.
//
// Packed layout: the weight in tiles of 16 columns x 64 inputs, ``[N/16][K/64][32 lanes][4 words]`` (int32); a
// tile is 512 contiguous bytes, one 16-byte load per lane. Lane (g, t) = (lane / 4, lane % 4), word s holds the
// 8 nibbles (u = q + 8) of columns c = g + 8 * (j & 1), inputs 16 t + 4 s + 2 * ((j >> 1) & 1) + (j >> 2) for
// nibble j: exactly lane (g, t)'s A fragment of the s-th mma of the tile, once the mma's 16 "k" positions are
// mapped to the tile's inputs as {2t, 2t+1, 2t+8, 2t+9} -> 16 t + 4 s + {0, 1, 2, 3}. The B fragment of row m is
// then x[m, 16 t .. 16 t + 15] of the tile: two 16-byte loads per lane. Nibble pairs (j, j + 4) sit in the two
// halves of a 32-bit word, so ``(w >> 4i) & 0x000F000F | magic`` is two 16-bit floats 128 + u (bf16) or
// 1024 + u (fp16) in two integer ops; minus 136 (1032) is q exactly, times the group scale is round(q * s), the
// weight the dequantized model holds. Sums are float32 (the mma's accumulator).
//
// Scales: ``[K/G][N/16][8]`` pairs (s[c], s[c + 8]) of tile column c, one 32-bit load per lane per tile.
// A block is NT column tiles x 8 * MT rows; its WARPS warps take the input tiles in turn (tile kt goes to warp
// kt % WARPS) and add their partial sums in shared memory in a fixed order (deterministic). With ``prefetch``, warp 0
// first asks the bulk-copy engine to bring the block's whole weight slice into L2 (sm_90; tuned per shape and rows).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// Two 16-bit floats in a 32-bit register: q from (magic | nibble) - offset, products with scales and inputs.
template <typename T2>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  T2 r = __hsub2(*reinterpret_cast<T2*>(&a), *reinterpret_cast<T2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

template <typename T2>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  T2 r = __hmul2(*reinterpret_cast<T2*>(&a), *reinterpret_cast<T2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// T: the activation type, T2 its pair; Magic | nibbles is two floats `base + u`, Offset the pair (base + 8).
template <typename T, typename T2, uint32_t Magic, uint32_t Offset>
struct Half2OpsOf {
  static constexpr uint32_t kMagic = Magic;
  static constexpr uint32_t kOffset = Offset;
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) { return sub2<T2>(a, b); }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) { return mul2<T2>(a, b); }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_16816(d, a, b0, b1, T());
  }
  static __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
  static __device__ __forceinline__ T from_float(float v) { return T(v); }  // round to nearest even
};

template <typename T> struct Half2Ops;
template <> struct Half2Ops<__nv_bfloat16>  // (128, 128) and (136, 136) as bf16 pairs
    : Half2OpsOf<__nv_bfloat16, __nv_bfloat162, 0x43004300u, 0x43084308u> {};
template <> struct Half2Ops<__half>  // (1024, 1024) and (1032, 1032) as fp16 pairs
    : Half2OpsOf<__half, __half2, 0x64006400u, 0x64086408u> {};

// The packed weight is read once per step: stream it past L1 (the activations, read by every column tile, stay).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// Start copying [p, p + bytes) from HBM into L2 in the background (sm_90's bulk-copy engine): the warps' own loads
// then find their tiles in L2, and many more bytes are in flight than the registers could hold. Lanes of one warp
// take 16 KB pieces.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const char* base = static_cast<const char*>(p);
  for (unsigned off = static_cast<unsigned>(lane) * 16384u; off < bytes; off += 32u * 16384u) {
    const unsigned size = bytes - off < 16384u ? bytes - off : 16384u;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(base + off), "r"(size) : "memory");
  }
#endif
}

template <typename T, int MT, int NT, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_mma_kernel(const T* __restrict__ x, int ldx, const uint4* __restrict__ w, const uint32_t* __restrict__ scales,
                 const T* __restrict__ prequant, T* __restrict__ y, int ldy, int rows, int n, int k, int group_shift,
                 int silu_out, int prefetch) {
  // A block: NT column tiles (16 NT columns) x 8 MT rows; each warp multiplies its input tiles with all NT column
  // tiles, so one activation fragment serves NT mma.
  using Ops = Half2Ops<T>;
  const int nt0 = blockIdx.x * NT, row0 = blockIdx.y * (8 * MT);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int ktiles = k >> 6, ntiles = n >> 4;
  const uint4* wt = w + static_cast<size_t>(nt0) * ktiles * 32 + lane;  // NT column tiles: contiguous
  if (prefetch && warp == 0) prefetch_l2(w + static_cast<size_t>(nt0) * ktiles * 32, NT * ktiles * 512u, lane);

  bool row_ok[MT];
  const T* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r = row0 + 8 * mt + g;
    row_ok[mt] = r < rows;
    xrow[mt] = x + static_cast<size_t>(row_ok[mt] ? r : 0) * ldx + 16 * t;
  }

  float acc[NT][MT][4];
#pragma unroll
  for (int c = 0; c < NT; ++c)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[c][mt][0] = acc[c][mt][1] = acc[c][mt][2] = acc[c][mt][3] = 0.f;

  for (int kt0 = warp; kt0 < ktiles; kt0 += WARPS * UNROLL) {
    uint4 wq[UNROLL][NT];
    uint32_t sc[UNROLL][NT];
    uint4 xv[UNROLL][MT][2];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // every load of the group first: UNROLL tiles in flight per warp
      const int kt = kt0 + u * WARPS;
      if (kt < ktiles) {
#pragma unroll
        for (int c = 0; c < NT; ++c) {
          wq[u][c] = load_stream(wt + (static_cast<size_t>(c) * ktiles + kt) * 32);
          sc[u][c] = __ldg(scales + (static_cast<size_t>(kt >> group_shift) * ntiles + nt0 + c) * 8 + g);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (row_ok[mt]) {
            const uint4* xp = reinterpret_cast<const uint4*>(xrow[mt] + kt * 64);
            xv[u][mt][0] = __ldg(xp);
            xv[u][mt][1] = __ldg(xp + 1);
          } else {
            xv[u][mt][0] = xv[u][mt][1] = make_uint4(0, 0, 0, 0);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int kt = kt0 + u * WARPS;
      if (kt >= ktiles) break;  // uniform across the warp
      if (prequant != nullptr) {  // AWQ's input scale: x * s rounded to 16 bits, as the reference computes it
        const uint4* pp = reinterpret_cast<const uint4*>(prequant + kt * 64 + 16 * t);
        const uint4 p0 = __ldg(pp), p1 = __ldg(pp + 1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint4& a = xv[u][mt][0];
          uint4& b = xv[u][mt][1];
          a.x = Ops::mul(a.x, p0.x); a.y = Ops::mul(a.y, p0.y); a.z = Ops::mul(a.z, p0.z); a.w = Ops::mul(a.w, p0.w);
          b.x = Ops::mul(b.x, p1.x); b.y = Ops::mul(b.y, p1.y); b.z = Ops::mul(b.z, p1.z); b.w = Ops::mul(b.w, p1.w);
        }
      }
#pragma unroll
      for (int c = 0; c < NT; ++c) {
        const uint32_t s_lo = __byte_perm(sc[u][c], 0, 0x1010), s_hi = __byte_perm(sc[u][c], 0, 0x3232);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint32_t word = word_of(wq[u][c], s);
          uint32_t a[4];
          a[0] = Ops::mul(Ops::sub((word & 0x000F000Fu) | Ops::kMagic, Ops::kOffset), s_lo);          // col g, +0 +1
          a[1] = Ops::mul(Ops::sub(((word >> 4) & 0x000F000Fu) | Ops::kMagic, Ops::kOffset), s_hi);   // col g+8
          a[2] = Ops::mul(Ops::sub(((word >> 8) & 0x000F000Fu) | Ops::kMagic, Ops::kOffset), s_lo);   // col g, +2 +3
          a[3] = Ops::mul(Ops::sub(((word >> 12) & 0x000F000Fu) | Ops::kMagic, Ops::kOffset), s_hi);  // col g+8
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint4& lo = xv[u][mt][s >> 1];
            const uint32_t b0 = (s & 1) ? lo.z : lo.x, b1 = (s & 1) ? lo.w : lo.y;
            Ops::mma(acc[c][mt], a, b0, b1);
          }
        }
      }
    }
  }

  // Partial sums of the warps -> one result per (row, column), added in warp order.
  __shared__ float partial[WARPS][NT * MT * 4][32];
#pragma unroll
  for (int c = 0; c < NT; ++c)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][(c * MT + mt) * 4 + i][lane] = acc[c][mt][i];
  __syncthreads();
  // acc[c][mt][i] of lane (g, t): column g + 8 * (i >> 1) of tile nt0 + c, row 8 mt + 2 t + (i & 1) of the block.
  if (silu_out) {  // columns g (fc) and g + 8 (gate) of a tile -> output column 8 nt + g
    for (int idx = threadIdx.x; idx < NT * MT * 2 * 32; idx += WARPS * 32) {
      const int l = idx & 31, j = (idx >> 5) & 1, cm = idx >> 6, c = cm / MT, mt = cm % MT;
      float fc = 0.f, gate = 0.f;
#pragma unroll
      for (int wi = 0; wi < WARPS; ++wi) {
        fc += partial[wi][cm * 4 + j][l];
        gate += partial[wi][cm * 4 + 2 + j][l];
      }
      const int r = row0 + 8 * mt + 2 * (l & 3) + j;
      if (r < rows) y[static_cast<size_t>(r) * ldy + 8 * (nt0 + c) + (l >> 2)] = Ops::from_float(silu(fc) * gate);
    }
  } else {
    for (int idx = threadIdx.x; idx < NT * MT * 4 * 32; idx += WARPS * 32) {
      const int l = idx & 31, i = (idx >> 5) & 3, cm = idx >> 7, c = cm / MT, mt = cm % MT;
      float v = 0.f;
#pragma unroll
      for (int wi = 0; wi < WARPS; ++wi) v += partial[wi][cm * 4 + i][l];
      const int r = row0 + 8 * mt + 2 * (l & 3) + (i & 1);
      if (r < rows) y[static_cast<size_t>(r) * ldy + 16 * (nt0 + c) + (l >> 2) + 8 * (i >> 1)] = Ops::from_float(v);
    }
  }
}

// The effective weight [K, N] (q * s * prequant, rounded once) for prefill steps (cuBLAS multiplies it). A block
// of 128 threads takes one input tile (64 rows of the output) of 4 column tiles, staged in shared memory; each
// thread writes 8 columns (one 16-byte store) of 4 rows. ``halves``: fc + gate layers write [fc | gate] (tile
// column c < 8 -> 8 nt + c, else N/2 + 8 nt + c - 8).
template <typename T>
__global__ void __launch_bounds__(128)
w4a16_mma_dequant_kernel(const uint4* __restrict__ w, const uint32_t* __restrict__ scales,
                         const T* __restrict__ prequant, T* __restrict__ out, int n, int k, int group_shift,
                         int halves) {
  using Ops = Half2Ops<T>;
  constexpr int TILES = 4;
  const int ktiles = k >> 6, ntiles = n >> 4;
  const int kt = blockIdx.y, nt0 = blockIdx.x * TILES;
  __shared__ uint32_t words[TILES][32 * 4];
  __shared__ uint32_t pairs[TILES][8];
  for (int i = threadIdx.x; i < TILES * 32; i += 128) {
    const int c = i >> 5, l = i & 31;
    if (nt0 + c < ntiles) {
      const uint4 v = w[(static_cast<size_t>(nt0 + c) * ktiles + kt) * 32 + l];
      words[c][4 * l] = v.x; words[c][4 * l + 1] = v.y; words[c][4 * l + 2] = v.z; words[c][4 * l + 3] = v.w;
    }
  }
  if (threadIdx.x < TILES * 8) {
    const int c = threadIdx.x >> 3;
    if (nt0 + c < ntiles)
      pairs[c][threadIdx.x & 7] = scales[(static_cast<size_t>(kt >> group_shift) * ntiles + nt0 + c) * 8 + (threadIdx.x & 7)];
  }
  __syncthreads();
  // Thread (c, h) = (tile, column half) of the block's 4 x 2 sixteen-byte pieces of a row; 16 rows at a time, so
  // one store instruction of a warp writes 4 rows x 128 contiguous bytes (64 + 64 with ``halves``).
  const int c = (threadIdx.x >> 1) & 3, h = threadIdx.x & 1;
  const int nt = nt0 + c;
  if (nt >= ntiles) return;
  T sp[2];
  float s_col[8];
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    *reinterpret_cast<uint32_t*>(sp) = pairs[c][g];
    s_col[g] = Ops::to_float(sp[h]);
  }
  const int col = halves ? (h ? n / 2 : 0) + 8 * nt : 16 * nt + 8 * h;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = (threadIdx.x >> 3) + 16 * i;  // row of the input tile
    const int t = row >> 4, s = (row >> 2) & 3, kk = row & 3;
    const int j = h | ((kk >> 1) << 1) | ((kk & 1) << 2);  // the nibble holding (column g + 8 h, input kk)
    const int kin = 64 * kt + row;
    const float p = prequant != nullptr ? Ops::to_float(prequant[kin]) : 1.0f;
    alignas(16) T vals[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      const uint32_t word = words[c][4 * (4 * g + t) + s];
      const int q = static_cast<int>((word >> (4 * j)) & 0xFu) - 8;
      vals[g] = Ops::from_float(static_cast<float>(q) * s_col[g] * p);
    }
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(kin) * n + col) = *reinterpret_cast<const uint4*>(vals);
  }
}

template <typename T, int MT, int NT, int WARPS>
int launch_t(const void* x, int ldx, const void* w, const void* scales, const void* prequant, void* y, int ldy,
             int rows, int n, int k, int group_shift, int silu_out, int prefetch, cudaStream_t stream) {
  // Four input tiles in flight per warp; fewer where the fragments of MT row tiles and NT column tiles would not
  // fit the registers.
  constexpr int UNROLL = MT * NT >= 8 ? 1 : MT * NT >= 4 ? 2 : 4;
  if constexpr (WARPS * NT * MT * 4 * 32 * 4 > 48 * 1024) {
    return -1;  // the partial sums would not fit static shared memory
  } else {
    if ((n / 16) % NT) return -1;
    const dim3 grid(n / (16 * NT), (rows + 8 * MT - 1) / (8 * MT));
    w4a16_mma_kernel<T, MT, NT, WARPS, UNROLL><<<grid, WARPS * 32, 0, stream>>>(
        static_cast<const T*>(x), ldx, static_cast<const uint4*>(w), static_cast<const uint32_t*>(scales),
        static_cast<const T*>(prequant), static_cast<T*>(y), ldy, rows, n, k, group_shift, silu_out, prefetch);
    return static_cast<int>(cudaGetLastError());
  }
}

#define LLMC_ARGS x, ldx, w, scales, prequant, y, ldy, rows, n, k, group_shift, silu_out, prefetch, stream

template <typename T, int MT, int NT>
int launch_warps(int warps, const void* x, int ldx, const void* w, const void* scales, const void* prequant, void* y,
                 int ldy, int rows, int n, int k, int group_shift, int silu_out, int prefetch, cudaStream_t stream) {
  switch (warps) {
    case 4: return launch_t<T, MT, NT, 4>(LLMC_ARGS);
    case 8: return launch_t<T, MT, NT, 8>(LLMC_ARGS);
    case 16: return launch_t<T, MT, NT, 16>(LLMC_ARGS);
    default: return -1;
  }
}

template <typename T, int MT>
int launch_cols(int ntile, int warps, const void* x, int ldx, const void* w, const void* scales, const void* prequant,
                void* y, int ldy, int rows, int n, int k, int group_shift, int silu_out, int prefetch, cudaStream_t stream) {
  switch (ntile) {
    case 1: return launch_warps<T, MT, 1>(warps, LLMC_ARGS);
    case 2: return launch_warps<T, MT, 2>(warps, LLMC_ARGS);
    case 4: return launch_warps<T, MT, 4>(warps, LLMC_ARGS);
    default: return -1;
  }
}

template <typename T>
int launch_dtype(int mtiles, int ntile, int warps, const void* x, int ldx, const void* w, const void* scales,
                 const void* prequant, void* y, int ldy, int rows, int n, int k, int group_shift, int silu_out,
                 int prefetch, cudaStream_t stream) {
  switch (mtiles) {
    case 1: return launch_cols<T, 1>(ntile, warps, LLMC_ARGS);
    case 2: return launch_cols<T, 2>(ntile, warps, LLMC_ARGS);
    case 4: return launch_cols<T, 4>(ntile, warps, LLMC_ARGS);
    default: return -1;
  }
}

#undef LLMC_ARGS

}  // namespace

extern "C" {

// y [rows, n] (or [rows, n/2] with silu_out) = x [rows, k] (row stride ldx, 16-byte aligned) times the packed
// weight. dtype 0: bfloat16, 1: float16. mtiles in {1, 2, 4} (rows per block / 8), ntile in {1, 2, 4} (column tiles
// per block, dividing n / 16), warps in {4, 8, 16}, prefetch: the L2 bulk prefetch of the block's weight slice
// (sm_90). Returns 0 or a CUDA error code (-1: an unsupported config).
int llmc_w4a16_mma(int dtype, int mtiles, int ntile, int warps, int prefetch, const void* x, int ldx, const void* w,
                   const void* scales, const void* prequant, void* y, int ldy, int rows, int n, int k, int group_size,
                   int silu_out, void* stream) {
  if (n % 16 || k % 64 || (group_size != 64 && group_size != 128) || rows <= 0) return -1;
  const int shift = group_size == 128 ? 1 : 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dtype == 0 ? launch_dtype<__nv_bfloat16>(mtiles, ntile, warps, x, ldx, w, scales, prequant, y, ldy, rows, n,
                                                  k, shift, silu_out, prefetch, s)
                    : launch_dtype<__half>(mtiles, ntile, warps, x, ldx, w, scales, prequant, y, ldy, rows, n, k,
                                           shift, silu_out, prefetch, s);
}

int llmc_w4a16_mma_dequant(int dtype, const void* w, const void* scales, const void* prequant, void* out, int n,
                           int k, int group_size, int halves, void* stream) {
  if (n % 16 || k % 64 || (group_size != 64 && group_size != 128)) return -1;
  const int shift = group_size == 128 ? 1 : 0;
  const dim3 grid((n / 16 + 3) / 4, k / 64);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0) {
    w4a16_mma_dequant_kernel<__nv_bfloat16><<<grid, 128, 0, s>>>(
        static_cast<const uint4*>(w), static_cast<const uint32_t*>(scales),
        static_cast<const __nv_bfloat16*>(prequant), static_cast<__nv_bfloat16*>(out), n, k, shift, halves);
  } else {
    w4a16_mma_dequant_kernel<__half><<<grid, 128, 0, s>>>(
        static_cast<const uint4*>(w), static_cast<const uint32_t*>(scales), static_cast<const __half*>(prequant),
        static_cast<__half*>(out), n, k, shift, halves);
  }
  return static_cast<int>(cudaGetLastError());
}

int llmc_w4a16_abi_version() { return 3; }

}  // extern "C"
