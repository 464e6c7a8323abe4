"""MoE token permutation: token_dispatch, token_combine, sort_chunks_by_index.

The three public ops live in one folder (not one folder each) because they share one data
structure and one set of kernels: token_combine inverts the row_id_map that token_dispatch writes
(its layout is defined once, in ``reference.py``), token_dispatch's backward *is* a combine and
token_combine's backward a dispatch (same kernels), and sort_chunks_by_index reuses the row
gather kernel. Implementations: ``reference`` (pure JAX, the CPU path), ``triton`` (default on
CUDA) and ``gluon`` (Hopper data-movement kernels; dispatch and combine only).
"""

from te_ops.permutation.api import TokenDispatchResult, sort_chunks_by_index, token_combine, token_dispatch

__all__ = ["TokenDispatchResult", "sort_chunks_by_index", "token_combine", "token_dispatch"]
