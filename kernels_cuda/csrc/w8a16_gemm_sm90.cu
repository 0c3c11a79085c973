// int8 weight x bf16 activation GEMM for Hopper (sm_90a) on CUTLASS 3's mixed-input mainloop:
//   y[M, N] = (x[M, K] @ dequant(W)[N, K]^T), dequant(W)[n, k] = W[n, k] * scale[n]  (+ bias[n])
// The int8 weight is the GEMM's A operand (K-major, [N, K] row-major): CUTLASS loads it with TMA,
// converts it to bf16 in registers and feeds wgmma from registers (the register-sourced "RS"
// form), so it never goes back to shared memory; x is B ([K, M] column-major = x row-major);
// D = y^T [N, M] column-major = y row-major. The per-channel scale is the epilogue's per-row
// alpha (the accumulator of exact int8 x bf16 products is scaled once, in fp32), the bias its
// per-row bias. Built as a plain shared library (no torch ABI) by `kernels_cuda/cutlass_w8a16.py`
// and called through ctypes with the caller's CUDA stream, so CUDA-graph capture records it.

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace {

using ElementW = int8_t;            // A: the weight codes
using ElementX = cutlass::bfloat16_t;  // B: the activations
using ElementY = cutlass::bfloat16_t;  // D
using ElementAcc = float;
using LayoutW = cutlass::layout::RowMajor;     // [N, K], K contiguous
using LayoutX = cutlass::layout::ColumnMajor;  // [K, M] with K contiguous = x [M, K] row-major
using LayoutY = cutlass::layout::ColumnMajor;  // [N, M] with N contiguous = y [M, N] row-major
constexpr int kAlignW = 128 / cutlass::sizeof_bits<ElementW>::value;  // 16 codes = 16 bytes
constexpr int kAlignX = 128 / cutlass::sizeof_bits<ElementX>::value;  // 8
constexpr int kAlignY = 128 / cutlass::sizeof_bits<ElementY>::value;  // 8

int current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  return dev;
}

// Multiprocessors of a device, queried once per device (0 where no device answers).
int sm_count(int dev) {
  static int cached[64] = {};
  using Info = cutlass::KernelHardwareInfo;
  if (dev < 0 || dev >= 64) return Info::query_device_multiprocessor_count(dev);
  if (cached[dev] <= 0) cached[dev] = Info::query_device_multiprocessor_count(dev);
  return cached[dev];
}

// One config per tile shape (weight rows, tokens, K; K = 64 bf16 = 128 bytes per stage row) and
// tile scheduler: persistent data-parallel tiles, or stream-K (CUTLASS splits the K loop of some
// tiles across SMs when the tile count leaves SMs idle, e.g. 64 tiles of a 4096-row weight at
// 128 tokens on 132 SMs; partial sums go through the workspace).
template <int TileN, int TileM, class Scheduler>
struct W8A16Gemm {
  using TileShape = Shape<Int<TileN>, Int<TileM>, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  // D = identity(alpha[row] * acc + bias[row]); no C operand (beta unused).
  using Fusion = cutlass::epilogue::fusion::PerRowLinCombPerRowBiasEltAct<
      cutlass::epilogue::thread::Identity, ElementY, float, ElementY, ElementY, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float,
      void, LayoutY, kAlignY, ElementY, LayoutY, kAlignY, EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementW, LayoutW, kAlignW, ElementX,
      LayoutX, kAlignX, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const void* w, const void* x, const float* scales,
                                            const void* bias, void* y, int n, int m, int k) {
    using StrideW = typename Kernel::StrideA;
    using StrideX = typename Kernel::StrideB;
    using StrideY = typename Kernel::StrideD;
    StrideW sw = cutlass::make_cute_packed_stride(StrideW{}, make_shape(n, k, 1));
    StrideX sx = cutlass::make_cute_packed_stride(StrideX{}, make_shape(m, k, 1));
    StrideY sy = cutlass::make_cute_packed_stride(StrideY{}, make_shape(n, m, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {n, m, k, 1},
        {static_cast<const ElementW*>(w), sw, static_cast<const ElementX*>(x), sx},
        {{}, nullptr, sy, static_cast<ElementY*>(y), sy}};
    auto& fusion = args.epilogue.thread;
    fusion.alpha_ptr = scales;
    fusion.dAlpha = {bool(1), _0{}, 0};  // one alpha per row of D (weight row)
    fusion.bias_ptr = static_cast<const ElementY*>(bias);  // null: no bias
    // The SM count explicitly: stream-K sizes its workspace and decomposition from it.
    args.hw_info.device_id = current_device();
    args.hw_info.sm_count = sm_count(args.hw_info.device_id);
    return args;
  }
};

// Both entry points need a GPU that reports its SM count (stream-K divides by it).
template <class G>
size_t workspace_size(int n, int m, int k) {
  if (sm_count(current_device()) <= 0) return 0;
  return G::Gemm::get_workspace_size(
      G::arguments(nullptr, nullptr, nullptr, nullptr, nullptr, n, m, k));
}

template <class G>
int run(const void* w, const void* x, const float* scales, const void* bias, void* y, int n,
        int m, int k, void* workspace, cudaStream_t stream) {
  if (sm_count(current_device()) <= 0) return 5;
  typename G::Gemm gemm;
  auto args = G::arguments(w, x, scales, bias, y, n, m, k);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return 0;
}

using Persistent = cutlass::gemm::PersistentScheduler;
using StreamK = cutlass::gemm::StreamKScheduler;
using Tile0 = W8A16Gemm<128, 128, Persistent>;
using Tile1 = W8A16Gemm<128, 64, Persistent>;
using Tile2 = W8A16Gemm<128, 128, StreamK>;
using Tile3 = W8A16Gemm<128, 64, StreamK>;

}  // namespace

extern "C" {

// tile: 0 = 128 weight rows x 128 tokens, 1 = 128 x 64 (persistent); 2 and 3: the same with
// stream-K. Returns 0, or 1 (shape not implementable: alignment), 2 (initialize failed), 3
// (launch failed), 4 (no such tile), 5 (no GPU answers). The workspace size is 0 without a GPU.
int xlaserve_w8a16_gemm(int tile, const void* w, const void* x, const float* scales,
                        const void* bias, void* y, int n, int m, int k, void* workspace,
                        cudaStream_t stream) {
  switch (tile) {
    case 0: return run<Tile0>(w, x, scales, bias, y, n, m, k, workspace, stream);
    case 1: return run<Tile1>(w, x, scales, bias, y, n, m, k, workspace, stream);
    case 2: return run<Tile2>(w, x, scales, bias, y, n, m, k, workspace, stream);
    case 3: return run<Tile3>(w, x, scales, bias, y, n, m, k, workspace, stream);
    default: return 4;
  }
}

size_t xlaserve_w8a16_workspace(int tile, int n, int m, int k) {
  switch (tile) {
    case 0: return workspace_size<Tile0>(n, m, k);
    case 1: return workspace_size<Tile1>(n, m, k);
    case 2: return workspace_size<Tile2>(n, m, k);
    case 3: return workspace_size<Tile3>(n, m, k);
    default: return 0;
  }
}

}  // extern "C"
