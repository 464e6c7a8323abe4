"""FP8: scaling recipes, the quantized-tensor pytree and the reference quantization
(:mod:`te_ops.fp8.recipes`, :mod:`te_ops.fp8.reference`, :mod:`te_ops.fp8.api`)."""

from te_ops.fp8.api import dact_dbias_quantize, dequantize, initial_state, quantize
from te_ops.fp8.dense import DenseScalingState, fp8_dense, initial_dense_state
from te_ops.fp8.dispatch import (
    FP8DispatchResult,
    QuantizedDispatchResult,
    fp8_dispatch_grouped_dense,
    token_dispatch_quantized,
)
from te_ops.fp8.ffn import fp8_dispatch_ffn
from te_ops.fp8.grouped import fp8_grouped_dense, initial_grouped_state
from te_ops.fp8.recipes import E4M3, E5M2, BlockScaling, CurrentScaling, DelayedScaling, format_max
from te_ops.fp8.reference import DelayedScalingState, QuantizedTensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8DispatchResult",
    "QuantizedDispatchResult",
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "DelayedScalingState",
    "DenseScalingState",
    "QuantizedTensor",
    "dact_dbias_quantize",
    "dequantize",
    "fp8_dense",
    "fp8_dispatch_ffn",
    "fp8_dispatch_grouped_dense",
    "fp8_grouped_dense",
    "format_max",
    "initial_dense_state",
    "initial_grouped_state",
    "initial_state",
    "quantize",
    "token_dispatch_quantized",
]
