// Placement: which live nodes own a context (rendezvous / highest-random-
// weight hashing). Every node and every routing client computes the same
// owners from the same node list, with no coordination; a join or leave
// moves only the contexts whose top-R set the node enters or leaves.
//
// Score of node n for context c: the first 8 bytes, big-endian, of
// SHA-256(node_id || 0x00 || context_id_hex). Owners are the nodes in
// descending score order (ties: smaller node_id first), except that while
// some zone is not yet used, a node of an already used zone is passed over
// (replicas spread across zones first). docs/cluster.md gives the same rule
// for other clients (python/ctxcache/cluster.py implements it).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ctxcache::cluster {

struct NodeInfo {
  std::string node_id;
  std::string address;  // host:port that peers and clients dial
  std::string zone;
  uint64_t capacity_bytes = 0;  // 0 = unlimited
};

uint64_t RendezvousScore(const std::string& node_id, const std::string& context_id_hex);

// The first min(replicas, nodes.size()) owners of `context_id_hex`, first
// owner first.
std::vector<NodeInfo> OwnersOf(const std::string& context_id_hex, std::vector<NodeInfo> nodes,
                               uint32_t replicas);

}  // namespace ctxcache::cluster
