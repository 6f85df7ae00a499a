# etcd for deploy/compose.yaml, from Debian 12's etcd-server (3.4): no image
# registry other than the debian:12 base is needed.
FROM debian:12
RUN apt-get update && apt-get install -y --no-install-recommends etcd-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/etcd && chown etcd:etcd /var/lib/etcd
# (the package creates the system user etcd, home /var/lib/etcd)
USER etcd
EXPOSE 2379
ENTRYPOINT ["/usr/bin/etcd", "--data-dir", "/var/lib/etcd", \
            "--listen-client-urls", "http://0.0.0.0:2379", \
            "--advertise-client-urls", "http://etcd:2379"]
