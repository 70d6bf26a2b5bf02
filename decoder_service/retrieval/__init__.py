"""Retrieval, the first stage: the host's scorer (host.py), the device's (cuda.py), the tool vectors (vectors.py)."""
