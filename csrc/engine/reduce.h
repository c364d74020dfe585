// The reduce kernels: element-wise sums (scaled) of the types an allreduce carries, and the casts of float32
// to and from 16-bit wire types -- vectorized where the CPU allows, the same bits on every rank.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rdkeras {

// The element types a reduction sums. float16/bfloat16 are wire types: each addition is done in float32 and
// rounded back (to nearest even), as Horovod's Compression.fp16 sums what NCCL hands it.
enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16 };
size_t dtypeSize(DType dtype);
const char* dtypeName(DType dtype);

// float32 <-> a 16-bit wire type (round to nearest even; NaN stays NaN, overflow becomes infinity), the
// way back scaled by `scale`.
void castToWire(const float* src, uint16_t* dst, size_t n, DType wire);
void castFromWire(const uint16_t* src, float* dst, size_t n, DType wire, float scale);

// out = (a + b) * scale over `bytes` of `dtype`; out may be a (not b). float32 outputs of `nontemporal_from`
// bytes or more are written with streaming stores.
void addInto(DType dtype, uint8_t* out, const uint8_t* a, const uint8_t* b, size_t bytes, double scale,
             size_t nontemporal_from);

}  // namespace rdkeras
