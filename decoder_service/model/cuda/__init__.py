"""The CUDA backend: numba.cuda kernels, launched by the engine (raw driver launches or graphs).

Importing this package applies the numpy/numba-cuda compatibility fix before numba.cuda compiles
anything (see compat.py). ``backend.CudaBackend`` is the model; the kernels live in family modules
(``kernels`` registers them), ``device_trie`` holds the catalog tries, ``launcher`` the launch machinery.
"""
from . import compat  # noqa: F401  (must run before any kernel compiles)
