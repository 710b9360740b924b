"""Scaling out: engine replicas on Ray Serve, the prefix-aware router, KV events for outside routers."""
