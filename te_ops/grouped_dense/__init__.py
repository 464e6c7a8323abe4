"""Grouped GEMM for MoE experts (``grouped_dense``): consecutive row groups of x, each multiplied by
its own expert kernel, with group sizes on the device; and the experts' whole FFN (``grouped_ffn``:
two grouped GEMMs with the activation between them, fused into their epilogues on CUDA).
Implementations: ``reference`` (pure JAX, the CPU path) and ``triton`` (persistent grouped GEMM,
default on CUDA for bf16/fp16)."""

from te_ops.grouped_dense.api import grouped_dense
from te_ops.grouped_dense.ffn import grouped_ffn
from te_ops.grouped_dense.reference import ffn_activation

__all__ = ["ffn_activation", "grouped_dense", "grouped_ffn"]
