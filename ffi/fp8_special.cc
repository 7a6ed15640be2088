#include "fp8_special.h"

namespace hybridjit {
namespace {

constexpr int64_t kChunk = 64;

// Whether any of kChunk codes is special: a fixed trip count and no branch, so the compiler vectorizes it.
bool AnySpecial(const uint8_t* codes) {
  uint8_t any = 0;
  for (int64_t i = 0; i < kChunk; ++i) any |= static_cast<uint8_t>(IsFp8Special(codes[i]));
  return any != 0;
}

}  // namespace

std::vector<uint32_t> FindFp8Specials(const uint8_t* weights, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  std::vector<uint32_t> found;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t end = std::min(n, c + kChunk);
    if (end - c == kChunk && !AnySpecial(weights + c)) continue;  // the rare chunk with a special code is walked
    for (int64_t i = c; i < end; ++i) {
      if (IsFp8Special(weights[i])) found.push_back(static_cast<uint32_t>(i));
    }
  }
  return found;
}

}  // namespace hybridjit
