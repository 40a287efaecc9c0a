"""The DCMHA kernels of the installed package (a save's remote code does not carry them): "cpu", a C++ operator
(`dcmha_cpu.py`, `csrc/dcmha_cpu.cpp`, built on first use by `build.py`), and "triton", Triton kernels for CUDA
(`dcmha_triton.py`; Triton optional). `modeling_dcformer/__init__.py` registers both with `DCMHAInterface`."""

from .dcmha_cpu import CPU, CPUBackend
from .dcmha_triton import TRITON, TritonBackend

__all__ = ["CPU", "TRITON", "CPUBackend", "TritonBackend"]
