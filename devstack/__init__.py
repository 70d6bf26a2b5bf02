"""`make run`'s local stack (`python -m devstack`): Redis, both services and the demo registry, on loopback."""
