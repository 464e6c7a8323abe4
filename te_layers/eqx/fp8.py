"""Delayed-scaling FP8 state in Equinox: ``eqx.nn.StateIndex`` / ``eqx.nn.State`` and the step helpers.

A Dense created with ``DelayedScaling`` (its own ``fp8=`` or the ``te_layers.fp8_recipe`` context at
construction) holds ``dense.fp8_index``, an ``eqx.nn.StateIndex`` whose value is
``{"x"|"w"|"g": {"amax_history": f32[history_len], "scale": f32[]}}`` (a MoEBlock's ``moe.fp8_index``
holds ``{"wi": ..., "wo": ...}`` of those, the kernels' ``w`` per expert; the block is called as
``(out, aux), state = moe(x, state)``). Build the model with
``eqx.nn.make_with_state`` (or ``eqx.nn.State(model)``) and call FP8-capable layers with the state:
``y, state = dense(x, state)`` (the forward leaves it unchanged). The updated state is the gradient
of the loss with respect to ``state``; :func:`fp8_value_and_grad` computes it with the model's
gradients and writes it into the state::

    model, state = eqx.nn.make_with_state(Model)(key=key)   # Dense(..., fp8=DelayedScaling()) inside

    @eqx.filter_jit
    def train_step(model, state, opt_state, x, y):
        loss, grads, state = te_layers.eqx.fp8_value_and_grad(loss_fn)(model, state, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

``loss_fn(model, state, x, y)`` returns the loss (``has_aux=True``: ``(loss, aux)``). The model's
``StateIndex`` holds only the initial value; its gradient is zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from te_layers import _fp8 as F


def _fp8_indices(model: Any) -> list:
    """The StateIndex of every FP8 delayed-scaling layer in ``model``."""
    nodes = jax.tree.leaves(model, is_leaf=lambda n: hasattr(n, "fp8_index") and isinstance(n, eqx.Module))
    return [n.fp8_index for n in nodes if getattr(n, "fp8_index", None) is not None]


def fp8_update(model: Any, state: eqx.nn.State, state_grads: eqx.nn.State) -> eqx.nn.State:
    """``state`` with every FP8 layer's entry replaced by its update, read from ``state_grads`` (the
    gradient of the loss with respect to ``state``); layers that were not in the backward pass keep
    their state, and entries of other layers (e.g. BatchNorm statistics) are left as in ``state``."""
    if not isinstance(state, eqx.nn.State):
        raise TypeError(f"te_layers.eqx.fp8_update: state must be an eqx.nn.State, got {type(state).__name__}.")
    for idx in _fp8_indices(model):
        state = state.set(idx, F.updated_tree(state.get(idx), state_grads.get(idx)))
    return state


def fp8_accumulate(model: Any, *states: eqx.nn.State) -> eqx.nn.State:
    """Combine the updated states of several microbatches (each from :func:`fp8_update`, all from the
    same starting state): per FP8 tensor the update with the largest recorded amax (max, not sum)."""
    if not states:
        raise ValueError("te_layers.eqx.fp8_accumulate: needs at least one state, got none.")
    out = states[0]
    for idx in _fp8_indices(model):
        out = out.set(idx, F.accumulate_trees(*(s.get(idx) for s in states)))
    return out


def fp8_value_and_grad(fn: Callable, *, has_aux: bool = False) -> Callable:
    """``eqx.filter_value_and_grad`` of ``fn(model, state, *args, **kwargs)`` with respect to the
    model and the state; returns ``(value, model_grads, new_state)`` where ``new_state`` is ``state``
    with the FP8 layers' updates (:func:`fp8_update`)."""

    def wrapped(model, state, *args, **kwargs):
        if not isinstance(state, eqx.nn.State):
            raise TypeError(
                "te_layers.eqx.fp8_value_and_grad: the second argument must be the eqx.nn.State (from "
                f"eqx.nn.make_with_state), got {type(state).__name__}."
            )

        def f(ms, *a, **k):
            return fn(ms[0], ms[1], *a, **k)

        value, (g_model, g_state) = eqx.filter_value_and_grad(f, has_aux=has_aux)((model, state), *args, **kwargs)
        return value, g_model, fp8_update(model, state, g_state)

    return wrapped
