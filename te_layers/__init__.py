"""te_layers: Flax Linen, Flax NNX and Equinox modules built on te_ops.

Three flavours with the same maths (``te_layers._common``) and the same parameter shapes and names, so
the same parameters give the same outputs in all three:

* ``te_layers.linen`` — Flax Linen (fields, ``self.param`` with ``nn.with_logical_partitioning``;
  MoE aux losses sown into ``"intermediates"``).
* ``te_layers.nnx`` — Flax NNX (``nnx.Rngs``, ``nnx.Param`` with ``out_sharding`` metadata; aux
  losses sown as ``te_layers.nnx.AuxLoss`` intermediates).
* ``te_layers.eqx`` — Equinox (keyword-only ``key``; MoE modules return the aux loss alongside the
  output).

Each provides ``Dense``, ``Softmax``, ``RMSNorm``, ``LayerNorm`` (optionally fused with the residual
addition), ``DotProductAttention``, ``MultiHeadAttention`` (fused QKV, GQA, RoPE, masks and packed
segments, dropout), ``TopKRouter`` and ``MoEBlock`` (router ->
token_dispatch -> grouped-GEMM expert FFN (gated SiLU/GELU) -> token_combine, optional expert
parallelism over a mesh axis and aux-loss-free expert-bias balancing). Import the flavour you use
(``from te_layers import linen as tel``); this package itself imports no framework.

FP8: Dense, the MultiHeadAttention projections and the MoEBlock experts take ``fp8=`` (a
``te_ops.fp8`` recipe); :func:`fp8_recipe` sets one recipe for a whole model (a layer's own ``fp8=``
wins; ``fp8=False`` keeps a layer in high precision). Delayed-scaling state is kept the way each
framework keeps state: the ``"fp8_state"`` collection (Linen), ``te_layers.nnx.FP8State`` variables
(NNX), ``eqx.nn.State`` (Equinox). The context is read when a layer is called: a layer that holds
delayed-scaling state from the context but is called outside every :func:`fp8_recipe` block runs in
high precision, leaves its state as it is, and warns (``fp8_recipe(None)`` does the same on purpose,
without the warning); called inside a CurrentScaling or BlockScaling context it runs with that
recipe, leaves its state as it is, and warns too.
"""

from te_layers._fp8 import current_fp8_recipe, fp8_recipe

__version__ = "0.1.0"

__all__ = ["__version__", "current_fp8_recipe", "fp8_recipe"]
