"""Scaled softmax family: scaled_softmax, scaled_masked_softmax, scaled_upper_triang_masked_softmax.

The three public ops live in one folder (not one folder each) because they are one computation
with three masking modes: they share the reference, the residual layout, the CUDA kernels and the
sharding rule. ``mode`` selects the masking ("none", "mask", "causal").
"""

from te_ops.softmax.api import scaled_masked_softmax, scaled_softmax, scaled_upper_triang_masked_softmax

__all__ = ["scaled_masked_softmax", "scaled_softmax", "scaled_upper_triang_masked_softmax"]
