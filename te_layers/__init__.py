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
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
