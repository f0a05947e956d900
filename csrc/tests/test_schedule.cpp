// The parallel schedule's orders (csrc/attention/schedule.h): costliest_first over all items, and
// costliest_groups_first, which keeps a group's items together (the forward's query blocks of one
// (batch, head)) with the groups by total cost and each group's items by cost.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "attention/schedule.h"

namespace {

namespace k = causal_attention::kernels;

TEST(Schedule, CostliestFirstIsStableAndDescending) {
  const std::vector<int64_t> cost = {3, 7, 3, 9, 0, 7};
  const auto order = k::costliest_first(static_cast<int64_t>(cost.size()), [&](int64_t i) { return cost[i]; });
  EXPECT_EQ(order, (std::vector<int64_t>{3, 1, 5, 0, 2, 4}));  // ties keep item order
}

TEST(Schedule, GroupsByTotalCostThenItemsByCost) {
  // Three groups of 4 (the last one short: 2 items): totals 10, 22, 10.
  const std::vector<int64_t> cost = {1, 2, 3, 4, /**/ 8, 2, 5, 7, /**/ 4, 6};
  const auto order = k::costliest_groups_first(static_cast<int64_t>(cost.size()), 4, [&](int64_t i) { return cost[i]; });
  // Group 1 first (22), then groups 0 and 2 (tied at 10: group order); each group's items by cost.
  EXPECT_EQ(order, (std::vector<int64_t>{4, 7, 6, 5, /**/ 3, 2, 1, 0, /**/ 9, 8}));
}

TEST(Schedule, GroupedOrderIsAPermutationForAnyGroupSize) {
  for (const int64_t n : {0, 1, 5, 16, 33}) {
    for (const int64_t per_group : {1, 3, 4, 16, 40}) {
      const auto order = k::costliest_groups_first(n, per_group, [](int64_t i) { return (i * 7) % 5; });
      std::vector<int64_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      std::vector<int64_t> all(static_cast<size_t>(n));
      std::iota(all.begin(), all.end(), 0);
      EXPECT_EQ(sorted, all) << "n=" << n << " per_group=" << per_group;
      // A group's items are consecutive in the order.
      for (size_t i = 1; i < order.size(); ++i) {
        if (order[i] / per_group != order[i - 1] / per_group) {
          for (size_t j = i + 1; j < order.size(); ++j) {
            EXPECT_NE(order[j] / per_group, order[i - 1] / per_group) << "n=" << n << " per_group=" << per_group;
          }
        }
      }
    }
  }
}

}  // namespace
