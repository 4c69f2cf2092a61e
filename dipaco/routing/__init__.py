"""Routing documents to paths (floor 1): prefix features, saved routers, k-means and its balance
control, the discriminative router, sharding, routed evaluation and test-time re-routing."""
