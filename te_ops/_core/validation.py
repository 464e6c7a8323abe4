"""Argument checks and small array helpers shared by every op.

Every error names the op (``te_ops.<op>: ...``), the argument, what was expected, what came in and,
where there is one, the fix. Ops call these helpers instead of keeping their own copies, so the
messages read the same everywhere.

Also here: the dtype tuples ops accept, the poison fill value used to catch unwritten outputs in
GPU tests, mesh-axis helpers for partition callbacks, and the sequential vmap fold
(``lax.map`` over the vmapped axis) used by ops whose batch elements cannot share one call.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Floating dtypes the kernels take (fp32 maths inside, output in the input dtype).
FLOAT_DTYPES: tuple[np.dtype, ...] = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The reference paths also take float64 where an op's semantics allow it.
FLOAT_DTYPES_WITH_F64: tuple[np.dtype, ...] = (*FLOAT_DTYPES, jnp.dtype(jnp.float64))


def _names(dtypes: Sequence[Any]) -> str:
    names = [str(jnp.dtype(d)) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def err(op: str, msg: str) -> str:
    """The message ``te_ops.<op>: <msg>``."""
    return f"te_ops.{op}: {msg}"


def is_master_kernel(x_dtype: Any, kernel_dtype: Any) -> bool:
    """float32 kernels with a bfloat16 / float16 x: the "master kernels" the GEMM ops take as they
    are (cast or quantized inside the op, float32 kernel gradients)."""
    return jnp.dtype(kernel_dtype) == jnp.float32 and jnp.dtype(x_dtype) in (jnp.bfloat16, jnp.float16)


def is_array(x: Any) -> bool:
    """True for jax/numpy arrays and tracers (anything with a shape and a dtype)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def as_array(op: str, name: str, x: Any) -> jax.Array:
    """``x`` as an array: arrays and tracers pass through; None and non-numeric values raise."""
    if x is None:
        raise TypeError(err(op, f"{name} is required (an array), got None."))
    if is_array(x):
        return x
    try:
        a = jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(err(op, f"{name} must be an array, got {type(x).__name__} {x!r:.80}.")) from e
    if a.dtype == jnp.dtype(object):
        raise TypeError(err(op, f"{name} must be a numeric array, got {type(x).__name__}."))
    return a


def check_float(
    op: str,
    name: str,
    x: Any,
    dtypes: Sequence[Any] = FLOAT_DTYPES,
    *,
    rank: int | None = None,
    layout: str = "",
) -> jax.Array:
    """``x`` as an array of one of ``dtypes`` (and of rank ``rank`` when given)."""
    x = as_array(op, name, x)
    if jnp.dtype(x.dtype) not in tuple(jnp.dtype(d) for d in dtypes):
        raise TypeError(
            err(
                op,
                f"{name} must be {_names(dtypes)}, got dtype {jnp.dtype(x.dtype)}. "
                f"Cast it first, e.g. {name}.astype(jnp.{jnp.dtype(dtypes[0]).name}).",
            )
        )
    if rank is not None:
        check_rank(op, name, x, rank, layout)
    return x


def check_rank(op: str, name: str, x: jax.Array, rank: int, layout: str = "") -> jax.Array:
    """Raises unless ``x.ndim == rank``; ``layout`` (e.g. ``"[T, E]"``) is quoted in the message."""
    if x.ndim != rank:
        lay = f" {layout}" if layout else ""
        raise ValueError(err(op, f"{name} must have rank {rank}{lay}, got shape {tuple(x.shape)}."))
    return x


def check_int_array(
    op: str, name: str, x: Any, *, shape: tuple[int, ...] | None = None, dtype: Any = None
) -> jax.Array:
    """``x`` as an integer array (of exactly ``dtype`` and ``shape`` when given). Bool is refused."""
    x = as_array(op, name, x)
    want = "int32" if dtype is None else str(jnp.dtype(dtype))
    if dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(
            err(op, f"{name} must be {want}, got dtype {x.dtype}. Convert it, e.g. {name}.astype(jnp.{want}).")
        )
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            err(op, f"{name} must be an integer array, got dtype {x.dtype}. Convert it, e.g. {name}.astype(jnp.int32).")
        )
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(err(op, f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}."))
    return x


def check_groups(op: str, kernels: jax.Array, unit: str = "group", count: str = "G") -> None:
    """A grouped GEMM's kernels ``[G, ...]`` must hold at least one group (``unit``: "group" or
    "expert", ``count``: the letter the op's docs use)."""
    if kernels.shape[0] == 0:
        raise ValueError(
            err(op, f"kernels must have at least one {unit} ({count} >= 1), got shape {tuple(kernels.shape)}. "
                    "With no experts there is nothing to compute: skip the call.")
        )  # fmt: skip


def check_bool(op: str, name: str, x: Any, *, shape: tuple[int, ...] | None = None, hint: str = "") -> jax.Array:
    """``x`` as a bool array (of ``shape`` when given)."""
    x = as_array(op, name, x)
    if x.dtype != jnp.bool_:
        fix = hint or f"Convert it, e.g. {name} = ({name} != 0)."
        raise TypeError(err(op, f"{name} must be a bool array, got dtype {x.dtype}. {fix}"))
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(err(op, f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}."))
    return x


def _is_traced(v: Any) -> bool:
    return isinstance(v, (jax.Array, jax.core.Tracer))


def static_int(
    op: str,
    name: str,
    v: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
    why: str = "",
) -> int | None:
    """``v`` as a Python int in ``[minimum, maximum]``; ``why`` says why it must be static."""
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer)) or _is_traced(v):
        because = f" {why}" if why else ""
        raise TypeError(err(op, f"{name} must be a static Python int, got {type(v).__name__} {v!r:.80}.{because}"))
    v = int(v)
    if minimum is not None and v < minimum:
        raise ValueError(err(op, f"{name} must be >= {minimum}, got {v}."))
    if maximum is not None and v > maximum:
        raise ValueError(err(op, f"{name} must be <= {maximum}, got {v}."))
    return v


def static_float(op: str, name: str, v: Any, *, finite: bool = True, why: str = "") -> float:
    """``v`` as a finite Python float; traced arrays are refused (the value is compiled in)."""
    if _is_traced(v) or isinstance(v, bool) or not isinstance(v, (numbers.Real, np.floating, np.integer)):
        because = f" {why}" if why else " It is compiled into the kernel; pass a number, not a traced array."
        raise TypeError(err(op, f"{name} must be a static Python float, got {type(v).__name__} {v!r:.80}.{because}"))
    v = float(v)
    if finite and not np.isfinite(v):
        raise ValueError(err(op, f"{name} must be finite, got {v}."))
    return v


def static_bool(op: str, name: str, v: Any) -> bool:
    """``v`` as a Python bool. Ints (0/1) are refused, as in te_layers, so that a typo does not pass."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(
            err(op, f"{name} must be a static Python bool (True or False), got {type(v).__name__} {v!r:.80}.")
        )
    return bool(v)


def check_implementation(op: str, implementation: Any, names: Sequence[str]) -> Any:
    """``implementation`` if it is None or one of the registered ``names`` (checked before tracing, so the
    message names the public function rather than its registry family)."""
    if implementation is not None and not (isinstance(implementation, str) and implementation in tuple(names)):
        raise ValueError(
            err(
                op,
                f"unknown implementation={implementation!r}; expected None (best available) or one of {sorted(names)}.",
            )
        )
    return implementation


def static_choice(op: str, name: str, v: Any, choices: Sequence[Any]) -> Any:
    """``v`` if it is one of ``choices``."""
    if v not in tuple(choices):
        raise ValueError(err(op, f"{name} must be one of {list(choices)}, got {v!r}."))
    return v


# ----------------------------------------------------------------------------------------------
# Poisoning (GPU tests): outputs pre-filled with a value no kernel writes, so an unwritten element
# shows up in the comparison with the reference.
# ----------------------------------------------------------------------------------------------


def poison_value(dtype: Any) -> Any:
    """NaN for floats, True for bool, the largest value for integers."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.nan
    if dtype == jnp.bool_:
        return True
    return jnp.iinfo(dtype).max


def poison_like(x: Any) -> jax.Array:
    """An array of ``x``'s shape and dtype filled with :func:`poison_value`."""
    return jnp.full(x.shape, poison_value(x.dtype), x.dtype)


# ----------------------------------------------------------------------------------------------
# Mesh axes in partition callbacks: a PartitionSpec entry is None, one axis name or a tuple.
# ----------------------------------------------------------------------------------------------


def mesh_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def spec_entry(axes: Sequence[str]) -> Any:
    """The PartitionSpec entry for ``axes`` (None, one name or a tuple)."""
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def mesh_size(mesh: Any, axes: Sequence[str]) -> int:
    """The number of devices along ``axes`` of ``mesh``."""
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


# ----------------------------------------------------------------------------------------------
# vmap by looping: for ops whose batch elements each carry their own sizes (group sizes, routing),
# so folding them into one call is not possible.
# ----------------------------------------------------------------------------------------------


def broadcast_batched(axis_size: int, in_batched: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Gives every unbatched array argument the leading vmapped axis (custom_vmap puts it at 0).
    ``None`` arguments stay None."""
    out = []
    for a, b in zip(args, in_batched, strict=True):
        if a is None or b is True:
            out.append(a)
        elif b is False:
            out.append(jnp.broadcast_to(a, (axis_size, *a.shape)))
        else:  # a pytree of flags (custom_vmap gives one per leaf)
            out.append(jax.tree.map(lambda x, f: x if f else jnp.broadcast_to(x, (axis_size, *x.shape)), a, b))
    return out


def sequential_fold(fn: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
    """A custom_vmap rule that runs ``fn`` once per batch element with ``lax.map``; every output
    is batched."""

    def fold(axis_size, in_batched, *args):
        xs = broadcast_batched(axis_size, in_batched, args)
        outs = jax.lax.map(lambda a: fn(*a), tuple(xs))
        return outs, jax.tree.map(lambda _: True, outs)

    return fold
