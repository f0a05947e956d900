// One instruction set's table of tile routines (tile_tables.h), put together from its kernel families;
// compiled once per instruction set, like the families.
#include "cpu/families.h"
#include "cpu/tile_tables.h"

namespace causal_attention::tile::CPU_CAPABILITY {
namespace {

template <typename scalar_t>
TileOps<scalar_t> make_tile_ops() {
  TileOps<scalar_t> ops{};  // every entry nullptr until a family sets it
  set_softmax_ops(ops);
  set_dropout_ops(ops);
  set_decode_ops(ops);
  set_linear_rows_ops(ops);
  set_widened_gemm_ops(ops);
  set_rotary_ops(ops);
  set_panel_gemm_ops(ops);
  set_pair_gemm_ops(ops);
  return ops;
}

}  // namespace

// The entry points tile_ops.cpp chooses from.
TileOps<float> tile_ops_float() { return make_tile_ops<float>(); }
TileOps<double> tile_ops_double() { return make_tile_ops<double>(); }
TileOps<c10::BFloat16> tile_ops_bfloat16() { return make_tile_ops<c10::BFloat16>(); }
TileOps<c10::Half> tile_ops_half() { return make_tile_ops<c10::Half>(); }

}  // namespace causal_attention::tile::CPU_CAPABILITY
