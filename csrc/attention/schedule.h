// The parallel schedule of the attention passes (flash.cpp's forward and backward, decode.cpp's
// decode step): work items taken from a shared counter, the costliest first.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace causal_attention::kernels {

// The parallel schedule of a pass: every thread makes its workspace (make_ws()) and takes work
// items from a shared counter, in the order given (the costliest first), until none is left. With
// padding, sequences cost very different amounts (a static split of the items gave one thread
// most of the long sequences); items write disjoint outputs, so the result does not depend on
// which thread ran which.
// make_ws may also hand back a reference to a workspace that outlives the call (one per thread).
template <typename MakeWorkspace, typename Work>
void run_items(const std::vector<int64_t>& order, const MakeWorkspace& make_ws, const Work& work) {
  std::atomic<int64_t> next{0};
  const auto n = static_cast<int64_t>(order.size());
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    decltype(auto) ws = make_ws();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      work(order[i], ws);
    }
  });
}

// Items 0..n-1 in groups of per_group consecutive items (a (batch, head) and its query blocks):
// the groups by decreasing total cost, each group's items by decreasing cost (ties in item order).
// The threads then work on the same group at once and share its data in cache, where
// costliest_first over all items took one group's item, then another group's, and so on; the last
// items are still the cheapest of the last group.
template <typename Cost>
std::vector<int64_t> costliest_groups_first(int64_t n, int64_t per_group, const Cost& cost) {
  TORCH_CHECK(per_group > 0, "costliest_groups_first: per_group must be positive; got ", per_group);
  const int64_t groups = (n + per_group - 1) / per_group;
  std::vector<int64_t> total(groups, 0);
  for (int64_t i = 0; i < n; ++i) {
    total[i / per_group] += cost(i);
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t ga = a / per_group, gb = b / per_group;
    if (ga != gb) {
      return total[ga] > total[gb] || (total[ga] == total[gb] && ga < gb);
    }
    return cost(a) > cost(b);
  });
  return order;
}

// Items 0..n-1 by decreasing cost (ties in item order: the same order on every call): groups of one.
template <typename Cost>
std::vector<int64_t> costliest_first(int64_t n, const Cost& cost) {
  return costliest_groups_first(n, 1, cost);
}

}  // namespace causal_attention::kernels
