"""A cluster of daemons: node identity and roles, the peer set, discovery (HTTP and etcd)."""
