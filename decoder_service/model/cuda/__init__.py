"""The generator's CUDA backend: its kernels by family, their registry and CudaBackend, on decoder_service.gpu."""
from decoder_service.gpu import compat  # noqa: F401  (numpy's row_stack alias: must run before any kernel compiles)
