// The kernel families that fill the tile routine table (tile_ops.h), one file each, every one compiled
// once per instruction set (CMakeLists.txt: CA_ISA_SOURCES) into the namespace
// causal_attention::tile::<CPU_CAPABILITY>; tile_table.cpp puts a build's families together.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu/tile_ops.h"

#ifndef CPU_CAPABILITY
#error "compiled once per instruction set, with -DCPU_CAPABILITY=DEFAULT|AVX2|AVX512"
#endif

namespace causal_attention::tile::CPU_CAPABILITY {

// Each sets its family's entries of ops: those this build has and this CPU runs (the rest stay nullptr).
template <typename scalar_t>
void set_softmax_ops(TileOps<scalar_t>& ops);  // attention/cpu/softmax.cpp
template <typename scalar_t>
void set_dropout_ops(TileOps<scalar_t>& ops);  // attention/cpu/dropout.cpp
template <typename scalar_t>
void set_decode_ops(TileOps<scalar_t>& ops);  // attention/cpu/decode_chunk.cpp
template <typename scalar_t>
void set_panel_gemm_ops(TileOps<scalar_t>& ops);  // attention/cpu/panel_gemm.cpp
template <typename scalar_t>
void set_pair_gemm_ops(TileOps<scalar_t>& ops);  // attention/cpu/pair_gemm.cpp
template <typename scalar_t>
void set_linear_rows_ops(TileOps<scalar_t>& ops);  // linear/cpu/linear_rows.cpp
template <typename scalar_t>
void set_widened_gemm_ops(TileOps<scalar_t>& ops);  // linear/cpu/widened_gemm.cpp
template <typename scalar_t>
void set_rotary_ops(TileOps<scalar_t>& ops);  // models/cpu/rotary_rows.cpp

}  // namespace causal_attention::tile::CPU_CAPABILITY

// A family's setter for the four dtypes of the table, in the family's file.
#define CA_INSTANTIATE_TILE_FAMILY(SET)                   \
  template void SET<float>(TileOps<float>&);              \
  template void SET<double>(TileOps<double>&);            \
  template void SET<c10::BFloat16>(TileOps<c10::BFloat16>&); \
  template void SET<c10::Half>(TileOps<c10::Half>&);
