// What reading one decode step's int4 linear weights costs on this GPU at best, as one kernel and as 128 kernels.
//
// The buffers have the packed-int4 + bf16-scale bytes (group 128) of Llama-3.1-8B's 32 x (qkv, o, fc + gate, down),
// 3.6 GB. Each kernel only reads (16-byte streaming loads, four in flight a thread, a grid-stride loop) and keeps an
// xor that it never stores. Times are the median of 20 replays of a CUDA graph (CUDA events):
// - one kernel over all of it: the memory's read bandwidth (the bound llmc/bench/bounds.py uses);
// - 128 kernels, one per linear in step order: plain launches; programmatic dependent launch with each kernel waiting
//   for the previous one before its loads (griddepcontrol.wait first: launch latency hidden, no prefetch); and with
//   the wait after the loads (a kernel whose whole weight is requested before it needs the previous kernel's output);
// - then 32 kernels of each shape alone, per kernel against its bytes at the one-kernel bandwidth.
// llmc's int4 linears of a step, in step order, take what scripts/bench_linears.py --step-order prints.
//
//   nvcc -O3 -arch=sm_90a -std=c++17 scripts/stream_floor.cu -o /tmp/stream_floor && /tmp/stream_floor
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));         \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

enum Wait { kPlain = 0, kWaitFirst = 1, kLoadsThenWait = 2 };

template <int WAIT>
__global__ void stream(const uint4* __restrict__ p, size_t n16, unsigned* out) {
  if (WAIT != kPlain) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (WAIT == kWaitFirst) asm volatile("griddepcontrol.wait;" ::: "memory");
  unsigned acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n16; i += stride) {
    const uint4 a = __ldcs(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (WAIT == kLoadsThenWait) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (acc == 0x12345678u) out[blockIdx.x] = acc;  // never true for the buffer's bytes: keeps the loads
}

template <int WAIT>
void launch(const char* p, size_t bytes, unsigned* out, int grid, int threads, cudaStream_t s) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = WAIT != kPlain;
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid);
  c.blockDim = dim3(threads);
  c.stream = s;
  c.attrs = attr;
  c.numAttrs = 1;
  cudaLaunchKernelEx(&c, stream<WAIT>, reinterpret_cast<const uint4*>(p), bytes / 16, out);
}

int main() {
  const size_t n[4] = {6144, 4096, 28672, 4096}, k[4] = {4096, 4096, 4096, 14336};
  const char* names[4] = {"qkv", "o", "fc+gate", "down"};
  std::vector<size_t> bytes;  // step order: layer 0's qkv, o, fc + gate, down, then layer 1's ...
  size_t total = 0;
  for (int layer = 0; layer < 32; ++layer)
    for (int s = 0; s < 4; ++s) {
      const size_t b = (n[s] * k[s] / 2 + n[s] * k[s] / 128 * 2 + 255) / 256 * 256;
      bytes.push_back(b);
      total += b;
    }
  char* buf;
  unsigned* out;
  CHECK(cudaMalloc(&buf, total));
  CHECK(cudaMalloc(&out, 1 << 20));
  CHECK(cudaMemset(buf, 1, total));
  cudaStream_t stream_;
  CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto time_graph = [&](auto body) -> float {  // ms, median of 20 replays after 5
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal);
    body();
    cudaStreamEndCapture(stream_, &g);
    if (cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) return -1.f;
    std::vector<float> ts;
    for (int r = 0; r < 25; ++r) {
      cudaEventRecord(e0, stream_);
      cudaGraphLaunch(ge, stream_);
      cudaEventRecord(e1, stream_);
      cudaEventSynchronize(e1);
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      if (r >= 5) ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    return ts[ts.size() / 2];
  };
  auto chain = [&](auto one, int only) {  // every linear (only < 0) or the 32 of one shape
    size_t offset = 0;
    for (size_t i = 0; i < bytes.size(); offset += bytes[i], ++i)
      if (only < 0 || static_cast<int>(i % 4) == only) one(buf + offset, bytes[i]);
  };
  std::printf("%.3f GB of int4 weights and scales, %d multiprocessors\n", total / 1e9, sms);
  const int shapes[][2] = {{1, 1024}, {2, 512}, {4, 256}, {8, 128}};
  float best_one = 1e9f;
  for (const auto& sh : shapes) {
    const int grid = sh[0] * sms, th = sh[1];
    const float one = time_graph([&] { launch<kPlain>(buf, total, out, grid, th, stream_); });
    const float plain = time_graph([&] {
      chain([&](const char* p, size_t b) { launch<kPlain>(p, b, out, grid, th, stream_); }, -1); });
    const float first = time_graph([&] {
      chain([&](const char* p, size_t b) { launch<kWaitFirst>(p, b, out, grid, th, stream_); }, -1); });
    const float last = time_graph([&] {
      chain([&](const char* p, size_t b) { launch<kLoadsThenWait>(p, b, out, grid, th, stream_); }, -1); });
    best_one = std::min(best_one, one);
    std::printf("grid %4d x %4d: one kernel %.3f ms (%.2f TB/s) | 128 kernels: plain %.3f, wait first %.3f, "
                "loads then wait %.3f ms\n", grid, th, one, total / one / 1e9, plain, first, last);
  }
  const double bandwidth = total / (best_one * 1e-3);
  for (int s = 0; s < 4; ++s)
    for (const auto& sh : shapes) {
      const int grid = sh[0] * sms, th = sh[1];
      const float first = time_graph([&] {
        chain([&](const char* p, size_t b) { launch<kWaitFirst>(p, b, out, grid, th, stream_); }, s); });
      const float last = time_graph([&] {
        chain([&](const char* p, size_t b) { launch<kLoadsThenWait>(p, b, out, grid, th, stream_); }, s); });
      std::printf("  %-7s grid %4d x %4d: us a kernel, wait first %.2f, loads then wait %.2f (bytes %.2f)\n",
                  names[s], grid, th, first * 1e3 / 32, last * 1e3 / 32, bytes[s] / bandwidth * 1e6);
    }
  return 0;
}
