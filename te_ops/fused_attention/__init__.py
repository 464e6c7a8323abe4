"""Fused scaled dot-product attention (cuDNN SDPA natively, pure JAX as the reference).

See :func:`fused_attention` for the semantics (masks, packed sequences, sliding window, bias, GQA,
dropout) and ``reference.py`` for the specification.
"""

from te_ops.fused_attention.api import MASK_TYPES, MAX_HEAD_DIM, fused_attention

__all__ = ["MASK_TYPES", "MAX_HEAD_DIM", "fused_attention"]
