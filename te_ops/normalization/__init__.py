"""Fused normalization: rms_norm and layer_norm (optionally fused with the residual addition).

The two public ops live in one folder because they are one computation (LayerNorm is RMSNorm of
the centred row plus a shift): they share the reference, the residual layout, the Triton kernels
(``IS_RMS`` switches the mean off) and the sharding rule.
"""

from te_ops.normalization.api import NormOutput, layer_norm, rms_norm

__all__ = ["NormOutput", "layer_norm", "rms_norm"]
