"""FP8 scaling recipes: plain, frozen, hashable values (static under ``jit``), passed by argument.

A recipe says how a tensor of a given *role* is scaled before it is rounded to an FP8 format:

* ``"x"``: activations (the left operand of a forward GEMM);
* ``"w"``: weights (the right operand);
* ``"g"``: gradients flowing backward (the output gradient of a GEMM).

Three families (the numbers each one produces are defined in :mod:`te_ops.fp8.reference` and in
docs/semantics.md, "FP8 quantization"):

* :class:`CurrentScaling`: one scale per tensor, from the tensor's own amax at quantization time.
* :class:`DelayedScaling`: one scale per tensor, from a history of earlier amaxes; the state is an
  explicit pytree (:class:`DelayedScalingState`) that :func:`te_ops.fp8.quantize` takes and returns.
* :class:`BlockScaling`: one scale per block (DeepSeek-V3 style: 1 x 128 tiles for activations and
  gradients, 128 x 128 blocks for weights), optionally rounded down to a power of two.

Formats are JAX dtypes: ``jnp.float8_e4m3fn`` (max 448, 3 mantissa bits) and ``jnp.float8_e5m2``
(max 57344, 2 mantissa bits). ``HYBRID`` means E4M3 forward (``x``, ``w``) and E5M2 backward (``g``);
``E4M3`` means E4M3 for every role.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FORMATS = (E4M3, E5M2)
ROLES = ("x", "w", "g")
Role = Literal["x", "w", "g"]
FormatPolicy = Literal["hybrid", "e4m3"]


def format_max(fmt) -> float:
    """Largest finite value of an FP8 format: 448 for E4M3 (fn), 57344 for E5M2."""
    return float(jnp.finfo(jnp.dtype(fmt)).max)


def _check_policy(owner: str, policy: str) -> None:
    if policy not in ("hybrid", "e4m3"):
        raise ValueError(
            f"te_ops.fp8.{owner}: formats must be 'hybrid' (E4M3 forward, E5M2 gradients) or 'e4m3' "
            f"(E4M3 everywhere), got {policy!r}"
        )


def _check_margin(owner: str, margin) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"te_ops.fp8.{owner}: margin must be an int >= 0 (scale / 2**margin), got {margin!r}")


def _check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"te_ops.fp8.{owner}: {name} must be a bool, got {value!r}")


def role_format(policy: FormatPolicy, role: Role) -> jnp.dtype:
    """The FP8 format of a tensor role under a format policy."""
    if role not in ROLES:
        raise ValueError(f"te_ops.fp8: role must be one of {ROLES} (activation, weight, gradient), got {role!r}")
    return E5M2 if (policy == "hybrid" and role == "g") else E4M3


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor scale from the tensor's own amax: ``scale = fmax / amax / 2**margin``.

    Attributes:
      formats: "hybrid" (E4M3 forward, E5M2 gradients, the default) or "e4m3".
      margin: int >= 0; the scale is divided by ``2**margin`` (headroom for the next values).
      power_of_2: round the scale down to a power of two (the quantized values are then exact
        multiples of the inputs' binary exponents; dequantization is exact up to rounding).
      fast_accumulation: the accumulation precision of the per-tensor FP8 GEMMs on the GPU. False
        (default): float32 sums (cuBLASLt promotes the tensor cores' partial sums to float32, the
        reference's arithmetic up to summation order). True: cuBLASLt's fast-accumulation mode, which
        keeps partial sums in the tensor cores' reduced-precision accumulator (TransformerEngine's
        forward default; faster, less accurate for long K). No effect on the reference path or on
        block-scaled kernels (which promote every 128 of K).
    """

    formats: FormatPolicy = "hybrid"
    margin: int = 0
    power_of_2: bool = False
    fast_accumulation: bool = False

    def __post_init__(self):
        _check_policy("CurrentScaling", self.formats)
        _check_margin("CurrentScaling", self.margin)
        _check_bool("CurrentScaling", "fast_accumulation", self.fast_accumulation)

    def format(self, role: Role) -> jnp.dtype:
        return role_format(self.formats, role)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scale from the amax history of earlier steps (TransformerEngine's default recipe).

    The scale used at step ``t`` comes from the amaxes recorded up to step ``t - 1``; the tensor's
    own amax is recorded into the history for the next step. ``amax_compute_algo``: "max" (the
    largest amax in the history) or "most_recent" (the last recorded one).

    Attributes:
      formats: "hybrid" (default) or "e4m3".
      history_len: int >= 1, amaxes kept per tensor.
      margin: int >= 0, as in :class:`CurrentScaling`.
      amax_compute_algo: "max" or "most_recent".
      fast_accumulation: as in :class:`CurrentScaling`.
    """

    formats: FormatPolicy = "hybrid"
    history_len: int = 1024
    margin: int = 0
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    fast_accumulation: bool = False

    def __post_init__(self):
        _check_policy("DelayedScaling", self.formats)
        _check_margin("DelayedScaling", self.margin)
        _check_bool("DelayedScaling", "fast_accumulation", self.fast_accumulation)
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"te_ops.fp8.DelayedScaling: history_len must be an int >= 1, got {self.history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                "te_ops.fp8.DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', got "
                f"{self.amax_compute_algo!r}"
            )

    def format(self, role: Role) -> jnp.dtype:
        return role_format(self.formats, role)


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """One scale per block: ``x``/``g`` in ``act_block`` tiles of the last two axes (1 x 128: one
    scale per row per 128 columns), ``w`` in ``weight_block`` blocks (128 x 128).

    Attributes:
      formats: "e4m3" (DeepSeek-V3: E4M3 everywhere, the default) or "hybrid".
      act_block: (rows, cols) of an activation / gradient block.
      weight_block: (rows, cols) of a weight block.
      power_of_2: round every block scale down to a power of two (default True).
    """

    formats: FormatPolicy = "e4m3"
    act_block: tuple[int, int] = (1, 128)
    weight_block: tuple[int, int] = (128, 128)
    power_of_2: bool = True

    def __post_init__(self):
        _check_policy("BlockScaling", self.formats)
        for name in ("act_block", "weight_block"):
            b = getattr(self, name)
            if not (
                isinstance(b, tuple) and len(b) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                             for v in b)
            ):  # fmt: skip
                raise ValueError(
                    f"te_ops.fp8.BlockScaling: {name} must be a (rows, cols) tuple of ints >= 1, got {b!r}"
                )

    def format(self, role: Role) -> jnp.dtype:
        return role_format(self.formats, role)

    def block(self, role: Role) -> tuple[int, int]:
        role_format(self.formats, role)  # validates the role
        return self.weight_block if role == "w" else self.act_block


Recipe = CurrentScaling | DelayedScaling | BlockScaling
