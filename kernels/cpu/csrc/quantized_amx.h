// The AMX many-rows product (quantized_linear_amx.cpp), called by quantized_linear_vnni.cpp's
// linear_int16 for batches of at least kAmxMinRows rows once x is rounded to int16.
#pragma once

#include "quantized_tiles.h"

namespace ferry::quantized {

#ifdef FERRY_QUANTIZED_AMX
// Rows of x from which the tile unit takes the product. Below it the weights' unpacking into
// AMX's layout (once per 16 outputs whatever the rows) costs more than vpdpwssd saves.
constexpr int64_t kAmxMinRows = 24;

// Q6_K has a scale per 16 columns: four sums a block would need more tiles than AMX has beside the
// two row tiles, so it stays on vpdpwssd.
constexpr bool amx_format(Format f) { return f != Format::kQ6_K; }

// Whether products may run on AMX now: the process holds the tile state and it was not switched off.
bool amx_ready();

// out = x @ W^T (+ bias) with x already rounded (xq [M, K] int16, xscale [M, blocks]): the same
// floats as the vpdpwssd kernel's many-rows path.
void linear_int16_amx(Format format, const int16_t* xq, const float* xscale, const float* xsum, int64_t M,
                      const uint8_t* tiles, int64_t num_groups, int64_t blocks, const float* bias, float* out,
                      int64_t N);
#endif

}  // namespace ferry::quantized
