// The tile routines of each instruction-set build (tile_table.cpp and its families, compiled with
// CPU_CAPABILITY = DEFAULT, AVX2, AVX512): tile_ops.cpp chooses among them at run time; tests call them directly.
#pragma once

#include "cpu/tile_ops.h"

#define CA_DECLARE_TILE_OPS(CAP)              \
  namespace causal_attention::tile::CAP {     \
  TileOps<float> tile_ops_float();            \
  TileOps<double> tile_ops_double();          \
  TileOps<c10::BFloat16> tile_ops_bfloat16(); \
  TileOps<c10::Half> tile_ops_half();         \
  }

CA_DECLARE_TILE_OPS(DEFAULT)
CA_DECLARE_TILE_OPS(AVX2)
CA_DECLARE_TILE_OPS(AVX512)
#undef CA_DECLARE_TILE_OPS
