"""te_ops: fused transformer and MoE ops for JAX, with CUDA implementations and pure-JAX references.

Every op takes ``implementation=`` (None = best available on the platform the computation runs on);
:func:`use_implementation` sets it for a whole block of code.
"""

from te_ops._core.native import counters as native_counters
from te_ops._core.native import native_unavailable_reason
from te_ops._core.native import reset_counters as reset_native_counters
from te_ops._core.registry import ImplementationUnavailableError, use_implementation
from te_ops.dense import dense
from te_ops.fused_attention import fused_attention
from te_ops.grouped_dense import grouped_dense, grouped_ffn
from te_ops.normalization import NormOutput, layer_norm, rms_norm
from te_ops.permutation import TokenDispatchResult, sort_chunks_by_index, token_combine, token_dispatch
from te_ops.router import (
    compute_routing_scores_for_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
    pack_routing_map,
    unpack_routing_map,
)
from te_ops.softmax import scaled_masked_softmax, scaled_softmax, scaled_upper_triang_masked_softmax

__version__ = "0.1.0"

__all__ = [
    "ImplementationUnavailableError",
    "NormOutput",
    "TokenDispatchResult",
    "compute_routing_scores_for_aux_loss",
    "dense",
    "fused_attention",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "grouped_dense",
    "grouped_ffn",
    "layer_norm",
    "native_counters",
    "native_unavailable_reason",
    "pack_routing_map",
    "reset_native_counters",
    "rms_norm",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
    "sort_chunks_by_index",
    "token_combine",
    "token_dispatch",
    "unpack_routing_map",
    "use_implementation",
]
