"""The GPU runtime all device code launches through (launcher, intrinsics, graphs, simulator); it knows no model."""
from . import compat  # noqa: F401  (numpy's row_stack alias: must run before any kernel compiles)
