// Percentile of a sample (latency reports of the benches and the CLI).
//
// Thread-safety: pure function.
#pragma once

#include <vector>

namespace ctxcache {

// The p-quantile (p in [0, 1]) of v by nearest rank: the element at index
// round(p * (size - 1)) of v sorted ascending (halves round up), so p = 0.5
// of an even count takes the upper middle. 0 for an empty v.
double Percentile(std::vector<double> v, double p);

}  // namespace ctxcache
