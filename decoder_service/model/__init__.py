"""The decoder's model runtime: config, weights, paged KV pool, one ragged step on cpu or cuda.

See docs/model_runtime_interface.md for the step interface every backend implements.
"""
