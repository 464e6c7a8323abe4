"""Shared machinery for te_ops: implementation registry and selection, native loading, partitioning."""
