"""Grouped GEMM for MoE experts (``grouped_dense``): consecutive row groups of x, each multiplied by
its own expert kernel, with group sizes on the device. Implementations: ``reference`` (pure JAX,
the CPU path) and ``triton`` (persistent grouped GEMM, default on CUDA for bf16/fp16)."""

from te_ops.grouped_dense.api import grouped_dense

__all__ = ["grouped_dense"]
