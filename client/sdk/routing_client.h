// The SDK's routing client: Client::Connect with an etcd:// server address
// (docs/cluster.md). Keeps live nodes and holders from a watch of the
// cluster's etcd prefix (cluster/etcd_mirror.h: no etcd call per request;
// a node that leaves is out of the routing at watch latency), sends each call
// on a context to a holder (owners first, rendezvous placement as the
// nodes compute it), builds to any live node, and retries UNAVAILABLE on the
// next candidate. Its decode sessions fail over mid-session: on UNAVAILABLE
// (or CANCELLED from a proxying node) they re-open on the next holder,
// append again every token appended so far, and retry the call, so the
// results continue as if nothing happened.
//
// Thread-safety: the client is safe for concurrent use; a session is not.
#pragma once

#include <memory>

#include "common/status.h"
#include "ctxcache/client.h"

namespace ctxcache::client::internal {

// options.server is etcd://host:port[,host:port...]/<cluster>.
StatusOr<std::unique_ptr<Client>> ConnectCluster(const ClientOptions& options);

}  // namespace ctxcache::client::internal
