"""FP8 recipes in te_layers: the ``fp8=`` argument, the :func:`fp8_recipe` context, and the
delayed-scaling state shared by the Linen, NNX and Equinox modules (framework-free).

Which recipe a layer runs with is decided when the layer is called (traced): the layer's own
``fp8=`` argument when it is a recipe, else the innermost :func:`fp8_recipe` context, else none
(high precision). ``fp8=False`` keeps a layer in high precision even inside a context. A layer
built under a DelayedScaling context holds state for it; called outside every context it runs in high
precision without touching that state, and warns (:func:`warn_if_state_unused`); so does one called
inside a CurrentScaling or BlockScaling context (it runs with that recipe).

Delayed scaling needs per-layer state (amax histories and scales of the layer's activation,
kernel and output gradient). ``te_ops.fp8.fp8_dense`` returns the updated state as the
*cotangent* of its ``state`` argument, so each framework differentiates its loss with respect to
the state as well as the parameters and keeps that "gradient" as the next state (never handing it
to an optimizer). The state of one Dense is stored, in every framework, as the plain dict::

    {"x": {"amax_history": f32[L], "scale": f32[]}, "w": {...}, "g": {...}}

(:func:`initial_state_tree`), which checkpoints like any other array tree. A MoEBlock's experts
keep ``{"wi": tree, "wo": tree}`` (:func:`initial_moe_state_tree`: one tree per grouped GEMM, the
kernel entry ``w`` with one history and scale per expert, ``[E, L]`` and ``[E]``); the helpers
below treat those entries expert by expert (they broadcast over leading axes).

Two rules about the update (:func:`updated_tree`, :func:`accumulate_trees`):

* A layer that took no part in the backward pass (its output did not reach the loss) gets a zero
  cotangent; its state is kept, not zeroed (an updated state always has a scale > 0).
* A layer's state must be used once per differentiated function: if the same state is used twice
  (one layer called twice, or a scan that broadcasts the state over microbatches), JAX *sums* the
  two cotangents, which is not a state. Run one ``value_and_grad`` per microbatch instead and combine
  the updates with :func:`accumulate_trees`: every update of one starting state differs from the
  others only in the amax just recorded (index 0 of the history) and the scale that follows from it,
  so the combination (one step that saw every microbatch: the max of their amaxes) is, for each
  tensor, the update with the largest recorded amax.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from te_layers._validation import err
from te_ops.fp8 import (
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    DenseScalingState,
    initial_dense_state,
    initial_grouped_state,
)
from te_ops.fp8.reference import DelayedScalingState

RECIPES = (CurrentScaling, DelayedScaling, BlockScaling)
ROLES = ("x", "w", "g")
STATE_COLLECTION = "fp8_state"  # the Linen variable collection

_CONTEXT: contextvars.ContextVar[Any] = contextvars.ContextVar("te_layers_fp8_recipe", default=None)
# True inside any fp8_recipe(...) block, fp8_recipe(None) included: tells "no context at all" (a layer
# holding delayed-scaling state warns) from "FP8 turned off on purpose" (it does not).
_ENTERED: contextvars.ContextVar[bool] = contextvars.ContextVar("te_layers_fp8_recipe_entered", default=False)


def _desc(v: Any) -> str:
    return f"{v!r:.100} ({type(v).__name__})"


def check_recipe_arg(layer: str, fp8: Any, name: str = "fp8") -> None:
    """``fp8`` must be None (use the context), False (high precision) or a te_ops.fp8 recipe."""
    if fp8 is None or fp8 is False or isinstance(fp8, RECIPES):
        return
    raise TypeError(
        err(layer, f"{name} must be None (use the te_layers.fp8_recipe context), False (high precision) or a "
                   f"te_ops.fp8 CurrentScaling, DelayedScaling or BlockScaling recipe, got {_desc(fp8)}.")
    )  # fmt: skip


@contextlib.contextmanager
def fp8_recipe(recipe: CurrentScaling | DelayedScaling | BlockScaling | None) -> Iterator[Any]:
    """Run every te_layers FP8-capable GEMM (Dense, the MultiHeadAttention projections, the MoEBlock
    experts) inside the block with ``recipe``, unless a layer says otherwise with its own ``fp8=``.

    Read when a layer is called (traced): wrap the ``init``/``apply`` (Linen), the construction and
    the calls (NNX, Equinox: delayed scaling needs the state created at construction) or the jitted
    step's body. Contexts nest; ``fp8_recipe(None)`` turns FP8 off inside an outer context.

    A layer that holds delayed-scaling state (built, or Linen: ``init``-ed, under a DelayedScaling
    recipe without its own ``fp8=``) but is called outside every ``fp8_recipe`` block runs in high
    precision and its state is neither used nor updated; it then warns (a ``UserWarning`` at trace
    time, naming the layer). Call it inside the context, or build it with ``fp8=`` so it does not
    depend on the context; inside ``fp8_recipe(None)`` it runs in high precision without the warning.
    Called inside a CurrentScaling or BlockScaling block, such a layer runs with that recipe, leaves
    its delayed-scaling state as it is, and warns the same way.

    Args:
      recipe: a ``te_ops.fp8`` ``CurrentScaling``, ``DelayedScaling`` or ``BlockScaling``, or None.

    Example::

        with te_layers.fp8_recipe(te_ops.fp8.CurrentScaling()):
            y = model.apply(variables, x)
    """
    if recipe is not None and not isinstance(recipe, RECIPES):
        raise TypeError(
            "te_layers.fp8_recipe: recipe must be None or a te_ops.fp8 CurrentScaling, DelayedScaling or "
            f"BlockScaling, got {_desc(recipe)}."
        )
    token, entered = _CONTEXT.set(recipe), _ENTERED.set(True)
    try:
        yield recipe
    finally:
        _ENTERED.reset(entered)
        _CONTEXT.reset(token)


def current_fp8_recipe() -> CurrentScaling | DelayedScaling | BlockScaling | None:
    """The recipe of the innermost :func:`fp8_recipe` context (None outside any)."""
    return _CONTEXT.get()


# Frames skipped when the warning below picks the line it is reported at: the user's call of the layer,
# not te_layers or the framework / JAX code between (jit tracing, Linen's method wrappers, nnx transforms).
def _package_dirs(*names: str) -> tuple[str, ...]:
    import importlib.util

    out = []
    for n in names:
        spec = importlib.util.find_spec(n)
        if spec is not None and spec.origin:
            out.append(os.path.dirname(spec.origin) + os.sep)
    return tuple(out)


_SKIP_FRAMES = _package_dirs("te_layers", "flax", "equinox", "jax")


def warn_if_state_unused(layer: str, fp8: Any, recipe: Any, holds_state: bool) -> None:
    """Warn when a layer that holds delayed-scaling state runs without it: ``fp8`` is None (the layer
    follows the context), ``holds_state``, and either no :func:`fp8_recipe` block is active (``recipe``
    resolved to None outside every block: the layer runs in high precision) or the active recipe is
    not a ``DelayedScaling`` (a CurrentScaling / BlockScaling context: the layer runs with that recipe).
    Called when the layer is called (traced). Python's default warning filter shows it once per layer
    class and call site."""
    if not holds_state or fp8 is not None:
        return
    if recipe is None:
        if _ENTERED.get():  # fp8_recipe(None): high precision on purpose
            return
        what = (
            "is called with no te_layers.fp8_recipe context active, so it runs in high precision and its FP8 "
            "state is neither used nor updated"
        )
    elif isinstance(recipe, DelayedScaling):
        return
    else:
        what = (
            f"is called inside a te_layers.fp8_recipe({type(recipe).__name__}(...)) context, so it runs with "
            f"that recipe and its delayed-scaling state is neither used nor updated"
        )
    warnings.warn(
        err(layer, f"this layer holds delayed-scaling FP8 state (it was built, or Linen: init-ed, under a "
                   f"DelayedScaling recipe) but {what}. Call it (the jitted step, or apply) inside "
                   "`with te_layers.fp8_recipe(DelayedScaling(...)):` as at construction, or build it with "
                   "fp8=DelayedScaling(...) so that it does not depend on the context; to run it in high precision "
                   "on purpose, call it inside te_layers.fp8_recipe(None)."),
        UserWarning,
        skip_file_prefixes=_SKIP_FRAMES,
    )  # fmt: skip


def resolve(layer: str, fp8: Any, *, grouped: bool = False, name: str = "fp8"):
    """The recipe a layer runs with: its own ``fp8`` (a recipe; False = none), else the context's.

    ``grouped``: the layer's GEMMs are ``te_ops.fp8.fp8_grouped_dense`` (MoE experts), which takes
    CurrentScaling, DelayedScaling or BlockScaling with 1 x 128 / 128 x 128 blocks; anything else is refused here
    with a message naming the argument or the context it came from. Dense GEMMs need square
    BlockScaling weight blocks (the input gradient reuses them transposed).
    """
    check_recipe_arg(layer, fp8, name)
    if fp8 is False:
        return None
    recipe = fp8 if fp8 is not None else _CONTEXT.get()
    if recipe is None:
        return None
    source = f"{name}=" if fp8 is not None else "the te_layers.fp8_recipe context's recipe"
    if grouped:
        blocks = (getattr(recipe, "act_block", None), getattr(recipe, "weight_block", None))
        block_ok = isinstance(recipe, BlockScaling) and blocks == ((1, 128), (128, 128))
        if not (isinstance(recipe, (CurrentScaling, DelayedScaling)) or block_ok):
            raise ValueError(
                err(layer, f"{name} (the experts' recipe) must be CurrentScaling, DelayedScaling, or BlockScaling "
                           "with act_block (1, 128) and weight_block (128, 128) (what te_ops.fp8.fp8_grouped_dense "
                           f"takes); got {recipe!r} from {source}. Pass {name}=BlockScaling() (or another recipe it "
                           f"takes, or {name}=False for high precision) to this layer.")
            )  # fmt: skip
    elif isinstance(recipe, BlockScaling) and recipe.weight_block[0] != recipe.weight_block[1]:
        raise ValueError(
            err(layer, f"{name}: BlockScaling.weight_block must be square for a Dense GEMM (its input gradient reuses "
                       f"the blocks transposed), got {recipe.weight_block} from {source}.")
        )  # fmt: skip
    return recipe


# ----------------------------------------------------------------------------------------------
# Delayed-scaling state as a plain dict tree
# ----------------------------------------------------------------------------------------------


def initial_state_tree(recipe: DelayedScaling) -> dict:
    """Fresh state of one Dense GEMM (all-zero amax histories, scales 1) as a dict tree."""
    return to_tree(initial_dense_state(recipe))


def to_tree(state: DenseScalingState) -> dict:
    return {r: {"amax_history": getattr(state, r).amax_history, "scale": getattr(state, r).scale} for r in ROLES}


def from_tree(tree: dict) -> DenseScalingState:
    return DenseScalingState(*(DelayedScalingState(tree[r]["amax_history"], tree[r]["scale"]) for r in ROLES))


def check_state_tree(layer: str, tree: Any, recipe: DelayedScaling, where: str) -> None:
    """A clear error when a layer's stored state does not fit ``recipe`` (missing or another history_len)."""
    ok = isinstance(tree, dict) and set(tree) == set(ROLES)
    if ok:
        for r in ROLES:
            t = tree[r]
            ok = ok and isinstance(t, dict) and set(t) == {"amax_history", "scale"}
            ok = ok and jnp.shape(t["amax_history"]) == (recipe.history_len,) and jnp.shape(t["scale"]) == ()
    if not ok:
        shapes = jax.tree.map(jnp.shape, tree) if tree is not None else None
        raise ValueError(
            err(layer, f"fp8 is {recipe!r}, which needs this layer's delayed-scaling state in {where} "
                       f"({{'x', 'w', 'g'}} each with amax_history [{recipe.history_len}] and a scalar scale), got "
                       f"{shapes!r:.200}. Create the layer (Linen: init) with the same recipe, by fp8= or inside "
                       "te_layers.fp8_recipe(...).")
        )  # fmt: skip


MOE_GEMMS = ("wi", "wo")  # the MoEBlock's two grouped GEMMs, each with its own state


def initial_moe_state_tree(recipe: DelayedScaling, num_experts: int) -> dict:
    """Fresh state of a MoEBlock's experts: ``{"wi": ..., "wo": ...}``, each the state of one
    ``fp8_grouped_dense`` (x and g as for a Dense, w one per expert: amax_history
    ``[num_experts, history_len]``, scale ``[num_experts]``)."""
    return {k: to_tree(initial_grouped_state(recipe, num_experts)) for k in MOE_GEMMS}


def check_moe_state_tree(layer: str, tree: Any, recipe: DelayedScaling, num_experts: int, where: str) -> None:
    """A clear error when a MoEBlock's stored state does not fit ``recipe`` and its experts."""
    h, e = recipe.history_len, num_experts
    want = {"x": ((h,), ()), "w": ((e, h), (e,)), "g": ((h,), ())}
    ok = isinstance(tree, dict) and set(tree) == set(MOE_GEMMS)
    for k in MOE_GEMMS if ok else ():
        t = tree[k]
        ok = ok and isinstance(t, dict) and set(t) == set(ROLES)
        for r in ROLES if ok else ():
            ok = ok and isinstance(t[r], dict) and set(t[r]) == {"amax_history", "scale"}
            ok = ok and (jnp.shape(t[r]["amax_history"]), jnp.shape(t[r]["scale"])) == want[r]
    if not ok:
        shapes = jax.tree.map(jnp.shape, tree) if tree is not None else None
        raise ValueError(
            err(layer, f"fp8 is {recipe!r}, which needs the experts' delayed-scaling state in {where} ({{'wi', 'wo'}}, "
                       f"each {{'x', 'g'}} with amax_history [{h}] and a scalar scale and 'w' with amax_history "
                       f"[{e}, {h}] and scale [{e}], one per expert), got {shapes!r:.300}. Create the layer (Linen: "
                       "init) with the same recipe, by fp8= or inside te_layers.fp8_recipe(...).")
        )  # fmt: skip


def _is_tensor_state(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {"amax_history", "scale"}


def _select(cond, a, b):
    """``where(cond, a, b)`` with ``cond`` shaped like the scale (leading axes of stacked states, e.g.
    under ``nn.scan``) broadcast over the history axis."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return jnp.where(jnp.reshape(cond, cond.shape + (1,) * (a.ndim - cond.ndim)), a, b)


def _keep_unused(old: dict, new: dict) -> dict:
    used = jnp.asarray(new["scale"]) > 0  # an updated scale is always > 0; 0 = no backward pass reached it
    return {k: _select(used, new[k], old[k]) for k in old}


def updated_tree(old: Any, cotangent: Any) -> Any:
    """The next delayed-scaling state from the cotangent of the state (what ``value_and_grad`` with
    respect to the state returned): the cotangent itself, except for tensors whose scale cotangent is
    0 (their layer was not in the backward pass), which keep ``old``. Works on any tree holding the
    per-tensor ``{"amax_history", "scale"}`` dicts (a whole collection / nnx.State / eqx State)."""
    return jax.tree.map(
        lambda o, c: _keep_unused(o, c) if _is_tensor_state(o) else c, old, cotangent, is_leaf=_is_tensor_state
    )


def _pick_larger(a: dict, b: dict) -> dict:
    take_b = jnp.asarray(b["amax_history"])[..., 0] > jnp.asarray(a["amax_history"])[..., 0]
    return {k: _select(take_b, b[k], a[k]) for k in a}


def accumulate_trees(first: Any, *others: Any) -> Any:
    """Combine updated states that started from the same state (one per microbatch) into the state
    after one step that saw every microbatch: per tensor, the update whose recorded amax (index 0 of
    the history) is largest, i.e. the max of the microbatches' amaxes, never their sum."""
    out = first
    for o in others:
        out = jax.tree.map(
            lambda a, b: _pick_larger(a, b) if _is_tensor_state(a) else b, out, o, is_leaf=_is_tensor_state
        )
    return out


def _pick_largest_copy(node: dict) -> dict:
    i = jnp.argmax(jnp.asarray(node["amax_history"])[:, 0])
    return {k: jnp.asarray(v)[i] for k, v in node.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def shard_replicated_state(tree: Any, n: int) -> Any:
    """``n`` copies of a state tree along a new leading axis, to hand one to each shard of a
    ``shard_map`` (spec ``P(axis)``) where the tensor is split over the shards (the experts' input
    rows under expert parallelism). The cotangent combines the shards' updates as
    :func:`accumulate_trees` does: per tensor the copy with the largest recorded amax, which is the
    update from the global amax. A replicated (``P()``) input would instead get the *sum* of the
    shards' cotangents, which is not a state."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a)), tree)


def _srs_fwd(tree, n):
    return shard_replicated_state(tree, n), None


def _srs_bwd(n, _, ct):
    return (jax.tree.map(_pick_largest_copy, ct, is_leaf=_is_tensor_state),)


shard_replicated_state.defvjp(_srs_fwd, _srs_bwd)


# ----------------------------------------------------------------------------------------------
# The GEMMs
# ----------------------------------------------------------------------------------------------


def fp8_dense_apply(x, kernel, bias, recipe, *, activation=None, state_tree=None):
    """``activation(x @ kernel + bias)`` through ``te_ops.fp8.fp8_dense`` (x, kernel, bias already in
    the compute dtype); the activation is fused where fp8_dense takes it, else applied after."""
    from te_layers._common import FUSED_ACTIVATIONS, activation_fn
    from te_ops.fp8 import fp8_dense

    state = from_tree(state_tree) if isinstance(recipe, DelayedScaling) else None
    fused = activation is None or (isinstance(activation, str) and activation in FUSED_ACTIVATIONS)
    y = fp8_dense(x, kernel, recipe, bias=bias, state=state, activation=activation if fused else None)
    return y if fused else activation_fn(activation)(y)
