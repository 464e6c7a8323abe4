"""Implementation registry and selection.

Every op family (``softmax``, ``dense``, ...) registers its implementations here, in order of
preference. All implementations of a family share one forward/backward signature and one residual
layout, so a forward of one kind can pair with a backward of another.

Selection, from strongest to weakest:

1. the ``implementation=`` argument of the op call;
2. :func:`use_implementation` (``use_implementation("reference")`` for every op,
   ``use_implementation(softmax="native")`` for one family);
3. ``None``: the best implementation that supports the call on the platform the computation is
   lowered for. On CUDA that is the first GPU implementation whose ``unsupported_reason`` is None;
   everywhere else (and as the silent fallback) the pure-JAX ``reference``. The choice is staged with
   :func:`jax.lax.platform_dependent`, so one jitted function runs on CPU and GPU.

Naming an implementation that cannot run raises :class:`ImplementationUnavailableError` with the
reason. Selection happens when a function is traced: a jitted function keeps the implementations
it was traced with (as with any trace-time setting in JAX).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from te_ops._core import native as _native

REFERENCE = "reference"


class ImplementationUnavailableError(RuntimeError):
    """An implementation was asked for by name but cannot run this call."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way of computing an op family.

    Attributes:
      name: ``"reference"``, ``"native"``, ``"triton"``, ``"gluon"``.
      forward / backward: the family's shared signatures (see the family's ``api.py``).
      unsupported_reason: ``(**call) -> str | None``: why this implementation cannot take a call
        (shapes, dtypes, static attributes), None if it can.
      platform: ``"cuda"`` for GPU implementations, None for the portable reference.
      available: ``() -> str | None``: why the implementation cannot run in this process at all
        (extension not built, no GPU, Triton missing), None if it can.
      auto: whether ``implementation=None`` may pick it: a bool, or ``(**call) -> bool`` to pick it
        only for the calls where it is the better choice (e.g. large enough GEMMs). An
        implementation registered with ``auto=False`` runs only when asked for by name.
    """

    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    unsupported_reason: Callable[..., str | None] = lambda **_: None
    platform: str | None = None
    available: Callable[[], str | None] = lambda: None
    auto: bool | Callable[..., bool] = True

    def auto_for(self, call: Mapping[str, Any]) -> bool:
        return bool(self.auto(**call)) if callable(self.auto) else bool(self.auto)


def native_available(module: str = "_native", op: str | None = None) -> Callable[[], str | None]:
    """An ``available`` callable for implementations backed by extension module ``module`` (and, when
    given, by the handlers of op folder ``op`` in it: a build can leave op folders out)."""
    return lambda: _native.native_unavailable_reason(module, op)


class OpFamily:
    """The implementations of one op family, in order of preference."""

    def __init__(self, name: str):
        self.name = name
        self._impls: dict[str, Implementation] = {}

    def register(self, impl: Implementation) -> Implementation:
        if impl.name in self._impls:
            raise ValueError(f"{self.name}: implementation {impl.name!r} registered twice")
        self._impls[impl.name] = impl
        return impl

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._impls)

    def get(self, name: str) -> Implementation:
        try:
            return self._impls[name]
        except KeyError:
            raise ValueError(
                f"te_ops.{self.name}: unknown implementation={name!r}; expected None or one of {sorted(self._impls)}"
            ) from None

    def reason(self, name: str, **call: Any) -> str | None:
        """Why ``name`` cannot run ``call`` in this process (None if it can)."""
        impl = self.get(name)
        why = impl.available()
        if why is None and impl.platform == "cuda":
            why = _native.cuda_device_unavailable_reason()
        if why is None:
            why = impl.unsupported_reason(**call)
        return why

    def resolve(self, requested: str | None) -> str | None:
        if requested is not None:
            return requested
        ctx = _CONTEXT.get()
        return ctx.get(self.name, ctx.get("*"))

    def dispatch(
        self,
        requested: str | None,
        stage: str,
        args: tuple[Any, ...],
        statics: Mapping[str, Any],
        call: Mapping[str, Any],
    ) -> Any:
        """Runs ``stage`` of the selected implementation on ``args`` with keyword ``statics``.

        ``call`` (shapes, dtypes and statics) goes to ``unsupported_reason``.
        """
        name = self.resolve(requested)

        def bound(impl: Implementation) -> Callable[..., Any]:
            fn = getattr(impl, stage)
            return lambda *a: fn(*a, **statics)

        if name is not None:
            why = self.reason(name, **call)
            if why is not None:
                raise ImplementationUnavailableError(
                    f"te_ops.{self.name}: implementation={name!r} cannot run this call: {why}"
                )
            return bound(self.get(name))(*args)

        reference = bound(self.get(REFERENCE))
        for impl in self._impls.values():
            if impl.name == REFERENCE or impl.platform != "cuda" or not impl.auto_for(call):
                continue
            if impl.available() is None and impl.unsupported_reason(**call) is None:
                return jax.lax.platform_dependent(*args, cuda=bound(impl), default=reference)
        return reference(*args)


_CONTEXT: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "te_ops_impl", default=types.MappingProxyType({})
)


@contextlib.contextmanager
def use_implementation(default: str | None = None, /, **per_family: str) -> Iterator[None]:
    """Selects implementations for every te_ops call traced inside the block.

    Args:
      default: implementation for every op family (e.g. ``"reference"``), or None to leave it open.
      **per_family: implementation for one family, e.g. ``softmax="native"``.

    Example::

        with te_ops.use_implementation("reference"):   # e.g. to debug numerics
            loss = jax.jit(model_loss)(params, batch)
    """
    ctx = dict(_CONTEXT.get())
    if default is not None:
        ctx["*"] = default
    ctx.update(per_family)
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def registered_families() -> dict[str, OpFamily]:
    return dict(_FAMILIES)


_FAMILIES: dict[str, OpFamily] = {}


def family(name: str) -> OpFamily:
    """The (created on first use) registry of an op family."""
    if name not in _FAMILIES:
        _FAMILIES[name] = OpFamily(name)
    return _FAMILIES[name]
