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
// halves of a 32-bit word, so ``(w >> 4i) & 0x000F000F | magic`` (one shift, one lop3) is two 16-bit floats
// 128 + u (bf16) or 1024 + u (fp16), exactly. With one row tile the mma sums (base + u) x in float32, starting
// from -(base + 8) * sum(x) (see multiply_tile), which leaves sum(q x); with several, each fragment is first made
// q exactly (one hsub2 per register, shared by the row tiles' mma). The group scale multiplies that sum once per
// tile. So the weight q * s is never rounded to 16 bits (the float32 reference's weight), and the decoding costs
// two integer ops per pair of weights (a subtraction and a multiply per pair made the loop issue-bound before).
//
// Scales: ``[N/16][K/G][8]`` pairs (s[c], s[c + 8]) of tile column c, one 32-bit load per lane per tile; a column
// tile's scales are contiguous, as its weight tiles are.
// A block is NT column tiles x 8 * MT rows; its WARPS warps take the input tiles in turn (tile kt goes to warp
// kt % WARPS) and add their partial sums in shared memory in a fixed order (deterministic). Each warp streams its
// tiles, weights and activations alike, through a ring of STAGES slots in shared memory, filled with cp.async, so
// its loads stay in flight while it multiplies.
// Config stages 0 selects the register kernel (w4a16_reg_kernel): no ring, each warp loads all its tiles straight
// into registers before waiting for the previous kernel. Negative stages select the warpgroup kernel
// (w4a16_wgmma_kernel, sm_90a only; below).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {

// Two 16-bit floats in a 32-bit register: products (AWQ's input scale times the activations).
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
  static constexpr uint32_t kOffset = Offset;                   // (base + 8) in both halves
  static constexpr uint32_t kNegOffset = Offset | 0x80008000u;  // -(base + 8) in both halves
  static __device__ __forceinline__ float low(uint32_t pair) {  // the pair's first value as float
    return static_cast<float>(*reinterpret_cast<const T*>(&pair));
  }
  static __device__ __forceinline__ float high(uint32_t pair) {
    const uint32_t h = pair >> 16;
    return static_cast<float>(*reinterpret_cast<const T*>(&h));
  }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) { return mul2<T2>(a, b); }
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) {  // a - b in both halves
    T2 r = __hsub2(*reinterpret_cast<T2*>(&a), *reinterpret_cast<T2*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
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

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// (a & b) | c in one instruction: with two constants as immediates the compiler would split it in two.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// cp.async into the shared-memory address ``dst``; ``bytes`` 0 reads nothing (the slot is zero-filled), so a request
// past the warp's last tile needs no branch.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async16_ca(unsigned dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ uint4 ld_shared16(unsigned addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr)
               : "memory");
  return r;
}

// A weight tile's 16 bytes straight into registers, read once: not kept in L1. Volatile, so the loads stay where
// they are written (before the wait for the previous kernel).
__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t ld_stream4(const uint32_t* p) {
  uint32_t r;
  asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void st_shared16(unsigned addr, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_shared4(unsigned addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_shared4(unsigned addr) {
  uint32_t r;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(r) : "r"(addr) : "memory");
  return r;
}

// Programmatic dependent launch (sm_90+; no-ops before it, and on a plain launch): ``wait_prior_grid`` returns once
// the previous kernel of the stream has finished and its writes are visible; ``allow_next_grid`` lets a kernel
// launched after this one with programmatic serialization start its blocks (which then wait in turn).
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// One input tile of a warp (64 inputs) for NT column tiles and MT row tiles, added into acc. One row tile: the A
// fragments are the nibbles as 16-bit floats ``base + u`` (u = q + 8; one lop3 each), so the mma sums
// ``(base + u) x``; the accumulator of each column tile starts at ``-(base + 8) * sum(x)`` over the tile's inputs (an
// mma whose A operand is that constant: the same for every column, computed once per tile and row tile), which
// leaves ``sum(q x)`` in float32. Several row tiles: each fragment feeds MT mma, so making it exact in 16 bits,
// ``(base + u) - (base + 8) = q`` (one hsub2 per register), costs less than the constant-A mma (a quarter of the
// mma with 4 column tiles); the mma then sums ``q x`` from zero. Either way the group scale multiplies the tile's
// sum once: acc += s * sum(q x), and the weight q * s is never rounded to 16 bits.
template <typename T, int MT, int NT>
__device__ __forceinline__ void multiply_tile(float (&acc)[NT][MT][4], const uint4 (&wq)[NT], const uint32_t (&sc)[NT],
                                              const uint4 (&xv)[MT][2]) {
  using Ops = Half2Ops<T>;
  constexpr bool kExact = MT >= 2;
  const uint32_t mask = 0x000F000Fu, magic = Ops::kMagic;  // operands of lop3, not immediates (one per instruction)
  const uint32_t neg_offset[4] = {Ops::kNegOffset, Ops::kNegOffset, Ops::kNegOffset, Ops::kNegOffset};
  float start[MT][4];  // -(base + 8) * sum(x) of the lane's accumulator rows (zero when exact)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    start[mt][0] = start[mt][1] = start[mt][2] = start[mt][3] = 0.f;
    if constexpr (!kExact) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint4& lo = xv[mt][s >> 1];
        Ops::mma(start[mt], neg_offset, (s & 1) ? lo.z : lo.x, (s & 1) ? lo.w : lo.y);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < NT; ++c) {
    float sum[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) sum[mt][i] = start[mt][i];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t word = word_of(wq[c], s);
      uint32_t a[4] = {and_or(word, mask, magic),         // col g, inputs +0 +1
                       and_or(word >> 4, mask, magic),    // col g + 8
                       and_or(word >> 8, mask, magic),    // col g, inputs +2 +3
                       and_or(word >> 12, mask, magic)};  // col g + 8
      if constexpr (kExact) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = Ops::sub(a[i], Ops::kOffset);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4& lo = xv[mt][s >> 1];
        Ops::mma(sum[mt], a, (s & 1) ? lo.z : lo.x, (s & 1) ? lo.w : lo.y);
      }
    }
    const float s_lo = Ops::low(sc[c]), s_hi = Ops::high(sc[c]);  // columns g and g + 8
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      acc[c][mt][0] = fmaf(s_lo, sum[mt][0], acc[c][mt][0]);
      acc[c][mt][1] = fmaf(s_lo, sum[mt][1], acc[c][mt][1]);
      acc[c][mt][2] = fmaf(s_hi, sum[mt][2], acc[c][mt][2]);
      acc[c][mt][3] = fmaf(s_hi, sum[mt][3], acc[c][mt][3]);
    }
  }
}

// AWQ's input scale on a tile's activations: x * s rounded to 16 bits, as the reference computes it.
template <typename T, int MT>
__device__ __forceinline__ void scale_inputs(uint4 (&xv)[MT][2], const uint4& p0, const uint4& p1) {
  using Ops = Half2Ops<T>;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    uint4& a = xv[mt][0];
    uint4& b = xv[mt][1];
    a.x = Ops::mul(a.x, p0.x); a.y = Ops::mul(a.y, p0.y); a.z = Ops::mul(a.z, p0.z); a.w = Ops::mul(a.w, p0.w);
    b.x = Ops::mul(b.x, p1.x); b.y = Ops::mul(b.y, p1.y); b.z = Ops::mul(b.z, p1.z); b.w = Ops::mul(b.w, p1.w);
  }
}

// Where a block's sums go. Modes: 0, y [rows, n]; 1, silu(fc) * gate [rows, n / 2] (fc in a tile's columns
// 0-7, gate in 8-15); 2, RoPE + KV-cache write of a qkv layer (below). ``period`` (modes 0 and 2): the weight's
// columns are interleaved in blocks of 8 within segments of ``period`` columns, tile nt of a segment holding its
// columns 8 nt + c (tile column c < 8) and period / 2 + 8 nt + c - 8 (c >= 8); 0: tile nt holds 16 nt .. 16 nt + 15.
// With a head's size as the period, a lane holds both halves of a NeoX rotation pair (dims d and d + head / 2).
// Mode 2 (period = head size, heads nh q, then nkv k, then nkv v): each product is rounded to T (the unfused
// layer's output), q and k heads are rotated in float32 by the row's tables (``cos``, ``sin`` [rows, head] with
// sin's first half negated, row stride ld_cs) as fma(x, cos, x_rot * sin) and rounded once (the ops of Triton's
// rope kernel); q goes to ``q`` [rows, nh * head] (row stride ldq), k and v to the row's cache slot
// (``slots[r * ld_slot]``) of ``k_cache`` / ``v_cache`` [slots, nkv, head].
struct Epilogue {
  int mode, period;
  const void* cos;
  const void* sin;
  int ld_cs;
  const long long* slots;
  int ld_slot;
  void* q;
  int ldq;
  void* k_cache;
  void* v_cache;
  int nh, nkv;
};

// The residual add + RMSNorm between an o or down projection and the next int4 layer, without a kernel of its own
// (the ring kernel only, w4a16_pipe_fused_kernel; a parameter of its own: a larger Epilogue made the compiler unroll
// every kernel's epilogue less, 2-3 us slower a kernel on the H200). Producer (FUSE 1, after an o or down
// projection; see finish_add_norm): ``resid`` [rows, n] (row stride ld_resid) += the product, rounded to T;
// ``scaled`` [rows, n] (ld_scaled) = the new residual times ``norm_w`` [n] (the norm's weight), rounded to T;
// ``sums`` [rows, n / (16 NT)] float32: each block's sum of the new residual's squares per row (its columns).
// Consumer (FUSE 2, a qkv or fc + gate layer whose input is the producer's ``scaled``): ``in_sums`` [rows, in_blocks]
// (the producer's sums); each row's product is multiplied by rsqrt(sum / k + in_eps) in float32 before the epilogue
// (the norm's factor is the same for all of a row's inputs: it comes out of the sum).
struct Fused {
  void* resid;
  int ld_resid;
  void* scaled;
  int ld_scaled;
  const void* norm_w;
  float* sums;
  const float* in_sums;
  int in_blocks;
  float in_eps;
};

// Output column of tile nt's column g + 8 * half under ``period`` (mode 0).
__device__ __forceinline__ int column_of(int nt, int g, int half, int period) {
  if (period == 0) return 16 * nt + g + 8 * half;
  const int per = period >> 4;  // tiles of a segment
  return (nt / per) * period + half * (period >> 1) + 8 * (nt % per) + g;
}

// Mode 2 for one row and one rotation pair: tile nt's columns g (``lo``) and g + 8 (``hi``).
template <typename T>
__device__ __forceinline__ void rope_pair(const Epilogue& ep, int r, int nt, int g, float lo, float hi) {
  using Ops = Half2Ops<T>;
  const int hd = ep.period, half = hd >> 1, per = hd >> 4;
  const int head = nt / per, d = 8 * (nt % per) + g;
  const float x0 = Ops::to_float(Ops::from_float(lo)), x1 = Ops::to_float(Ops::from_float(hi));
  T r0, r1;
  if (head < ep.nh + ep.nkv) {
    const T* cs = static_cast<const T*>(ep.cos) + static_cast<size_t>(r) * ep.ld_cs;
    const T* sn = static_cast<const T*>(ep.sin) + static_cast<size_t>(r) * ep.ld_cs;
    // fma(x, cos, x_rot * sin), rounded once: the ops of llmc's Triton rope kernel (fused_triton.py), same bits
    r0 = Ops::from_float(__fmaf_rn(x0, Ops::to_float(cs[d]), __fmul_rn(x1, Ops::to_float(sn[d]))));
    r1 = Ops::from_float(__fmaf_rn(x1, Ops::to_float(cs[d + half]), __fmul_rn(x0, Ops::to_float(sn[d + half]))));
    if (head < ep.nh) {
      T* q = static_cast<T*>(ep.q) + static_cast<size_t>(r) * ep.ldq + head * hd;
      q[d] = r0;
      q[d + half] = r1;
      return;
    }
  } else {
    r0 = Ops::from_float(x0);
    r1 = Ops::from_float(x1);
  }
  const bool is_k = head < ep.nh + ep.nkv;
  const int kv = head - ep.nh - (is_k ? 0 : ep.nkv);
  const long long slot = ep.slots[static_cast<size_t>(r) * ep.ld_slot];
  T* dst = static_cast<T*>(is_k ? ep.k_cache : ep.v_cache) + (static_cast<size_t>(slot) * ep.nkv + kv) * hd;
  dst[d] = r0;
  dst[d + half] = r1;
}

// The block's result: the warps' partial sums (``partial``: [WARPS][NT * MT * 4][32] floats in shared memory,
// written by the caller) added in warp order, written as the epilogue says.
// RSTD: each row's sums times its pending input norm's factor first (``rstd``, shared memory: row_rstd); a template
// flag, so the other kernels compile as without it (a runtime check made their epilogue loops slower on the H200).
template <typename T, int MT, int NT, int WARPS, bool RSTD = false>
__device__ __forceinline__ void write_block(const float* partial, T* __restrict__ y, int ldy, int rows, int nt0,
                                           int row0, const Epilogue& ep, const float* rstd = nullptr) {
  using Ops = Half2Ops<T>;
  constexpr int PER_WARP = NT * MT * 4 * 32;
  // acc[c][mt][i] of lane (g, t): column g + 8 * (i >> 1) of tile nt0 + c, row 8 mt + 2 t + (i & 1) of the block.
  if (ep.mode != 0) {  // pairs: columns g and g + 8 of a tile, one row
    for (int idx = threadIdx.x; idx < NT * MT * 2 * 32; idx += WARPS * 32) {
      const int l = idx & 31, j = (idx >> 5) & 1, cm = idx >> 6, c = cm / MT, mt = cm % MT;
      float lo = 0.f, hi = 0.f;
#pragma unroll
      for (int wi = 0; wi < WARPS; ++wi) {
        lo += partial[wi * PER_WARP + (cm * 4 + j) * 32 + l];
        hi += partial[wi * PER_WARP + (cm * 4 + 2 + j) * 32 + l];
      }
      const int r = row0 + 8 * mt + 2 * (l & 3) + j;
      if (r >= rows) continue;
      if constexpr (RSTD) {
        lo *= rstd[r - row0];
        hi *= rstd[r - row0];
      }
      if (ep.mode == 1) {
        y[static_cast<size_t>(r) * ldy + 8 * (nt0 + c) + (l >> 2)] = Ops::from_float(silu(lo) * hi);
      } else {
        rope_pair<T>(ep, r, nt0 + c, l >> 2, lo, hi);
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < NT * MT * 4 * 32; idx += WARPS * 32) {
      const int l = idx & 31, i = (idx >> 5) & 3, cm = idx >> 7, c = cm / MT, mt = cm % MT;
      float v = 0.f;
#pragma unroll
      for (int wi = 0; wi < WARPS; ++wi) v += partial[wi * PER_WARP + (cm * 4 + i) * 32 + l];
      const int r = row0 + 8 * mt + 2 * (l & 3) + (i & 1);
      if constexpr (RSTD) v *= rstd[r - row0];
      if (r < rows)
        y[static_cast<size_t>(r) * ldy + column_of(nt0 + c, l >> 2, i >> 1, ep.period)] = Ops::from_float(v);
    }
  }
}

// A block's end, once its warps have issued their last reads of shared memory: it waits for all of them, puts each
// warp's sums there (``partial``, as write_block reads them) and writes the block's result.
template <typename T, int MT, int NT, int WARPS, bool RSTD = false>
__device__ __forceinline__ void finish_block(uint4* smem, const float (&acc)[NT][MT][4], T* __restrict__ y, int ldy,
                                             int rows, int nt0, int row0, const Epilogue& ep,
                                             const float* rstd = nullptr) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // every warp is done with the shared memory: it now holds the partial sums
  float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int c = 0; c < NT; ++c)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[(warp * NT * MT * 4 + (c * MT + mt) * 4 + i) * 32 + lane] = acc[c][mt][i];
  __syncthreads();
  write_block<T, MT, NT, WARPS, RSTD>(partial, y, ldy, rows, nt0, row0, ep, rstd);
}

// Two floats rounded (to nearest even) into one pair of T: low half = ``lo``.
__device__ __forceinline__ uint32_t pack_floats(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_floats(float lo, float hi, __half) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Mode 3: shared memory behind the warps' partial sums for the block's squares (8 MT rows x 16 NT columns, float32).
template <int MT, int NT>
__host__ __device__ constexpr int norm_smem_bytes() { return 8 * MT * 16 * NT * 4; }

// Elements of a block's result each thread writes (write_block's order: thread + j * threads, j < RES).
template <int MT, int NT, int WARPS>
__host__ __device__ constexpr int residual_count() { return (NT * MT * 128 + WARPS * 32 - 1) / (WARPS * 32); }

// Element ``idx`` of a block's result (write_block's mode-0 order): its row and column in the block.
template <int MT>
__device__ __forceinline__ void block_element(int idx, int& lr, int& lc) {
  const int l = idx & 31, i = (idx >> 5) & 3, cm = idx >> 7, c = cm / MT, mt = cm % MT;
  lr = 8 * mt + 2 * (l & 3) + (i & 1);
  lc = 16 * c + (l >> 2) + 8 * (i >> 1);
}

// Mode 3: this thread's residual values for the epilogue, read once the previous kernel is done (wait_prior_grid),
// so their latency hides behind the product.
template <typename T, int MT, int NT, int WARPS, int RES>
__device__ __forceinline__ void load_residual(const Fused& fz, T (&res)[RES], T (&wn)[RES], int rows, int nt0,
                                              int row0) {
#pragma unroll
  for (int j = 0; j < RES; ++j) {
    const int idx = threadIdx.x + j * WARPS * 32;
    int lr, lc;
    block_element<MT>(idx, lr, lc);
    const bool in = idx < NT * MT * 128 && row0 + lr < rows;
    res[j] = in ? static_cast<const T*>(fz.resid)[static_cast<size_t>(row0 + lr) * fz.ld_resid + 16 * nt0 + lc]
                : T(0.f);
    wn[j] = in ? static_cast<const T*>(fz.norm_w)[16 * nt0 + lc] : T(0.f);
  }
}

__device__ __forceinline__ float warp_sum(float v) {  // the same butterfly every time: deterministic
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Mode 3, a block's end: its result added to the residual stream (h = round(h + round(y)), as llmc's separate add +
// RMSNorm kernel does: the same bits), h times the next norm's weight (rounded: the next layer's input) and each
// row's sum of squares over the block's columns (added in column order: the bits do not depend on timing) for the
// next kernel, which finishes the norm in its epilogue (row_rstd). No block waits for another: a separate norm
// kernel's launch, wait and pass become a few stores here and a reduction of the row's sums there.
template <typename T, int MT, int NT, int WARPS, int RES>
__device__ __forceinline__ void finish_add_norm(uint4* smem, const float (&acc)[NT][MT][4], int rows, int nt0,
                                                int row0, const Fused& fz, const T (&res)[RES],
                                                const T (&wn)[RES]) {
  using Ops = Half2Ops<T>;
  constexpr int PER_WARP = NT * MT * 4 * 32, BW = 16 * NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // every warp is done with the shared memory (the ring and the input scale)
  float* partial = reinterpret_cast<float*>(smem);
  float* sq = partial + WARPS * PER_WARP;
#pragma unroll
  for (int c = 0; c < NT; ++c)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[(warp * NT * MT * 4 + (c * MT + mt) * 4 + i) * 32 + lane] = acc[c][mt][i];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < RES; ++j) {
    const int idx = threadIdx.x + j * WARPS * 32;
    if (idx >= NT * MT * 128) break;
    const int l = idx & 31, i = (idx >> 5) & 3, cm = idx >> 7;
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < WARPS; ++wi) v += partial[wi * PER_WARP + (cm * 4 + i) * 32 + l];
    int lr, lc;
    block_element<MT>(idx, lr, lc);
    float square = 0.f;
    if (row0 + lr < rows) {
      const T h = Ops::from_float(Ops::to_float(res[j]) + Ops::to_float(Ops::from_float(v)));
      static_cast<T*>(fz.resid)[static_cast<size_t>(row0 + lr) * fz.ld_resid + 16 * nt0 + lc] = h;
      const float f = Ops::to_float(h);
      static_cast<T*>(fz.scaled)[static_cast<size_t>(row0 + lr) * fz.ld_scaled + 16 * nt0 + lc] =
          Ops::from_float(f * Ops::to_float(wn[j]));
      square = f * f;
    }
    sq[lr * BW + lc] = square;
  }
  __syncthreads();
  for (int lr = warp; lr < 8 * MT; lr += WARPS) {
    if (row0 + lr >= rows) break;
    float s = 0.f;
    for (int c = lane; c < BW; c += 32) s += sq[lr * BW + c];
    s = warp_sum(s);
    if (lane == 0) fz.sums[static_cast<size_t>(row0 + lr) * gridDim.y + blockIdx.y] = s;
  }
}

// A pending input norm (Fused::in_sums), once the previous kernel is done: rsqrt(mean square + eps) of each of the
// block's rows, from the previous kernel's per-block sums (added in block order by a warp per row, so every block
// gets the same bits), into ``rstd`` (shared memory, 8 MT floats; 0 past the last row), which the epilogue
// multiplies the row's sums by (write_block). The caller synchronizes before reading it.
template <int MT, int WARPS>
__device__ __forceinline__ void row_rstd(const Fused& fz, float* rstd, int rows, int row0, int k) {
  constexpr int PER = (8 * MT + WARPS - 1) / WARPS;  // rows a warp takes: lr = warp + WARPS * i
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float s[PER];
  // every row's first 128 sums requested at once (one memory latency, not one per row), the rest after
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int lr = warp + WARPS * i;
    const float* row = fz.in_sums + static_cast<size_t>(row0 + lr) * fz.in_blocks;
    const bool in = lr < 8 * MT && row0 + lr < rows;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = in && lane + 32 * j < fz.in_blocks ? __ldcg(row + lane + 32 * j) : 0.f;
    s[i] = (v[0] + v[1]) + (v[2] + v[3]);
    for (int b = lane + 128; in && b < fz.in_blocks; b += 32) s[i] += __ldcg(row + b);
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int lr = warp + WARPS * i;
    const float total = warp_sum(s[i]);
    if (lane == 0 && lr < 8 * MT) rstd[lr] = row0 + lr < rows ? rsqrtf(total / static_cast<float>(k) + fz.in_eps) : 0.f;
  }
}

// The product, each warp streaming its input tiles through a ring of STAGES slots in shared memory (cp.async):
// slot j holds one input tile of the warp (tile kt = warp + WARPS * i, slot i % STAGES): for the NT column tiles NT
// x 32 weight words (one uint4 per lane) and NT x 32 scale pairs (one word per lane), then the tile's activations,
// MT x 2 x 32 uint4 (lane (g, t) copies x[row 8 mt + g, 16 t .. 16 t + 15] of the tile: exactly its B fragments).
// Each lane copies, and later reads, only its own words, so the warp never synchronizes; tile i + STAGES - 1 is
// requested (weights and activations alike) before tile i is multiplied, so both stay STAGES - 1 tiles in flight.
// AWQ's input scale (o and down) is copied whole into shared memory behind the ring once per block. The loop is
// unrolled by STAGES so slots are compile-time and every address moves by a constant step per tile: the loop is
// little more than the decoding and the mma. Blocks are ordered row block first (blockIdx.x), so the row blocks of
// one column tile run together and read its weight once from memory (the others hit L2). Shared memory (dynamic):
// the ring, reused for the warps' partial sums at the end, then the input scale.
// FUSE 0: the product; 1 and 2: a norm's producer and consumer (Fused; w4a16_pipe_fused_kernel).
template <typename T, int MT, int NT, int WARPS, int STAGES, int FUSE>
__device__ __forceinline__ void pipe_product(const T* __restrict__ x, int ldx, const uint4* __restrict__ w,
                                             const uint32_t* __restrict__ scales, const T* __restrict__ prequant,
                                             T* __restrict__ y, int ldy, int rows, int n, int k, int group_shift,
                                             const Epilogue& ep, const Fused& fz, int late_trigger) {
  extern __shared__ uint4 smem[];
  // a kernel launched after this one with programmatic serialization may start its blocks: now, or once this
  // block's loads are done (late_trigger)
  if (!late_trigger) allow_next_grid();
  constexpr int WSLOT = NT * 40;        // uint4s of a slot's weight words and scale pairs
  constexpr int SLOT = WSLOT + MT * 64;  // + its activations
  const int nt0 = blockIdx.y * NT, row0 = blockIdx.x * (8 * MT);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int ktiles = k >> 6, groups = ktiles >> group_shift;
  const int count = warp < ktiles ? (ktiles - warp + WARPS - 1) / WARPS : 0;  // this warp's input tiles

  // The next tile to request: column tile c's weight words at wreq + c * wcol, its scale pair at sreq + c * scol,
  // row tile mt's activations at xreq[mt] (two uint4). With WARPS even, the group of tile i is
  // (warp >> shift) + i * (WARPS >> shift).
  const size_t wcol = static_cast<size_t>(ktiles) * 32, scol = static_cast<size_t>(groups) * 8;
  const uint4* wreq = w + static_cast<size_t>(nt0) * wcol + warp * 32 + lane;
  const uint32_t* sreq = scales + static_cast<size_t>(nt0) * scol + (warp >> group_shift) * 8 + g;
  const int sstep = (WARPS >> group_shift) * 8;
  unsigned xbytes[MT];
  const uint4* xreq[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r = row0 + 8 * mt + g;
    xbytes[mt] = r < rows ? 16u : 0u;  // rows past the end are zero-filled
    xreq[mt] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(r < rows ? r : 0) * ldx + 16 * t + warp * 64);
  }
  // Shared addresses of this lane's words in slot j: column tile c's weights at wsh + 16 (j SLOT + 32 c), its scale
  // pair at ssh + 16 j SLOT + 4 * 32 c, row tile mt's activations at xsh + 16 (j SLOT + 64 mt) (+ 16 * 32).
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned ring = base + warp * (STAGES * SLOT * 16);
  const unsigned wsh = ring + lane * 16, ssh = ring + NT * 32 * 16 + lane * 4, xsh = ring + WSLOT * 16 + lane * 16;
  // Requests of tile ``i`` into slot j (zero bytes past the warp's last tile): the weight words and scale pairs,
  // then the activations; each moves its own pointers on by one tile of the warp.
  auto request_weights = [&](int j, int i) {
    const bool more = i < count;
    const unsigned wbytes = more ? 16u : 0u, sbytes = more ? 4u : 0u;
#pragma unroll
    for (int c = 0; c < NT; ++c) {
      cp_async16(wsh + 16 * (j * SLOT + 32 * c), wreq + c * wcol, wbytes);
      cp_async4(ssh + 16 * j * SLOT + 4 * 32 * c, sreq + c * scol, sbytes);
    }
    wreq += WARPS * 32;
    sreq += sstep;
  };
  auto request_inputs = [&](int j, int i) {
    const bool more = i < count;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const unsigned bytes = more ? xbytes[mt] : 0u;
      cp_async16_ca(xsh + 16 * (j * SLOT + 64 * mt), xreq[mt], bytes);
      cp_async16_ca(xsh + 16 * (j * SLOT + 64 * mt + 32), xreq[mt] + 1, bytes);
      xreq[mt] += WARPS * 8;
    }
  };
  // AWQ's input scale, whole, behind the ring (its own commit group, the oldest).
  const bool has_prequant = prequant != nullptr;
  constexpr int RING_BYTES = WARPS * STAGES * SLOT * 16, PARTIAL_BYTES = WARPS * NT * MT * 4 * 32 * 4;
  const unsigned pq = base + (RING_BYTES > PARTIAL_BYTES ? RING_BYTES : PARTIAL_BYTES);
  if (has_prequant) {
    const uint4* src = reinterpret_cast<const uint4*>(prequant);
    for (int i = threadIdx.x; i < (k >> 3); i += WARPS * 32) cp_async16_ca(pq + 16 * i, src + i, 16u);
    cp_async_commit();
  }
  // One commit group per tile (empty past the warp's last tile), so "tile i has landed" is always
  // cp.async.wait_group(STAGES - 1) after tile i + STAGES - 1 was requested. The first STAGES - 1 tiles' weights
  // do not depend on the previous kernel: they are requested before waiting for it (launched with programmatic
  // serialization, this kernel's blocks start while the previous one finishes), the activations only after.
  // Nothing is written to global memory before the wait either. The first group holds those weights too.
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) request_weights(j, j);
  wait_prior_grid();
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    request_inputs(j, j);
    cp_async_commit();
  }
  // FUSE 1 (mode 3): this thread's residual values and norm weights, requested behind the first activations;
  // FUSE 2: the rows' pending norm factors, behind the input scale (read in the epilogue, after its barriers)
  constexpr int RES = FUSE == 1 ? residual_count<MT, NT, WARPS>() : 1;
  T res[RES], wn[RES];
  if constexpr (FUSE == 1) load_residual<T, MT, NT, WARPS, RES>(fz, res, wn, rows, nt0, row0);
  float* rstd = reinterpret_cast<float*>(smem) + (pq - base + (has_prequant ? 2 * k : 0)) / 4;
  if constexpr (FUSE == 2) row_rstd<MT, WARPS>(fz, rstd, rows, row0, k);
  if (has_prequant) {  // every thread's share of the input scale has landed, then the block sees all of it
    cp_async_wait<STAGES - 1>();
    __syncthreads();
  }
  // This lane's input-scale words of tile i: pq + 128 (warp + WARPS i) + 32 t (two uint4).
  const unsigned psh = pq + 128 * warp + 32 * t;

  float acc[NT][MT][4];
#pragma unroll
  for (int c = 0; c < NT; ++c)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[c][mt][0] = acc[c][mt][1] = acc[c][mt][2] = acc[c][mt][3] = 0.f;

  for (int i0 = 0; i0 < count; i0 += STAGES) {
#pragma unroll
    for (int j = 0; j < STAGES; ++j) {  // tile i = i0 + j: slot j
      const int i = i0 + j;
      if (i >= count) break;
      request_weights((j + STAGES - 1) % STAGES, i + STAGES - 1);
      request_inputs((j + STAGES - 1) % STAGES, i + STAGES - 1);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
      uint4 wq[NT];
      uint32_t sc[NT];
      uint4 xv[MT][2];
#pragma unroll
      for (int c = 0; c < NT; ++c) {
        wq[c] = ld_shared16(wsh + 16 * (j * SLOT + 32 * c));
        sc[c] = ld_shared4(ssh + 16 * j * SLOT + 4 * 32 * c);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        xv[mt][0] = ld_shared16(xsh + 16 * (j * SLOT + 64 * mt));
        xv[mt][1] = ld_shared16(xsh + 16 * (j * SLOT + 64 * mt + 32));
      }
      if (has_prequant) {
        const unsigned at = psh + 128 * WARPS * i;
        scale_inputs<T, MT>(xv, ld_shared16(at), ld_shared16(at + 16));
      }
      multiply_tile<T, MT, NT>(acc, wq, sc, xv);
    }
  }

  cp_async_wait<0>();
  if (late_trigger) allow_next_grid();
  if constexpr (FUSE == 1) {
    finish_add_norm<T, MT, NT, WARPS, RES>(smem, acc, rows, nt0, row0, fz, res, wn);
  } else {
    finish_block<T, MT, NT, WARPS, FUSE == 2>(smem, acc, y, ldy, rows, nt0, row0, ep, rstd);
  }
}

template <typename T, int MT, int NT, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_pipe_kernel(const T* __restrict__ x, int ldx, const uint4* __restrict__ w, const uint32_t* __restrict__ scales,
                  const T* __restrict__ prequant, T* __restrict__ y, int ldy, int rows, int n, int k, int group_shift,
                  Epilogue ep, int late_trigger) {
  pipe_product<T, MT, NT, WARPS, STAGES, 0>(x, ldx, w, scales, prequant, y, ldy, rows, n, k, group_shift, ep,
                                            Fused{}, late_trigger);
}

template <typename T, int MT, int NT, int WARPS, int STAGES, int FUSE>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_pipe_fused_kernel(const T* __restrict__ x, int ldx, const uint4* __restrict__ w,
                        const uint32_t* __restrict__ scales, const T* __restrict__ prequant, T* __restrict__ y,
                        int ldy, int rows, int n, int k, int group_shift, Epilogue ep, int late_trigger, Fused fz) {
  pipe_product<T, MT, NT, WARPS, STAGES, FUSE>(x, ldx, w, scales, prequant, y, ldy, rows, n, k, group_shift, ep,
                                               fz, late_trigger);
}

// Dynamic shared memory of a pipe config without the input scale (which adds 2 K bytes behind it).
template <int MT, int NT, int WARPS, int STAGES>
constexpr int pipe_smem_bytes() {
  constexpr int ring = WARPS * STAGES * (NT * 40 + MT * 64) * 16;
  constexpr int partial = WARPS * NT * MT * 4 * 32 * 4;
  return ring > partial ? ring : partial;
}

// Tiles a warp of the register kernel holds at once (KPW): 16 column-tile words per thread at most, 8 with 16 warps
// (a thread then has 128 registers).
template <int NT, int WARPS>
constexpr int reg_cap() { return (WARPS == 16 ? 8 : 16) / NT; }

// The product without a ring ("stages" 0), for few rows: each warp loads its KPW input tiles of the block's NT
// column tiles (weight words and scale pairs) straight into registers, all of them before it waits for the previous
// kernel (they do not depend on it), so a whole layer's weight is in flight at once and, launched with
// programmatic serialization, while the previous kernel finishes. Input tile ``c * WARPS * KPW + i * WARPS + warp``
// of chunk c is the warp's i-th (adjacent warps read adjacent 512-byte tiles); a layer with more input tiles than
// the block's warps hold is done in chunks. After the wait, the block stages its rows of the chunk's activations
// in shared memory (times AWQ's input scale, rounded to 16 bits as the ring kernel does; each row padded by 16
// bytes so the B fragments load without bank conflicts), then multiplies as the ring kernel does
// (multiply_tile) and adds the warps' partial sums in warp order (write_block). On the H200 it is the fastest
// config of the 8B o projection at one row (32 layers: 163 vs 181 us), not of wider layers, whose blocks run in
// several waves with nothing in flight between a block's loads and the next block's.
template <typename T, int MT, int NT, int WARPS, int KPW>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_reg_kernel(const T* __restrict__ x, int ldx, const uint4* __restrict__ w, const uint32_t* __restrict__ scales,
                 const T* __restrict__ prequant, T* __restrict__ y, int ldy, int rows, int n, int k, int group_shift,
                 Epilogue ep, int late_trigger) {
  using Ops = Half2Ops<T>;
  extern __shared__ uint4 smem[];
  if (!late_trigger) allow_next_grid();
  constexpr int CHUNK = WARPS * KPW;  // input tiles of a chunk
  const int nt0 = blockIdx.y * NT, row0 = blockIdx.x * (8 * MT);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int ktiles = k >> 6, groups = ktiles >> group_shift;
  const int block_rows = min(8 * MT, rows - row0);
  const int xstride = min(CHUNK, ktiles) * 64 + 8;  // T elements of a staged row
  const size_t wcol = static_cast<size_t>(ktiles) * 32, scol = static_cast<size_t>(groups) * 8;
  const uint4* wbase = w + static_cast<size_t>(nt0) * wcol + lane;
  const uint32_t* sbase = scales + static_cast<size_t>(nt0) * scol + g;
  uint4 wq[KPW][NT];
  uint32_t sc[KPW][NT];
  auto load = [&](int chunk) {
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
      const int kt = chunk * CHUNK + i * WARPS + warp;
#pragma unroll
      for (int c = 0; c < NT; ++c) {
        if (kt < ktiles) {
          wq[i][c] = ld_stream16(wbase + c * wcol + static_cast<size_t>(kt) * 32);
          sc[i][c] = ld_stream4(sbase + c * scol + (kt >> group_shift) * 8);
        } else {
          wq[i][c] = make_uint4(0u, 0u, 0u, 0u);
          sc[i][c] = 0u;
        }
      }
    }
  };
  const int chunks = (ktiles + CHUNK - 1) / CHUNK;
  load(0);
  if (late_trigger && chunks == 1) allow_next_grid();
  wait_prior_grid();
  const unsigned xs = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  float acc[NT][MT][4];
#pragma unroll
  for (int c = 0; c < NT; ++c)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[c][mt][0] = acc[c][mt][1] = acc[c][mt][2] = acc[c][mt][3] = 0.f;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    if (chunk > 0) {
      load(chunk);
      if (late_trigger && chunk == chunks - 1) allow_next_grid();
      __syncthreads();  // every warp is done with the previous chunk's activations
    }
    const int in0 = chunk * CHUNK * 64, per_row = min(CHUNK * 64, k - in0) >> 3;  // uint4s of a staged row
    for (int r = 0; r < block_rows; ++r) {
      const T* src = x + static_cast<size_t>(row0 + r) * ldx + in0;
      for (int c8 = threadIdx.x; c8 < per_row; c8 += WARPS * 32) {
        uint4 v = *reinterpret_cast<const uint4*>(src + 8 * c8);
        if (prequant != nullptr) {
          const uint4 p = *reinterpret_cast<const uint4*>(prequant + in0 + 8 * c8);
          v.x = Ops::mul(v.x, p.x); v.y = Ops::mul(v.y, p.y); v.z = Ops::mul(v.z, p.z); v.w = Ops::mul(v.w, p.w);
        }
        st_shared16(xs + 2 * (r * xstride + 8 * c8), v);
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
      const int local = i * WARPS + warp;
      if (chunk * CHUNK + local >= ktiles) break;  // the same for the whole warp
      uint4 xv[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (8 * mt + g < block_rows) {
          const unsigned at = xs + 2 * ((8 * mt + g) * xstride + 64 * local + 16 * t);
          xv[mt][0] = ld_shared16(at);
          xv[mt][1] = ld_shared16(at + 16);
        } else {
          xv[mt][0] = xv[mt][1] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      multiply_tile<T, MT, NT>(acc, wq[i], sc[i], xv);
    }
  }
  finish_block<T, MT, NT, WARPS>(smem, acc, y, ldy, rows, nt0, row0, ep);
}

// The effective weight [K, N] (q * s * prequant in float, rounded once) for prefill steps (cuBLAS multiplies it).
// A block of 32 TILES threads takes TILES column tiles x KT input tiles, staged in shared memory as [input tile]
// [row quad][column tile][column]: the 8 words (one per column) that hold a row quad of a tile's 16 columns are two
// 16-byte loads. Each thread takes one (column tile, column half, row quad) per input tile and writes 4 rows x 8
// columns, one 16-byte streaming store each (the scratch is read once, by the next GEMM); a warp's stores cover
// 2 rows x (TILES x 32) contiguous bytes (or 16-byte pieces of them with ``period``: the columns as the product's
// epilogue maps them, see Epilogue; fc + gate layers, period n, write [fc | gate]). A nibble becomes a float exactly through
// the exponent trick (no integer conversion). Launched with programmatic serialization (sm_90+), a block reads its
// packed tiles while the previous kernel of the stream finishes and waits for it before writing: the scratch it
// overwrites was the previous layer's GEMM operand.
template <typename T, int TILES, int KT>
__global__ void __launch_bounds__(32 * TILES)
w4a16_mma_dequant_kernel(const uint4* __restrict__ w, const uint32_t* __restrict__ scales,
                         const T* __restrict__ prequant, T* __restrict__ out, int n, int k, int group_shift,
                         int period) {
  using Ops = Half2Ops<T>;
  constexpr int THREADS = 32 * TILES;
  const int ktiles = k >> 6, ntiles = n >> 4;
  const int kt0 = blockIdx.y * KT, nt0 = blockIdx.x * TILES;
  __shared__ __align__(16) uint32_t words[KT][16][TILES][8];
  __shared__ uint32_t pairs[KT][TILES][8];
  for (int i = threadIdx.x; i < KT * TILES * 32; i += THREADS) {
    const int l = i & 31, c = (i >> 5) % TILES, q = (i >> 5) / TILES;
    if (nt0 + c < ntiles && kt0 + q < ktiles) {
      const uint4 v = w[(static_cast<size_t>(nt0 + c) * ktiles + kt0 + q) * 32 + l];
      const int g = l >> 2, t = l & 3;  // lane 4 g + t: columns g and g + 8 of row quads 4 t .. 4 t + 3
      words[q][4 * t][c][g] = v.x;
      words[q][4 * t + 1][c][g] = v.y;
      words[q][4 * t + 2][c][g] = v.z;
      words[q][4 * t + 3][c][g] = v.w;
    }
  }
  for (int i = threadIdx.x; i < KT * TILES * 8; i += THREADS) {
    const int c = (i >> 3) % TILES, q = (i >> 3) / TILES;
    if (nt0 + c < ntiles && kt0 + q < ktiles)
      pairs[q][c][i & 7] =
          scales[(static_cast<size_t>(nt0 + c) * (ktiles >> group_shift) + ((kt0 + q) >> group_shift)) * 8 + (i & 7)];
  }
  __syncthreads();
  wait_prior_grid();  // every kernel before this one has finished (a no-op on a plain launch)
  const int piece = threadIdx.x % (2 * TILES), rq = threadIdx.x / (2 * TILES);  // row quad 0..15
  const int c = piece >> 1, h = piece & 1, nt = nt0 + c;
  if (nt >= ntiles) return;
  const int col = column_of(nt, 0, h, period);
#pragma unroll
  for (int q = 0; q < KT; ++q) {
    if (kt0 + q >= ktiles) break;
    const uint4 lo = *reinterpret_cast<const uint4*>(&words[q][rq][c][0]);
    const uint4 hi = *reinterpret_cast<const uint4*>(&words[q][rq][c][4]);
    const uint32_t wd[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float s_col[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) s_col[g] = h ? Ops::high(pairs[q][c][g]) : Ops::low(pairs[q][c][g]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int kin = 64 * (kt0 + q) + 4 * rq + kk;
      const int shift = 4 * (h | ((kk >> 1) << 1) | ((kk & 1) << 2));  // the nibble of (column g + 8 h, input kk)
      const float p = prequant != nullptr ? Ops::to_float(prequant[kin]) : 1.0f;
      float v[8];
#pragma unroll
      for (int g = 0; g < 8; ++g) {  // 2^23 + u as a float, minus 2^23 + 8: exactly u - 8
        const float qf = __uint_as_float(0x4B000000u | ((wd[g] >> shift) & 0xFu)) - 8388616.0f;
        v[g] = qf * s_col[g] * p;
      }
      const uint4 packed = {pack_floats(v[0], v[1], T()), pack_floats(v[2], v[3], T()),
                            pack_floats(v[4], v[5], T()), pack_floats(v[6], v[7], T())};
      __stcs(reinterpret_cast<uint4*>(out + static_cast<size_t>(kin) * n + col), packed);
    }
  }
}

// Launches on ``stream`` (more than 48 KB of dynamic shared memory must be allowed per kernel first). ``pdl``:
// with programmatic stream serialization (sm_90+), so the kernel's blocks may start before the previous kernel of
// the stream has finished; the kernel must then wait for it (wait_prior_grid) before it reads that kernel's output
// or writes anything. CUDA graphs capture the launch with a programmatic edge.
template <typename... Params, typename... Args>
int launch(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
           Args... args) {
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  if (!pdl) {
    kernel<<<grid, threads, smem, stream>>>(args...);
    return static_cast<int>(cudaGetLastError());
  }
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

constexpr int kMaxSmem = 200 * 1024;  // dynamic shared memory a pipe config's ring may take
constexpr int kMaxBlockSmem = 227 * 1024;  // what the H100/H200 allow a block (ring + input scale)

struct Call {
  const void* x; int ldx; const void* w; const void* scales; const void* prequant; void* y; int ldy;
  int rows, n, k, group_shift;
  Epilogue ep;
  int pdl;  // 0: plain launch; 1: programmatic, dependents may start at once; 2: once each block's loads are done
  cudaStream_t stream;
  float* partials; long long partials_size;  // split-K: float32 sums, and their capacity (elements)
  int* counters; int counters_size;  // split-K: one arrival counter per output tile (zero between launches)
  int fuse;  // 0; 1: add + a norm's sums (FUSE 1, sums in partials); 2: the input's norm pending (FUSE 2)
  Fused fz;
};

// A product kernel (the ring or the register kernel: one signature) on the call's grid, 8 MT rows x NT column tiles
// a block.
template <typename T, int MT, int NT, typename Kernel, typename... Extra>
int launch_product(Kernel kernel, int threads, int smem, const Call& a, Extra... extra) {
  const dim3 grid((a.rows + 8 * MT - 1) / (8 * MT), a.n / (16 * NT));
  return launch(kernel, grid, threads, smem, a.stream, a.pdl != 0, static_cast<const T*>(a.x), a.ldx,
                static_cast<const uint4*>(a.w), static_cast<const uint32_t*>(a.scales),
                static_cast<const T*>(a.prequant), static_cast<T*>(a.y), a.ldy, a.rows, a.n, a.k, a.group_shift,
                a.ep, a.pdl == 2 ? 1 : 0, extra...);
}

template <typename T, int MT, int NT, int WARPS, int STAGES>
int launch_t(const Call& a) {
  constexpr int smem = pipe_smem_bytes<MT, NT, WARPS, STAGES>();
  // 16 warps cap a thread at 128 registers: enough (no spills) for up to 2 (row tile, column tile) pairs
  if constexpr ((WARPS == 16 && MT * NT > 2) || smem > kMaxSmem) {
    return -1;
  } else {
    int total = smem + (a.prequant != nullptr ? 2 * a.k : 0);  // + the input scale
    if (a.fuse == 1) {  // the squares behind the partial sums (over the ring and input scale, done by then)
      constexpr int partial = WARPS * NT * MT * 4 * 32 * 4 + norm_smem_bytes<MT, NT>();
      total = total > partial ? total : partial;
      if (a.rows * static_cast<long long>(a.n / (16 * NT)) > a.partials_size) return -1;
    }
    if (a.fuse == 2) {  // the rows' norm factors behind the ring (and input scale)
      if (a.fz.in_blocks <= 0) return -1;
      total += 8 * MT * 4;
    }
    if ((a.n / 16) % NT || total > kMaxBlockSmem) return -1;
    if (a.fuse) {
      if constexpr (STAGES == 8) {
        return -1;  // not instantiated: no tuned decode config has 8 stages
      } else {
        Fused fz = a.fz;
        fz.sums = a.partials;
        return a.fuse == 1 ? launch_product<T, MT, NT>(w4a16_pipe_fused_kernel<T, MT, NT, WARPS, STAGES, 1>,
                                                       WARPS * 32, total, a, fz)
                           : launch_product<T, MT, NT>(w4a16_pipe_fused_kernel<T, MT, NT, WARPS, STAGES, 2>,
                                                       WARPS * 32, total, a, fz);
      }
    }
    return launch_product<T, MT, NT>(w4a16_pipe_kernel<T, MT, NT, WARPS, STAGES>, WARPS * 32, total, a);
  }
}

// The register kernel with KPW tiles per warp: dynamic shared memory for the block's rows of one chunk of
// activations (or the warps' partial sums, if larger).
template <typename T, int MT, int NT, int WARPS, int KPW>
int launch_reg(const Call& a) {
  const int ktiles = a.k >> 6;
  const int staged = min(8 * MT, a.rows) * ((WARPS * KPW < ktiles ? WARPS * KPW : ktiles) * 64 + 8) * 2;
  const int partial = WARPS * NT * MT * 4 * 32 * 4;
  const int smem = staged > partial ? staged : partial;
  if ((a.n / 16) % NT || smem > kMaxBlockSmem || a.fuse) return -1;  // the ring kernel's
  return launch_product<T, MT, NT>(w4a16_reg_kernel<T, MT, NT, WARPS, KPW>, WARPS * 32, smem, a);
}

// KPW: the warp's share of the input tiles rounded up to a power of two, at most reg_cap (more: chunks). Only KPW
// values up to reg_cap are instantiated (the switch cannot reach the others).
template <typename T, int MT, int NT, int WARPS>
int launch_registers(const Call& a) {
  if constexpr (MT > 2) {
    return -1;
  } else {
    constexpr int cap = reg_cap<NT, WARPS>();
    const int need = ((a.k >> 6) + WARPS - 1) / WARPS;
    int kpw = 1;
    while (kpw < need && kpw < cap) kpw *= 2;
    switch (kpw) {
      case 1: return launch_reg<T, MT, NT, WARPS, 1>(a);
      case 2: return launch_reg<T, MT, NT, WARPS, 2>(a);
      case 4: return launch_reg<T, MT, NT, WARPS, (cap >= 4 ? 4 : 1)>(a);
      case 8: return launch_reg<T, MT, NT, WARPS, (cap >= 8 ? 8 : 1)>(a);
      case 16: return launch_reg<T, MT, NT, WARPS, (cap >= 16 ? 16 : 1)>(a);
      default: return -1;
    }
  }
}

template <typename T, int MT, int NT, int WARPS>
int launch_stages(int stages, const Call& a) {
  switch (stages) {
    case 0: return launch_registers<T, MT, NT, WARPS>(a);
    case 2: return launch_t<T, MT, NT, WARPS, 2>(a);
    case 4: return launch_t<T, MT, NT, WARPS, 4>(a);
    case 8: return launch_t<T, MT, NT, WARPS, 8>(a);
    default: return -1;
  }
}

template <typename T, int MT, int NT>
int launch_warps(int warps, int stages, const Call& a) {
  switch (warps) {
    case 4: return launch_stages<T, MT, NT, 4>(stages, a);
    case 8: return launch_stages<T, MT, NT, 8>(stages, a);
    case 16: return launch_stages<T, MT, NT, 16>(stages, a);
    default: return -1;
  }
}

template <typename T, int MT>
int launch_cols(int ntile, int warps, int stages, const Call& a) {
  switch (ntile) {
    case 1: return launch_warps<T, MT, 1>(warps, stages, a);
    case 2: return launch_warps<T, MT, 2>(warps, stages, a);
    case 4: return launch_warps<T, MT, 4>(warps, stages, a);
    default: return -1;
  }
}

// ---- The warpgroup kernel (sm_90a): wgmma with the weight as the A operand in registers ----
//
// For 8-256 rows a block, where the ring kernel's warps each stream their own copy of the activations and run out of
// registers (M = 64: 234 a thread, 2 warps a scheduler). y^T = W x^T as above, with Hopper's warpgroup mma
// (wgmma.m64nNk16, N = the block's rows, up to 64 per instruction): a warpgroup (4 warps) multiplies 64 weight
// columns (column tiles 4 a + w, w its warp) by the block's rows of activations, which sit once in shared memory
// for all its warpgroups. The packed layout is pack_mma's, unchanged: a warp's 16-byte words of a tile are exactly
// its A fragments of the tile's four k-steps (wgmma's register A fragment is mma.m16n8k16's, per warp), decoded to
// ``q * s`` rounded to 16 bits, as the prefill's dequantized weight (the accumulator runs over the whole input, so
// the group scale cannot multiply a group's sum as in the ring kernel). The activations (the B operand, K-major,
// 128-byte swizzle) go to shared memory 4 bytes at a time, in the k order the layout gives each k-step
// ({2t, 2t+1, 2t+8, 2t+9} -> 16 t + 4 s + {0..3}): loaded 16 bytes at a time into registers a chunk ahead, stored
// as four words after the chunk's barrier, then made visible to the tensor cores (the async proxy) by a fence
// that finds no load of the thread in flight (one that did waited for them: a memory latency per chunk; 4-byte
// cp.async, one request per pair, was slower still). A stage is a chunk of 64 inputs: the weights of chunk
// i + STAGES - 2 are requested (cp.async) while chunk i is multiplied, and chunk i's wgmma run while chunk i + 1
// is decoded (two sets of A registers). One block barrier per chunk. AWQ's input scale (o, down) multiplies the
// decoded weight: round(round(q s) p).
// Split-K (SPLITS > 1; layers whose blocks would be too few for the multiprocessors, each running all its chunks
// serially): block z of a tile takes the z-th of SPLITS contiguous shares of the chunks (ceil(chunks / SPLITS)
// each; the last ones may be empty), writes its float32 sums to ``partials`` and counts itself in ``counters``
// (one per output tile); the tile's last block to arrive adds the SPLITS sums in split order (the bits do not
// depend on the order of arrival), resets the counter for the next launch and runs the epilogue.

// wgmma_rs(d, a, desc, T()): d += A (the warpgroup's registers a) x B (the shared-memory matrix ``desc``), m64nNk16
// for N = 2 x the accumulators a thread holds (8-64), f32 accumulators, T (bf16 or fp16) inputs.
#define LLMC_F4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define LLMC_WGMMA_RS_T(NB, TY, CT, ACC, REST, ...)                                                          \
  __device__ __forceinline__ void wgmma_rs(float (&d)[NB / 2], const uint32_t (&a)[4], uint64_t desc, CT) {   \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #NB "k16.f32." TY "." TY " {" ACC "}, " REST ", 1, 1, 1, 0;\n" \
                 : __VA_ARGS__                                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                   \
  }
#define LLMC_WGMMA_RS(NB, ACC, REST, ...)                          \
  LLMC_WGMMA_RS_T(NB, "bf16", __nv_bfloat16, ACC, REST, __VA_ARGS__) \
  LLMC_WGMMA_RS_T(NB, "f16", __half, ACC, REST, __VA_ARGS__)
LLMC_WGMMA_RS(8, "%0, %1, %2, %3",
              "{%4, %5, %6, %7}, %8", LLMC_F4(0))
LLMC_WGMMA_RS(16, "%0, %1, %2, %3, %4, %5, %6, %7",
              "{%8, %9, %10, %11}, %12", LLMC_F4(0), LLMC_F4(4))
LLMC_WGMMA_RS(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
              "{%16, %17, %18, %19}, %20", LLMC_F4(0), LLMC_F4(4), LLMC_F4(8), LLMC_F4(12))
LLMC_WGMMA_RS(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
              "{%32, %33, %34, %35}, %36", LLMC_F4(0), LLMC_F4(4), LLMC_F4(8), LLMC_F4(12), LLMC_F4(16), LLMC_F4(20),
              LLMC_F4(24), LLMC_F4(28))
#undef LLMC_WGMMA_RS
#undef LLMC_WGMMA_RS_T
#undef LLMC_F4

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// cp.async's writes (generic proxy) made visible to wgmma's reads of shared memory (async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The accumulators are written by the tensor cores behind the compiler's back: pin them around the waits.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// Shared-memory matrix descriptor of a K-major operand with the 128-byte swizzle: rows of 128 bytes, 8-row groups
// 1,024 bytes apart (the stride byte offset); the leading offset is unused in this mode.
__device__ __forceinline__ uint64_t sw128_desc(unsigned addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ uint32_t dup_low(uint32_t v) { return __byte_perm(v, v, 0x1010); }
__device__ __forceinline__ uint32_t dup_high(uint32_t v) { return __byte_perm(v, v, 0x3232); }

// Makes v opaque to the compiler from here on (an empty asm that may change it): v stays in a register instead of
// being recomputed from what it was computed from.
__device__ __forceinline__ void opaque(unsigned& v) { asm volatile("" : "+r"(v)); }
__device__ __forceinline__ void opaque(int& v) { asm volatile("" : "+r"(v)); }
template <typename P>
__device__ __forceinline__ void opaque(const P*& p) { asm volatile("" : "+l"(p)); }

// Split-K's end for a block of THREADS threads holding COUNT float32 sums each (``acc``): its sums go to
// ``partials`` ([tile][split][COUNT][THREADS], so a warp's stores are contiguous), then the block counts itself in
// ``counters[tile]`` (tile: the block's (x, y)). True for the tile's last block, whose ``acc`` then holds the sum
// of the SPLITS shares added in split order (its own from registers), after it reset the counter to 0 for the next
// launch; the other blocks are done. Every wgmma of the block must be waited for: the flag goes through shared
// memory at ``flag``.
template <int SPLITS, int THREADS, int COUNT>
__device__ __forceinline__ bool add_splits(float (&acc)[COUNT], float* __restrict__ partials,
                                           int* __restrict__ counters, unsigned flag) {
  constexpr int count = COUNT;
  const int tid = threadIdx.x, tile = blockIdx.y * gridDim.x + blockIdx.x, split = blockIdx.z;
  float* base = partials + static_cast<size_t>(tile) * SPLITS * count * THREADS + tid;
#pragma unroll
  for (int e = 0; e < count; ++e) base[(static_cast<size_t>(split) * count + e) * THREADS] = acc[e];
  __threadfence();  // the sums are visible device-wide before the count says so
  __syncthreads();
  if (tid == 0) {
    const int last = atomicAdd(counters + tile, 1) == SPLITS - 1;
    if (last) counters[tile] = 0;  // every split has arrived: nothing else touches it in this launch
    st_shared4(flag, last);
  }
  __syncthreads();
  if (!ld_shared4(flag)) return false;
  __threadfence();
#pragma unroll
  for (int e = 0; e < count; ++e) {
    float sum = 0.f;
#pragma unroll
    for (int z = 0; z < SPLITS; ++z)
      sum += z == split ? acc[e] : __ldcg(base + (static_cast<size_t>(z) * count + e) * THREADS);
    acc[e] = sum;
  }
  return true;
}

// T, R rows a block (NB = min(R, 64) per wgmma, R / NB of them per k-step), WG warpgroups of NA A tiles (64 columns)
// each, STAGES >= 3 chunks of 64 inputs in shared memory.
template <typename T, int R, int WG, int NA, int STAGES, int SPLITS>
__global__ void __launch_bounds__(WG * 128)
w4a16_wgmma_kernel(const T* __restrict__ x, int ldx, const uint4* __restrict__ w, const uint32_t* __restrict__ scales,
                   const T* __restrict__ prequant, T* __restrict__ y, int ldy, int rows, int n, int k, int group_shift,
                   Epilogue ep, int late_trigger, float* __restrict__ partials, int* __restrict__ counters) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Ops = Half2Ops<T>;
  constexpr int NB = R < 64 ? R : 64, RB = R / NB, THREADS = WG * 128, D = STAGES - 2;
  constexpr int XSTAGE = R * 128, WSTAGE = THREADS * NA * 16, SSTAGE = THREADS * NA * 4;
  extern __shared__ __align__(16) unsigned char wg_smem[];
  if (!late_trigger) allow_next_grid();
  const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(wg_smem));
  const unsigned xs = (raw + 1023u) & ~1023u;  // the swizzled activations: 1,024-byte aligned
  const unsigned ws = xs + STAGES * XSTAGE, ss = ws + STAGES * WSTAGE, ps = ss + STAGES * SSTAGE;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wgi = warp >> 2, wq = warp & 3;
  const int ktiles = k >> 6, groups = ktiles >> group_shift;
  const int nt0 = blockIdx.y * (4 * WG * NA), row0 = blockIdx.x * R;
  // this block's chunks [kbeg, kend): all of them, or its split's share (possibly none)
  const int share = (ktiles + SPLITS - 1) / SPLITS;
  const int kbeg = min(ktiles, static_cast<int>(blockIdx.z) * share), kend = min(ktiles, kbeg + share);
  int ct[NA];  // this warp's column tile of A tile a
#pragma unroll
  for (int a = 0; a < NA; ++a) ct[a] = nt0 + (wgi * NA + a) * 4 + wq;
  // Per-thread addresses, fixed for the whole loop (a chunk only moves them by a constant): the thread's weight
  // words of chunk 0 (one 16-byte word per A tile, 512 bytes a chunk further each chunk) and scale pairs.
  const uint4* wsrc[NA];
  const uint32_t* ssrc[NA];
#pragma unroll
  for (int a = 0; a < NA; ++a) {
    wsrc[a] = w + static_cast<size_t>(ct[a]) * ktiles * 32 + lane;
    ssrc[a] = scales + static_cast<size_t>(ct[a]) * groups * 8 + g;
  }
  unsigned wdst = ws + tid * NA * 16, sdst = ss + tid * NA * 4;
  auto request_weights = [&](int i) {  // chunks past the last read nothing (their slots are never used)
    const int j = i % STAGES;
    const unsigned w16 = i < kend ? 16u : 0u, s4 = i < kend ? 4u : 0u;
#pragma unroll
    for (int a = 0; a < NA; ++a) {
      cp_async16(wdst + j * WSTAGE + a * 16, wsrc[a] + i * 32, w16);
      cp_async4(sdst + j * SSTAGE + a * 4, ssrc[a] + (i >> group_shift) * 8, s4);
    }
  };
  // Activations: the chunk's pair P of inputs (2P, 2P + 1 = 16 t' + 4 s' + 2 h' + e) goes to k-step s', slot
  // 2 t' + 8 h' + e: byte 32 s' + 16 h' + 4 t' of the row, before the swizzle. 8 inputs (16 bytes) per load,
  // thread f of the chunk's 8 R pieces (row f / 8, inputs 8 (f % 8) ..), loaded into registers one chunk ahead and
  // stored as four 4-byte words, each to its k-step's slot: pair q of the piece goes to 16-byte chunk 4 h'' + q of
  // the row (h'' = f % 2), word t' = (f % 8) / 2, then the swizzle. A warp
  // stores 4 consecutive rows: no bank conflicts. Thread f's pieces are f + THREADS li: rows THREADS / 8 apart (a
  // multiple of 8, so the swizzle and the four store offsets are the thread's own for every li). Rows past the
  // last are read from the last row (their sums are never written).
  constexpr int LOADS = (8 * R + THREADS - 1) / THREADS, RSTEP = THREADS / 8;
  static_assert(RSTEP % 8 == 0, "the swizzle of a thread's rows must not depend on li");
  const int rr0 = tid >> 3, piece = tid & 7;
  const bool stores = (8 * R) % THREADS == 0 || rr0 < R;  // R = 8 with 2 warpgroups: half the threads
  int xoff[LOADS];  // element offset of piece li in chunk 0
#pragma unroll
  for (int li = 0; li < LOADS; ++li) {
    const int r = min(row0 + rr0 + RSTEP * li, rows - 1);
    xoff[li] = r * ldx + 8 * piece;
  }
  // Shared offset of pair 0 of piece 0 in stage 0 (+ RSTEP * 128 per li); pair q's is this one with bits 4-5 xor q
  // (the swizzle only flips bits 4-6 of an offset whose other parts are multiples of 128 or below 16).
  unsigned xdst0 = xs + rr0 * 128 + 4 * (piece >> 1) + (((4 * (piece & 1)) ^ (rr0 & 7)) << 4);
  uint4 xr[LOADS];
  auto load_inputs = [&](int i) {  // chunks past the last load nothing (their slots are never used)
    const T* src = x + 64 * i;
#pragma unroll
    for (int li = 0; li < LOADS; ++li)
      if (stores && i < kend) xr[li] = *reinterpret_cast<const uint4*>(src + xoff[li]);
  };
  auto store_inputs = [&](int i) {
    const unsigned stage = (i % STAGES) * XSTAGE;
    if (!stores) return;
#pragma unroll
    for (int li = 0; li < LOADS; ++li) {
      const unsigned at = stage + li * RSTEP * 128;
      st_shared4(xdst0 + at, xr[li].x);
      st_shared4((xdst0 ^ 16u) + at, xr[li].y);
      st_shared4((xdst0 ^ 32u) + at, xr[li].z);
      st_shared4((xdst0 ^ 48u) + at, xr[li].w);
    }
  };
  const bool has_prequant = prequant != nullptr;
  unsigned pqa = ps + 32 * t;  // the thread's pairs of the input scale in chunk 0
  if (has_prequant) {  // AWQ's input scale of the block's chunks (8 uint4 a chunk), in the first commit group
    const uint4* src = reinterpret_cast<const uint4*>(prequant);
    for (int i = 8 * kbeg + tid; i < 8 * kend; i += THREADS) cp_async16_ca(ps + 16 * i, src + i, 16u);
  }
  for (int i = 0; i < D; ++i) request_weights(kbeg + i);  // weights do not depend on the previous kernel
  wait_prior_grid();
  for (int i = 0; i < D; ++i) {
    load_inputs(kbeg + i);
    store_inputs(kbeg + i);
    cp_async_commit();  // chunk kbeg + i's weights (the first group: all prologue weights and the input scale)
  }
  fence_async_shared();
  load_inputs(kbeg + D);

  float acc[NA][RB][NB / 2];
#pragma unroll
  for (int a = 0; a < NA; ++a)
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int e = 0; e < NB / 2; ++e) acc[a][rb][e] = 0.f;
  uint32_t A[2][NA][4][4];
  const uint32_t mask = 0x000F000Fu, magic = Ops::kMagic;

  // Chunk i into A set P (P = i & 1): wait for its copies, request chunk i + D, decode, multiply.
  auto step = [&](int i, auto parity) {
    constexpr int P = decltype(parity)::value;
    const int j = i % STAGES;
    // The thread's addresses as opaque values: ptxas would otherwise recompute them from the thread index in every
    // other chunk (registers are tight): about 27 instructions a chunk of the loop's ~243 at 64 rows (cuobjdump).
    opaque(xdst0);
    opaque(wdst);
    opaque(sdst);
#pragma unroll
    for (int li = 0; li < LOADS; ++li) opaque(xoff[li]);
#pragma unroll
    for (int a = 0; a < NA; ++a) {
      opaque(wsrc[a]);
      opaque(ssrc[a]);
    }
    opaque(pqa);
    cp_async_wait<D - 1>();  // this thread's copies of chunk i's weights have landed
    __syncthreads();  // every thread stored (and fenced) chunk i's activations; chunk i - 2's wgmma are done
    // chunk i + D's activations (loaded during the previous chunk) into the slot chunk i - 2 left, made visible to
    // the tensor cores' reads (the async proxy) by this thread's fence, then that chunk's weights requested and the
    // next chunk's activations loaded. The fence waits for this thread's loads into registers still in flight:
    // there are none here (placed after those loads, it cost a memory latency per chunk).
    store_inputs(i + D);
    fence_async_shared();
    request_weights(i + D);
    cp_async_commit();
    load_inputs(i + D + 1);
    uint4 pq0, pq1;
    if (has_prequant) {
      pq0 = ld_shared16(pqa + 128 * i);
      pq1 = ld_shared16(pqa + 128 * i + 16);
    }
#pragma unroll
    for (int a = 0; a < NA; ++a) {
      const uint4 words = ld_shared16(ws + j * WSTAGE + (tid * NA + a) * 16);
      const uint32_t sc = ld_shared4(ss + j * SSTAGE + (tid * NA + a) * 4);
      const uint32_t s_lo = dup_low(sc), s_hi = dup_high(sc);  // columns g and g + 8
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t word = word_of(words, s);
        uint32_t* f = A[P][a][s];
        f[0] = Ops::mul(Ops::sub(and_or(word, mask, magic), Ops::kOffset), s_lo);
        f[1] = Ops::mul(Ops::sub(and_or(word >> 4, mask, magic), Ops::kOffset), s_hi);
        f[2] = Ops::mul(Ops::sub(and_or(word >> 8, mask, magic), Ops::kOffset), s_lo);
        f[3] = Ops::mul(Ops::sub(and_or(word >> 12, mask, magic), Ops::kOffset), s_hi);
        if (has_prequant) {  // inputs 16 t + 4 s + {0, 1} and + {2, 3}: words 2 s and 2 s + 1 of the lane's 8
          const uint4& pq = s < 2 ? pq0 : pq1;
          const uint32_t p01 = word_of(pq, (2 * s) & 3), p23 = word_of(pq, (2 * s + 1) & 3);
          f[0] = Ops::mul(f[0], p01);
          f[1] = Ops::mul(f[1], p01);
          f[2] = Ops::mul(f[2], p23);
          f[3] = Ops::mul(f[3], p23);
        }
      }
    }
    const uint64_t desc = sw128_desc(xs + j * XSTAGE);  // + (byte offset) / 16 moves its start address
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int a = 0; a < NA; ++a)
#pragma unroll
        for (int rb = 0; rb < RB; ++rb)
          wgmma_rs(acc[a][rb], A[P][a][s], desc + ((rb * NB * 128 + 32 * s) >> 4), T());
    wgmma_commit();
    wgmma_wait<1>();  // chunk i - 1's wgmma are done: its A set is free for chunk i + 1
  };
  for (int i = kbeg; i < kend; i += 2) {
    step(i, std::integral_constant<int, 0>{});
    if (i + 1 < kend) step(i + 1, std::integral_constant<int, 1>{});
  }
  wgmma_wait<0>();
#pragma unroll
  for (int a = 0; a < NA; ++a)
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) pin(acc[a][rb]);
  cp_async_wait<0>();
  if (late_trigger) allow_next_grid();
  if constexpr (SPLITS > 1) {
    if (!add_splits<SPLITS, THREADS>(reinterpret_cast<float(&)[NA * RB * NB / 2]>(acc), partials, counters, xs))
      return;
  }

  // acc[a][rb][4 jj + e] (e < 2): column g of tile ct[a], row rb NB + 8 jj + 2 t + e; + 2: column g + 8.
#pragma unroll
  for (int a = 0; a < NA; ++a)
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int jj = 0; jj < NB / 8; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = row0 + rb * NB + 8 * jj + 2 * t + e;
          if (r >= rows) continue;
          const float lo = acc[a][rb][4 * jj + e], hi = acc[a][rb][4 * jj + 2 + e];
          if (ep.mode == 1) {
            y[static_cast<size_t>(r) * ldy + 8 * ct[a] + g] = Ops::from_float(silu(lo) * hi);
          } else if (ep.mode == 2) {
            rope_pair<T>(ep, r, ct[a], g, lo, hi);
          } else {
            T* row = y + static_cast<size_t>(r) * ldy;
            row[column_of(ct[a], g, 0, ep.period)] = Ops::from_float(lo);
            row[column_of(ct[a], g, 1, ep.period)] = Ops::from_float(hi);
          }
        }
#else
  __trap();  // launched only on sm_90 (the library is built for the GPU's own architecture: sm_90a there)
#endif
}

template <int R, int WG, int NA, int STAGES>
constexpr int wgmma_smem_bytes() { return 1024 + STAGES * (R * 128 + WG * 128 * NA * 20); }

// Configs the library instantiates: R 8-256 rows a block (as row tiles of 8: 1-32), WG x NA A tiles of 64
// columns (column tiles 4 WG NA), 3, 4 or 6 stages (4 from 128 rows); at most 128 accumulators a thread; split-K
// (2, 4 or 8 splits) with 4 stages and 64 rows a block only (the only split blocks that won on the H200).
template <typename T, int R, int WG, int NA, int STAGES, int SPLITS>
int launch_wgmma_t(const Call& a) {
  if constexpr (NA * R > 256 || (R >= 128 && STAGES != 4) || (SPLITS > 1 && (R != 64 || STAGES != 4))) {
    return -1;
  } else {
    constexpr int smem = wgmma_smem_bytes<R, WG, NA, STAGES>();
    const int total = smem + (a.prequant != nullptr ? 2 * a.k : 0);
    if ((a.n / 16) % (4 * WG * NA) || total > kMaxBlockSmem || a.fuse) return -1;  // the ring kernel's
    if (static_cast<long long>(a.rows) * a.ldx >= (1ll << 31)) return -1;  // 32-bit element offsets
    const dim3 grid((a.rows + R - 1) / R, a.n / (64 * WG * NA), SPLITS);
    if (SPLITS > 1) {  // the caller's buffers must hold every block's sums and every tile's counter
      const long long tiles = static_cast<long long>(grid.x) * grid.y;
      if (!a.partials || !a.counters || tiles > a.counters_size ||
          tiles * SPLITS * R * 64 * WG * NA > a.partials_size)
        return -1;
    }
    return launch(w4a16_wgmma_kernel<T, R, WG, NA, STAGES, SPLITS>, grid, WG * 128, total, a.stream, a.pdl != 0,
                  static_cast<const T*>(a.x), a.ldx, static_cast<const uint4*>(a.w),
                  static_cast<const uint32_t*>(a.scales), static_cast<const T*>(a.prequant), static_cast<T*>(a.y),
                  a.ldy, a.rows, a.n, a.k, a.group_shift, a.ep, a.pdl == 2 ? 1 : 0, a.partials, a.counters);
  }
}

// "stages" 3, 4, 6: one block per output tile; 10 s + 4 (24, 44, 84): s splits of the input (4 stages each).
template <typename T, int R, int WG, int NA>
int launch_wgmma_stages(int stages, const Call& a) {
  switch (stages) {
    case 3: return launch_wgmma_t<T, R, WG, NA, 3, 1>(a);
    case 4: return launch_wgmma_t<T, R, WG, NA, 4, 1>(a);
    case 6: return launch_wgmma_t<T, R, WG, NA, 6, 1>(a);
    case 24: return launch_wgmma_t<T, R, WG, NA, 4, 2>(a);
    case 44: return launch_wgmma_t<T, R, WG, NA, 4, 4>(a);
    case 84: return launch_wgmma_t<T, R, WG, NA, 4, 8>(a);
    default: return -1;
  }
}

template <typename T, int R>
int launch_wgmma_cols(int ntile, int warps, int stages, const Call& a) {
  if (warps == 4 && ntile == 4) return launch_wgmma_stages<T, R, 1, 1>(stages, a);
  if (warps == 4 && ntile == 8) return launch_wgmma_stages<T, R, 1, 2>(stages, a);
  if (warps == 8 && ntile == 8) return launch_wgmma_stages<T, R, 2, 1>(stages, a);
  if (warps == 8 && ntile == 16) return launch_wgmma_stages<T, R, 2, 2>(stages, a);
  return -1;
}

}  // namespace

// ---- Parts: the kernels in units that nvcc compiles in parallel ----
//
// cuda_ext.build compiles this file LLMC_PARTS times, with LLMC_PART = 0 .. LLMC_PARTS - 1, and links the objects
// (without them: one part, all of it). A unit (one family's kernels for one dtype and one row tile) is
// instantiated by its function here, defined in one part only; part 0 holds the entry points and the dispatch,
// which calls the units through their declarations. The parts are balanced for 8 by the units' machine code (SASS
// instructions, sm_90a, 2026-12-05: pipe 1 / 2 / 4 row tiles 140 / 153 / 86 thousand a dtype, wgmma 8 / 16 / 32 /
// 64 / 128 / 256 rows 25 / 36 / 43 / 98 / 16 / 8 thousand): each takes 148-154 thousand, so the 8 compiles take
// about an eighth of the whole each. A unit's kernels compile to the same machine code in any part.
#ifndef LLMC_PARTS
#define LLMC_PARTS 1
#endif
#ifndef LLMC_PART
#define LLMC_PART 0
#endif
#define LLMC_IN_PART(p) (LLMC_PART == (p) % LLMC_PARTS)

namespace llmc_units {

// A unit: launch a config (ntile, warps, stages >= 0 for the ring and register kernels, > 0 for the warpgroup
// kernel's) of its row tile and dtype; ``call`` is a Call (an opaque pointer: Call has no linkage across parts).
using Unit = int (*)(int ntile, int warps, int stages, const void* call);
#define LLMC_UNIT(NAME, LAUNCH)                                            \
  int NAME(int ntile, int warps, int stages, const void* call) {         \
    return LAUNCH(ntile, warps, stages, *static_cast<const Call*>(call)); \
  }
int pipe_bf16_1(int, int, int, const void*);
int pipe_bf16_2(int, int, int, const void*);
int pipe_bf16_4(int, int, int, const void*);
int pipe_fp16_1(int, int, int, const void*);
int pipe_fp16_2(int, int, int, const void*);
int pipe_fp16_4(int, int, int, const void*);
int wgmma_bf16_8(int, int, int, const void*);
int wgmma_bf16_16(int, int, int, const void*);
int wgmma_bf16_32(int, int, int, const void*);
int wgmma_bf16_64(int, int, int, const void*);
int wgmma_bf16_128(int, int, int, const void*);
int wgmma_bf16_256(int, int, int, const void*);
int wgmma_fp16_8(int, int, int, const void*);
int wgmma_fp16_16(int, int, int, const void*);
int wgmma_fp16_32(int, int, int, const void*);
int wgmma_fp16_64(int, int, int, const void*);
int wgmma_fp16_128(int, int, int, const void*);
int wgmma_fp16_256(int, int, int, const void*);

#if LLMC_IN_PART(0)
LLMC_UNIT(pipe_bf16_2, (launch_cols<__nv_bfloat16, 2>))
#endif
#if LLMC_IN_PART(1)
LLMC_UNIT(pipe_fp16_2, (launch_cols<__half, 2>))
#endif
#if LLMC_IN_PART(2)
LLMC_UNIT(pipe_bf16_1, (launch_cols<__nv_bfloat16, 1>))
LLMC_UNIT(wgmma_bf16_256, (launch_wgmma_cols<__nv_bfloat16, 256>))
#endif
#if LLMC_IN_PART(3)
LLMC_UNIT(pipe_fp16_1, (launch_cols<__half, 1>))
LLMC_UNIT(wgmma_fp16_256, (launch_wgmma_cols<__half, 256>))
#endif
#if LLMC_IN_PART(4)
LLMC_UNIT(wgmma_bf16_64, (launch_wgmma_cols<__nv_bfloat16, 64>))
LLMC_UNIT(wgmma_bf16_16, (launch_wgmma_cols<__nv_bfloat16, 16>))
LLMC_UNIT(wgmma_bf16_128, (launch_wgmma_cols<__nv_bfloat16, 128>))
#endif
#if LLMC_IN_PART(5)
LLMC_UNIT(wgmma_fp16_64, (launch_wgmma_cols<__half, 64>))
LLMC_UNIT(wgmma_fp16_16, (launch_wgmma_cols<__half, 16>))
LLMC_UNIT(wgmma_fp16_128, (launch_wgmma_cols<__half, 128>))
#endif
#if LLMC_IN_PART(6)
LLMC_UNIT(pipe_bf16_4, (launch_cols<__nv_bfloat16, 4>))
LLMC_UNIT(wgmma_fp16_32, (launch_wgmma_cols<__half, 32>))
LLMC_UNIT(wgmma_bf16_8, (launch_wgmma_cols<__nv_bfloat16, 8>))
#endif
#if LLMC_IN_PART(7)
LLMC_UNIT(pipe_fp16_4, (launch_cols<__half, 4>))
LLMC_UNIT(wgmma_bf16_32, (launch_wgmma_cols<__nv_bfloat16, 32>))
LLMC_UNIT(wgmma_fp16_8, (launch_wgmma_cols<__half, 8>))
#endif
#undef LLMC_UNIT

}  // namespace llmc_units

#if LLMC_PART == 0
namespace {

// What every entry point asks of the weight: whole tiles of 16 columns x 64 inputs, groups of 64 or 128.
bool weight_fits(int n, int k, int group_size) {
  return n % 16 == 0 && k % 64 == 0 && (group_size == 64 || group_size == 128);
}

// A product's Call from the arguments every product entry point takes; the caller sets the output (y, ldy), the
// epilogue, split-K's buffers and the fused parts (all zero / null here).
Call product_call(const void* x, int ldx, const void* w, const void* scales, const void* prequant, int rows, int n,
                  int k, int group_size, int pdl, void* stream) {
  return Call{x, ldx, w, scales, prequant, nullptr, 0, rows, n, k, group_size == 128 ? 1 : 0, Epilogue{}, pdl,
              static_cast<cudaStream_t>(stream)};  // the members after stream value-initialized: 0 / null
}

// Split-K's buffers of llmc_w4a16_mma and llmc_w4a16_mma_rope (null and 0 without split-K).
void split_k(Call& call, void* partials, long long partials_size, void* counters, int counters_size) {
  call.partials = static_cast<float*>(partials);
  call.partials_size = partials_size;
  call.counters = static_cast<int*>(counters);
  call.counters_size = counters_size;
}

// The pending input norm of llmc_w4a16_mma (none without in_sums) into a Call.
void pend_input(Call& call, const void* in_sums, int in_blocks, float in_eps) {
  if (in_sums == nullptr) return;
  call.fuse = 2;
  call.fz.in_sums = static_cast<const float*>(in_sums);
  call.fz.in_blocks = in_blocks;
  call.fz.in_eps = in_eps;
}

// Whether this GPU runs the warpgroup kernel (sm_90: the library is built for one architecture, sm_90a there).
// Asked once per process, not at every launch; a failed query is not kept, and concurrent first calls store the
// same answer.
bool warpgroup_gpu() {
  static int sm90 = -1;
  if (sm90 < 0) {
    int major = 0, device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
      return false;
    sm90 = major == 9;
  }
  return sm90 == 1;
}

// The launch of a Call by config (row tiles, column tiles, warps, stages; negative stages: the warpgroup kernel,
// sm_90 only), in the activations' dtype (0: bfloat16, otherwise float16).
int launch_call(int dtype, int mtiles, int ntile, int warps, int stages, const Call& call) {
  using namespace llmc_units;
  static constexpr Unit kPipe[2][3] = {{pipe_bf16_1, pipe_bf16_2, pipe_bf16_4},
                                       {pipe_fp16_1, pipe_fp16_2, pipe_fp16_4}};
  static constexpr Unit kWgmma[2][6] = {
      {wgmma_bf16_8, wgmma_bf16_16, wgmma_bf16_32, wgmma_bf16_64, wgmma_bf16_128, wgmma_bf16_256},
      {wgmma_fp16_8, wgmma_fp16_16, wgmma_fp16_32, wgmma_fp16_64, wgmma_fp16_128, wgmma_fp16_256}};
  const int t = dtype == 0 ? 0 : 1;
  int index = 0;  // log2(mtiles), for mtiles a power of two
  while (index < 6 && (1 << index) != mtiles) ++index;
  if (stages < 0) return index < 6 && warpgroup_gpu() ? kWgmma[t][index](ntile, warps, -stages, &call) : -1;
  return index < 3 ? kPipe[t][index](ntile, warps, stages, &call) : -1;
}

}  // namespace

extern "C" {

// y [rows, n] (or [rows, n/2] with silu_out) = x [rows, k] (row stride ldx, 16-byte aligned) times the packed
// weight. dtype 0: bfloat16, 1: float16. mtiles in {1, 2, 4} (rows per block / 8), ntile in {1, 2, 4} (column tiles
// per block, dividing n / 16), warps in {4, 8, 16} (16: at most 2 row x column tile pairs), stages in {2, 4, 8}
// (the depth of each warp's cp.async ring) or 0 (no ring: the register kernel, row tiles in {1, 2}); or the
// warpgroup kernel (sm_90 only), stages -3, -4 or -6 (-4 from 16 row tiles), or -24, -44, -84 for 2, 4 or 8
// splits of the input (split-K, 8 row tiles only; ``partials``: float32 scratch of at least splits x the rows
// rounded up to the block's x n elements, ``counters``: zeroed int32, one per output block; both given as pointer
// and capacity, null and 0 without split-K; one launch at a time per buffer), mtiles in {1, 2, 4, 8, 16, 32},
// (ntile, warps) in {(4, 4), (8, 4), (8, 8), (16, 8)} (warpgroups = warps / 4, each ntile / warps A tiles of 64
// columns; at most 256 rows x A tiles a warpgroup), ntile dividing n / 16. period: the
// weight's columns interleaved in blocks of 8 within segments of that many columns (0: none; see Epilogue). pdl:
// launch with programmatic stream serialization (sm_90+): the kernel's first weight requests overlap the end of the
// previous kernel (1: the next kernel may start its blocks at once, 2: once every block of this one has its loads
// done; 0: a plain launch). in_sums (null: none): x is llmc_w4a16_mma_add's ``scaled`` rows, their RMSNorm pending:
// per row the in_blocks sums of squares it left (float32, row stride in_blocks); the kernel multiplies each row's
// products by rsqrt(sum / k + in_eps) before its epilogue (the ring kernel only, stages 2 or 4). Returns 0 or a
// CUDA error code (-1: an unsupported config).
int llmc_w4a16_mma(int dtype, int mtiles, int ntile, int warps, int stages, const void* x, int ldx,
                   const void* w, const void* scales, const void* prequant, void* y, int ldy, int rows, int n, int k,
                   int group_size, int silu_out, int period, void* partials, long long partials_size,
                   void* counters, int counters_size, const void* in_sums, int in_blocks, float in_eps, int pdl,
                   void* stream) {
  if (!weight_fits(n, k, group_size) || rows <= 0) return -1;
  if (period < 0 || period % 16 || (period && n % period) || (silu_out && period)) return -1;
  Call call = product_call(x, ldx, w, scales, prequant, rows, n, k, group_size, pdl, stream);
  call.y = y;
  call.ldy = ldy;
  call.ep.mode = silu_out ? 1 : 0;
  call.ep.period = period;
  split_k(call, partials, partials_size, counters, counters_size);
  pend_input(call, in_sums, in_blocks, in_eps);
  return launch_call(dtype, mtiles, ntile, warps, stages, call);
}

// The product of a qkv layer whose columns are interleaved per head (period = head), written as rotated q (to q,
// row stride ldq) and k, v in the rows' cache slots (Epilogue mode 2): RoPE and the KV-cache write in the product's
// epilogue. n = (nh + 2 nkv) * head; cos, sin: [rows, head] tables of x's dtype, row stride ld_cs; slots: int64, row
// stride ld_slot; k_cache, v_cache: [slots, nkv, head] of x's dtype; split-K buffers and the pending input norm as
// in llmc_w4a16_mma.
int llmc_w4a16_mma_rope(int dtype, int mtiles, int ntile, int warps, int stages, const void* x, int ldx,
                        const void* w, const void* scales, const void* prequant, int rows, int n, int k,
                        int group_size, int head, const void* cos, const void* sin, int ld_cs, const void* slots,
                        int ld_slot, void* q, int ldq, void* k_cache, void* v_cache, int nh, int nkv,
                        void* partials, long long partials_size, void* counters, int counters_size,
                        const void* in_sums, int in_blocks, float in_eps, int pdl, void* stream) {
  if (!weight_fits(n, k, group_size) || rows <= 0) return -1;
  if (head <= 0 || head % 16 || nh <= 0 || nkv <= 0 || n != (nh + 2 * nkv) * head) return -1;
  Call call = product_call(x, ldx, w, scales, prequant, rows, n, k, group_size, pdl, stream);
  call.ep = Epilogue{2, head, cos, sin, ld_cs, static_cast<const long long*>(slots), ld_slot, q, ldq, k_cache,
                     v_cache, nh, nkv};
  split_k(call, partials, partials_size, counters, counters_size);
  pend_input(call, in_sums, in_blocks, in_eps);
  return launch_call(dtype, mtiles, ntile, warps, stages, call);
}

// The product of an o or down projection added to the residual stream (Epilogue mode 3): resid [rows, n] (row
// stride ld_resid) += x W^T rounded to x's dtype, scaled [rows, n] (ld_scaled) = the new rows times norm_w [n] (the
// next RMSNorm's weight), rounded, and sums [rows, n / (16 ntile)] (float32, at least sums_size elements) each
// block's sum of the new residual's squares per row: the next layer multiplies ``scaled`` and finishes the norm in
// its epilogue (in_sums of llmc_w4a16_mma). The ring kernel only (stages 2 or 4; others return -1).
int llmc_w4a16_mma_add(int dtype, int mtiles, int ntile, int warps, int stages, const void* x, int ldx,
                       const void* w, const void* scales, const void* prequant, int rows, int n, int k,
                       int group_size, void* resid, int ld_resid, void* scaled, int ld_scaled, const void* norm_w,
                       void* sums, long long sums_size, int pdl, void* stream) {
  if (!weight_fits(n, k, group_size) || rows <= 0 || stages <= 0) return -1;
  if (!resid || !scaled || !norm_w || !sums) return -1;
  Call call = product_call(x, ldx, w, scales, prequant, rows, n, k, group_size, pdl, stream);
  call.partials = static_cast<float*>(sums);  // FUSE 1 keeps its sums where split-K keeps its partials
  call.partials_size = sums_size;
  call.fuse = 1;
  call.fz.resid = resid;
  call.fz.ld_resid = ld_resid;
  call.fz.scaled = scaled;
  call.fz.ld_scaled = ld_scaled;
  call.fz.norm_w = norm_w;
  return launch_call(dtype, mtiles, ntile, warps, stages, call);
}

// The effective weight [k, n] into out; period as in llmc_w4a16_mma (n for fc + gate: [fc | gate]).
int llmc_w4a16_mma_dequant(int dtype, const void* w, const void* scales, const void* prequant, void* out, int n,
                           int k, int group_size, int period, int pdl, void* stream) {
  if (!weight_fits(n, k, group_size)) return -1;
  if (period < 0 || period % 16 || (period && n % period)) return -1;
  constexpr int TILES = 8, KT = 2;  // 128 x 128 a block: 8B shapes x 32 layers 5.38 ms vs 6.31 with 64 x 64 (H200)
  const int shift = group_size == 128 ? 1 : 0;
  const dim3 grid((n / 16 + TILES - 1) / TILES, (k / 64 + KT - 1) / KT);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint4* words = static_cast<const uint4*>(w);
  const uint32_t* pairs = static_cast<const uint32_t*>(scales);
  if (dtype == 0) {
    return launch(w4a16_mma_dequant_kernel<__nv_bfloat16, TILES, KT>, grid, 32 * TILES, 0, s, pdl != 0, words,
                  pairs, static_cast<const __nv_bfloat16*>(prequant), static_cast<__nv_bfloat16*>(out), n, k, shift,
                  period);
  }
  return launch(w4a16_mma_dequant_kernel<__half, TILES, KT>, grid, 32 * TILES, 0, s, pdl != 0, words, pairs,
                static_cast<const __half*>(prequant), static_cast<__half*>(out), n, k, shift, period);
}

int llmc_w4a16_abi_version() { return 14; }

}  // extern "C"
#endif  // LLMC_PART == 0
