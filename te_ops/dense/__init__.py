"""Dense: ``activation(x @ kernel + bias)`` with float32 accumulation (cuBLASLt on CUDA, fused epilogues)."""

from te_ops.dense.api import dense

__all__ = ["dense"]
