// MXFP4 as llama.cpp's GGUF files store it, turned into the layout of the gpt-oss release that the MXFP4 kernels
// read (weight_bank.h): hybridjit/gguf_checkpoint.py rebuilds a gpt-oss file's experts with it at load.
#pragma once

#include <cstdint>

namespace hybridjit {

// `n` ggml blocks at src (17 bytes each: the e8m0 scale byte, then 16 bytes whose low nibbles hold elements 0-15
// and high nibbles elements 16-31) -> blocks (16 bytes each: element 2j in the low nibble of byte j, 2j + 1 in the
// high one) and scales (one byte each). Runs on the routed experts' thread pool.
void Mxfp4FromGgml(const uint8_t* src, int64_t n, uint8_t* blocks, uint8_t* scales);

}  // namespace hybridjit
