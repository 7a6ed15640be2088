// The inner step of the AMX prefill kernel: C tiles 0-3 += A tiles 4-5 x B tiles 6-7 (2x2 output tiles,
// the most 8 tile registers allow), as BF16 dot products or signed INT8 ones. Shared with
// bench/amx_tiles.cc, whose ceilings then time the kernel's own step.
#pragma once

#include <immintrin.h>

namespace hybridjit {

template <bool kInt8>
__attribute__((always_inline, target("amx-tile,amx-bf16,amx-int8"))) inline void MultiplyTiles2x2() {
  if constexpr (kInt8) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  } else {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

}  // namespace hybridjit
