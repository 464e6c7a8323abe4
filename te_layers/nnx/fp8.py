"""Delayed-scaling FP8 state in Flax NNX: the :class:`FP8State` variable type and the step helper.

A Dense created with ``DelayedScaling`` (its own ``fp8=`` or the ``te_layers.fp8_recipe`` context at
construction) holds ``dense.fp8_state``, an :class:`FP8State` whose value is
``{"x"|"w"|"g": {"amax_history": f32[history_len], "scale": f32[]}}`` (a MoEBlock's ``moe.fp8_state``
holds ``{"wi": ..., "wo": ...}`` of those, the kernels' ``w`` per expert). ``FP8State`` is not an
``nnx.Param``, so ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never touches it, and
``nnx.state(model, FP8State)`` selects every layer's state (for checkpoints). The update is the
"gradient" of the state, which :func:`fp8_value_and_grad` computes alongside the parameter
gradients and writes back into the model::

    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = te_layers.nnx.fp8_value_and_grad(loss_fn)(model, x, y)  # FP8State updated in place
        optimizer.update(model, grads)                                      # grads: nnx.Param only
        return loss

Microbatches: compute each microbatch's update from the same state and combine them with
``te_layers._fp8.accumulate_trees`` semantics (:func:`fp8_accumulate`: max of the amaxes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from te_layers import _fp8 as F


class FP8State(nnx.Variable):
    """Delayed-scaling state of one FP8 GEMM (amax histories and scales of its activation, kernel and
    output gradient). Updated from the backward pass by :func:`fp8_value_and_grad`, never by an
    optimizer."""


def fp8_value_and_grad(fn: Callable, *, wrt: Any = nnx.Param, has_aux: bool = False) -> Callable:
    """``nnx.value_and_grad`` of ``fn(model, *args, **kwargs)`` that also updates the model's
    :class:`FP8State` variables.

    Differentiates with respect to the ``wrt`` variables and the ``FP8State`` ones, writes the updated
    FP8 state into ``model`` (layers that were not in the backward pass keep theirs) and returns
    ``(value, grads)`` with the ``wrt`` gradients only (what ``nnx.Optimizer.update`` takes).
    """

    def wrapped(model, *args, **kwargs):
        if not isinstance(model, nnx.Module):
            raise TypeError(
                "te_layers.nnx.fp8_value_and_grad: the first argument must be the nnx.Module to differentiate, got "
                f"{type(model).__name__}."
            )
        diff = nnx.DiffState(0, nnx.Any(wrt, FP8State))
        value, grads = nnx.value_and_grad(fn, argnums=diff, has_aux=has_aux)(model, *args, **kwargs)
        param_grads, fp8_grads = nnx.filter_state(grads, wrt, FP8State)
        old = nnx.state(model, FP8State)
        if jax.tree.leaves(old):
            nnx.update(model, F.updated_tree(old, fp8_grads))
        return value, param_grads

    return wrapped


def fp8_accumulate(*states: Any) -> Any:
    """Combine the ``nnx.state(model, FP8State)`` of several microbatch updates (all from the same
    starting state) into one step's state: per tensor the update with the largest recorded amax."""
    if not states:
        raise ValueError("te_layers.nnx.fp8_accumulate: needs at least one state, got none.")
    return F.accumulate_trees(*states)
