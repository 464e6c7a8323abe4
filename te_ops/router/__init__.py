"""MoE router ops: fused_topk_with_score_function, compute_routing_scores_for_aux_loss,
fused_moe_aux_loss.

The three public ops live in one folder (not one folder each) because they are the three stages
of one router and share almost everything: the score functions (softmax / sigmoid and their
gradients), the tie-breaking top-k selection (the aux-loss scores use the same selection as the
routing top-k), the compact routing-map format, one CUDA kernel file set (csrc/router) with one
warp-per-token kernel for both row-wise ops, and the token-sharding rules. Each op still has its
own registry family, custom VJP and residual layout (see reference.py).
"""

from te_ops.router.api import (
    compute_routing_scores_for_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
    pack_routing_map,
    unpack_routing_map,
)

__all__ = [
    "compute_routing_scores_for_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "pack_routing_map",
    "unpack_routing_map",
]
