#include "cluster/placement.h"

#include <algorithm>
#include <set>

#include "common/sha256.h"

namespace ctxcache::cluster {

uint64_t RendezvousScore(const std::string& node_id, const std::string& context_id_hex) {
  Sha256 h;
  h.Update(node_id);
  const char sep = '\0';
  h.Update(&sep, 1);
  h.Update(context_id_hex);
  auto d = h.Finish();
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | d[i];
  return v;
}

std::vector<NodeInfo> OwnersOf(const std::string& context_id_hex, std::vector<NodeInfo> nodes,
                               uint32_t replicas) {
  std::vector<std::pair<uint64_t, size_t>> ranked;
  ranked.reserve(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    ranked.emplace_back(RendezvousScore(nodes[i].node_id, context_id_hex), i);
  }
  std::sort(ranked.begin(), ranked.end(), [&](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    return nodes[a.second].node_id < nodes[b.second].node_id;
  });
  std::vector<NodeInfo> out;
  std::vector<bool> taken(nodes.size(), false);
  std::set<std::string> used_zones;
  const size_t want = std::min<size_t>(replicas, nodes.size());
  // Pass 1: one node per zone, in score order; pass 2: the rest by score.
  for (int pass = 0; pass < 2 && out.size() < want; ++pass) {
    for (const auto& [score, i] : ranked) {
      if (out.size() == want) break;
      if (taken[i]) continue;
      if (pass == 0 && used_zones.count(nodes[i].zone)) continue;
      taken[i] = true;
      used_zones.insert(nodes[i].zone);
      out.push_back(nodes[i]);
    }
  }
  return out;
}

}  // namespace ctxcache::cluster
