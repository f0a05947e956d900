// Rotary positions on a qkv projection in one pass (the rows' kernel: tile_ops.h rotary_rows): the
// composition it replaces (Rotary::apply: negate, join the halves, two products, a sum, then join q, k and
// v again) made six passes over q and k and a copy of the whole row.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "causal_attention/attention.h"
#include "cpu/tile_ops.h"

namespace causal_attention::kernels {
namespace {

struct RotaryShape {
  int64_t hd, width, rotated;  // head_dim, a row of qkv, its q and k part ((H + Hkv) * hd)
  std::vector<int64_t> tables;  // the shape cos and sin are expanded to: qkv's leading dims, then hd
};

RotaryShape check_rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                         int64_t n_kv_heads) {
  TORCH_CHECK_VALUE(n_heads > 0 && n_kv_heads > 0, "rotary_qkv: n_heads and n_kv_heads must be positive; got ",
                    n_heads, " and ", n_kv_heads);
  TORCH_CHECK_VALUE(qkv.dim() >= 1 && qkv.size(-1) % (n_heads + 2 * n_kv_heads) == 0,
                    "rotary_qkv: qkv must be (..., (n_heads + 2 * n_kv_heads) * head_dim) = (..., ",
                    n_heads + 2 * n_kv_heads, " * head_dim); got ", qkv.sizes());
  const int64_t hd = qkv.size(-1) / (n_heads + 2 * n_kv_heads);
  TORCH_CHECK_VALUE(hd % 2 == 0, "rotary_qkv: head_dim must be even (rotate-half pairs d with d + head_dim / 2); got ",
                    hd);
  TORCH_CHECK_TYPE(at::isFloatingType(qkv.scalar_type()) && cos.scalar_type() == qkv.scalar_type() &&
                       sin.scalar_type() == qkv.scalar_type(),
                   "rotary_qkv: qkv, cos and sin must share one floating dtype; got ", qkv.scalar_type(), ", ",
                   cos.scalar_type(), " and ", sin.scalar_type());
  TORCH_CHECK_VALUE(cos.device() == qkv.device() && sin.device() == qkv.device(),
                    "rotary_qkv: cos and sin must be on qkv's device (", qkv.device(), "); got ", cos.device(),
                    " and ", sin.device());
  auto tables = qkv.sizes().vec();
  tables.back() = hd;
  for (const auto& [name, table] : {std::pair{"cos", &cos}, std::pair{"sin", &sin}}) {
    TORCH_CHECK_VALUE(table->dim() <= qkv.dim() && at::is_expandable_to(table->sizes(), tables),
                      "rotary_qkv: ", name, " must broadcast to qkv's leading dims and head_dim ", tables, "; got ",
                      table->sizes());
  }
  return {hd, qkv.size(-1), (n_heads + n_kv_heads) * hd, std::move(tables)};
}

}  // namespace

at::Tensor rotary_qkv_cpu(const at::Tensor& qkv_in, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                          int64_t n_kv_heads) {
  const auto shape = check_rotary(qkv_in, cos, sin, n_heads, n_kv_heads);
  const auto qkv = qkv_in.contiguous();
  auto out = at::empty_like(qkv, at::MemoryFormat::Contiguous);
  const int64_t rows = shape.hd == 0 ? 0 : qkv.numel() / shape.width;
  if (rows == 0) {
    return out;
  }
  // (rows, hd) dense tables: copies only where cos / sin broadcast over leading dims (a batch sharing
  // positions) or are strided.
  const auto c = cos.expand(shape.tables).reshape({rows, shape.hd}).contiguous();
  const auto s = sin.expand(shape.tables).reshape({rows, shape.hd}).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_qkv", [&] {
    const scalar_t* x = qkv.const_data_ptr<scalar_t>();
    const scalar_t* cp = c.const_data_ptr<scalar_t>();
    const scalar_t* sp = s.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const auto rotate = tile::tile_ops<scalar_t>().rotary_rows;
    const int64_t grain = std::max<int64_t>(1, 32768 / shape.width);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      rotate(x + begin * shape.width, cp + begin * shape.hd, sp + begin * shape.hd, o + begin * shape.width,
             end - begin, shape.width, shape.rotated, shape.hd);
    });
  });
  return out;
}

at::Tensor rotary_qkv_meta(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                           int64_t n_kv_heads) {
  check_rotary(qkv, cos, sin, n_heads, n_kv_heads);
  return at::empty_like(qkv, at::MemoryFormat::Contiguous);
}

}  // namespace causal_attention::kernels
