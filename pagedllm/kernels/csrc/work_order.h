// Ordering of the attention kernels' work items for at::parallel_for, which hands each thread a
// contiguous range of items.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace pagedllm {

// Items whose cost grows with their first_pos, reordered cheapest, dearest, next cheapest, next
// dearest, ...: every contiguous range then holds about the same work.
template <typename Item>
void interleave_by_position(std::vector<Item>& items) {
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.first_pos < b.first_pos; });
  std::vector<Item> balanced;
  balanced.reserve(items.size());
  for (size_t lo = 0, hi = items.size(); lo < hi;) {
    balanced.push_back(items[lo++]);
    if (lo < hi) balanced.push_back(items[--hi]);
  }
  items.swap(balanced);
}

}  // namespace pagedllm
