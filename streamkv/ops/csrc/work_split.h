// Splitting a kernel's tasks between threads by their cost.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

// f(begin, end) once for each thread's share of the tasks [0, n): contiguous ranges, in order, cut where the
// running total of cost(i) crosses each thread's equal part (a task goes to the thread that holds its middle).
// at::parallel_for cuts equal counts instead: with sequences of unequal lengths one thread is left with most of
// the tokens and the other waits at the barrier. With equal costs the runs are as even as counts allow.
template <typename Cost, typename F>
void parallel_for_by_cost(int64_t n, const Cost& cost, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    f(int64_t{0}, n);
    return;
  }
  std::vector<int64_t> cuts(threads + 1, n);
  cuts[0] = 0;
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(cost(i));
  double before = 0;  // cost of tasks [0, i)
  for (int64_t i = 0, t = 1; i < n && t < threads; ++i) {
    const double c = static_cast<double>(cost(i));
    // Task i's middle is past the t-th cut: it and what follows go to thread t (and later).
    while (t < threads && 2 * before + c > 2 * total * t / threads) cuts[t++] = i;
    before += c;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (cuts[t] < cuts[t + 1]) f(cuts[t], cuts[t + 1]);
  });
}
