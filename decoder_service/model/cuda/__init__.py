"""The CUDA backend: numba.cuda kernels, launched by the engine (raw driver launches or graphs).

Importing this package applies the numpy/numba-cuda compatibility fix before numba.cuda compiles
anything (see compat.py). Import ``backend.CudaBackend`` for the model; ``kernels`` holds the
@cuda.jit kernels, ``launcher`` the launch machinery.
"""
from . import compat  # noqa: F401  (must run before any kernel compiles)
