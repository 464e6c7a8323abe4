"""Delayed-scaling FP8 state in Flax Linen: the ``"fp8_state"`` collection and the step helpers.

Every Dense that runs with ``DelayedScaling`` (its own ``fp8=`` or the ``te_layers.fp8_recipe``
context) keeps, in the ``"fp8_state"`` collection at its own path, three variables ``x``, ``w``,
``g`` (activation, kernel and output gradient), each ``{"amax_history": f32[history_len],
"scale": f32[]}``; ``init`` creates them. A MoEBlock with ``DelayedScaling`` keeps two variables,
``wi`` and ``wo`` (one per grouped GEMM), each ``{"x", "w", "g"}`` with the kernel's ``w`` per
expert (``amax_history [E, history_len]``, ``scale [E]``). The updated state is what ``jax.value_and_grad`` returns
for ``"fp8_state"`` when the loss is differentiated with respect to it: keep that as the next state
and give only the ``"params"`` gradients to the optimizer::

    def loss_fn(params, fp8_state, x, y):
        out = model.apply({"params": params, "fp8_state": fp8_state}, x)
        return jnp.mean((out - y) ** 2)

    loss, (g_params, g_fp8) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8_state, x, y)
    updates, opt_state = tx.update(g_params, opt_state, params)
    params = optax.apply_updates(params, updates)
    fp8_state = fp8_update(fp8_state, g_fp8)     # never through the optimizer

:func:`fp8_value_and_grad` does the same for a loss of the whole variables dict. Microbatches:
run one value_and_grad per microbatch from the same state, sum the parameter gradients and combine
the states with :func:`fp8_accumulate` (max of the amaxes, not their sum). ``nn.scan`` over layers:
give the collection its own axis (``variable_axes={"params": 0, "fp8_state": 0}``) so that every
scanned layer keeps its own state, exactly as the unrolled model does. Passing a state twice through
one differentiated function (one layer called twice, or ``variable_broadcast="fp8_state"``) sums the
updates; don't.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from te_layers import _fp8 as F

FP8_COLLECTION = F.STATE_COLLECTION


def fp8_update(fp8_state: Any, fp8_grads: Any) -> Any:
    """The next ``"fp8_state"`` collection from its "gradient" (the cotangent ``jax.value_and_grad``
    returned for it): that cotangent, except where a layer was not in the backward pass (its state is
    kept). Never feed ``fp8_grads`` to an optimizer."""
    return F.updated_tree(fp8_state, fp8_grads)


def fp8_accumulate(*fp8_states: Any) -> Any:
    """Combine the updated ``"fp8_state"`` collections of several microbatches (each from
    :func:`fp8_update`, all from the same starting state) into the state of one step over all of
    them: per tensor the update with the largest recorded amax (amaxes combine by max, not sum).
    Associative and commutative, so it also works as a running combination in a scan."""
    if not fp8_states:
        raise ValueError("te_layers.linen.fp8_accumulate: needs at least one fp8_state, got none.")
    return F.accumulate_trees(*fp8_states)


def fp8_value_and_grad(fn: Callable, *, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad`` of ``fn(variables, *args, **kwargs)`` for models with FP8 state.

    Differentiates with respect to ``variables["params"]`` and ``variables["fp8_state"]`` (when
    present) and returns ``(value, param_grads, new_variables)``: ``param_grads`` for the optimizer,
    ``new_variables`` the same dict with the updated ``"fp8_state"`` (other collections unchanged).
    """

    def wrapped(variables: Mapping, *args, **kwargs):
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise TypeError(
                "te_layers.linen.fp8_value_and_grad: the first argument must be the variables dict with a "
                f"'params' collection, got {type(variables).__name__}"
                f"{' with keys ' + str(list(variables)) if isinstance(variables, Mapping) else ''}."
            )
        rest = {k: v for k, v in variables.items() if k not in ("params", FP8_COLLECTION)}
        has_state = FP8_COLLECTION in variables

        def f(params, state):
            v = dict(rest, params=params)
            if has_state:
                v[FP8_COLLECTION] = state
            return fn(v, *args, **kwargs)

        state = variables.get(FP8_COLLECTION, {})
        value, (g_params, g_state) = jax.value_and_grad(f, argnums=(0, 1), has_aux=has_aux)(variables["params"], state)
        new = dict(variables)
        if has_state:
            new[FP8_COLLECTION] = fp8_update(state, g_state)
        return value, g_params, new

    return wrapped
