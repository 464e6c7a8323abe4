"""The op framework itself: implementation selection, the context manager, native loading status,
collective counting and the sharding helper."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as Ps

import te_ops
from te_ops._core import native, registry
from te_ops._core import testing as T


def _family(name, gpu_reason=None, gpu_unsupported=None):
    fam = registry.OpFamily(name)
    fam.register(
        registry.Implementation(
            name="fast",
            forward=lambda x, *, k: x * k + 1000.0,
            backward=lambda r, g, *, k: g,
            unsupported_reason=lambda **c: gpu_unsupported,
            platform="cuda",
            available=lambda: gpu_reason,
        )
    )
    fam.register(
        registry.Implementation(name=registry.REFERENCE, forward=lambda x, *, k: x * k, backward=lambda r, g, *, k: g)
    )
    return fam


def test_default_on_cpu_runs_reference_and_keeps_gpu_branch_out_of_cpu_hlo():
    fam = _family("fake1")
    x = jnp.arange(4.0)
    out = jax.jit(lambda x: fam.dispatch(None, "forward", (x,), {"k": 2.0}, {}))(x)
    assert jnp.allclose(out, 2 * x)  # CPU: the default branch
    hlo = jax.jit(lambda x: fam.dispatch(None, "forward", (x,), {"k": 2.0}, {})).lower(x).as_text()
    assert "1.000000e+03" not in hlo  # the CUDA branch is dropped from CPU HLO


def test_default_skips_unavailable_or_unsupported_gpu_impl():
    for fam in (_family("fake2", gpu_reason="not built"), _family("fake3", gpu_unsupported="odd shape")):
        x = jnp.arange(3.0)
        hlo = jax.jit(lambda x, fam=fam: fam.dispatch(None, "forward", (x,), {"k": 3.0}, {})).lower(x).as_text()
        assert "1.000000e+03" not in hlo  # the GPU branch was never staged


def test_named_implementation_that_cannot_run_raises_with_reason():
    fam = _family("fake4", gpu_reason="the extension was built without CUDA")
    with pytest.raises(registry.ImplementationUnavailableError, match="fast.*built without CUDA"):
        fam.dispatch("fast", "forward", (jnp.ones(2),), {"k": 1.0}, {})
    with pytest.raises(ValueError, match="unknown implementation='nope'.*'fast', 'reference'"):
        fam.dispatch("nope", "forward", (jnp.ones(2),), {"k": 1.0}, {})


def test_context_manager_nesting_and_per_family():
    fam = _family("fake5")
    assert fam.resolve(None) is None
    with registry.use_implementation("reference"):
        assert fam.resolve(None) == "reference"
        with registry.use_implementation(fake5="fast"):
            assert fam.resolve(None) == "fast"
            assert fam.resolve("reference") == "reference"  # the argument wins
        assert fam.resolve(None) == "reference"
    assert fam.resolve(None) is None


def test_native_status_is_explained():
    why = te_ops.native_unavailable_reason()
    if why is None:
        assert isinstance(native.counters(), dict)
    else:
        assert "CUDA" in why or "native extension" in why


def test_count_collectives_parses_async_forms():
    text = "%a = all-reduce(x) %b = all-gather-start(y) %c = all-gather-done(b) %d = reduce-scatter(z)"
    c = T.count_collectives(text)
    assert c["all-reduce"] == 1 and c["all-gather"] == 1 and c["reduce-scatter"] == 1 and c["all-to-all"] == 0


def test_run_sharded_detects_a_reduction():
    mesh = T.cpu_mesh((8,), ("x",))
    x = jax.random.normal(jax.random.key(0), (16, 4))
    out, ref, counts = T.run_sharded(lambda x: jnp.sum(x, axis=0), (x,), (Ps("x"),), Ps(), mesh=mesh)
    T.assert_close(out, ref, jnp.float32)
    assert counts["all-reduce"] >= 1


def test_auto_false_implementation_is_only_used_by_name():
    fam = registry.OpFamily("fake6")
    fam.register(
        registry.Implementation(
            name="fast",
            forward=lambda x, *, k: x * k + 1000.0,
            backward=lambda r, g, *, k: g,
            platform="cuda",
            auto=False,
        )
    )
    fam.register(
        registry.Implementation(name=registry.REFERENCE, forward=lambda x, *, k: x * k, backward=lambda r, g, *, k: g)
    )
    x = jnp.arange(3.0)
    hlo = jax.jit(lambda x: fam.dispatch(None, "forward", (x,), {"k": 3.0}, {})).lower(x).as_text()
    assert "1.000000e+03" not in hlo  # never staged by implementation=None
    if te_ops.native_unavailable_reason() is not None:  # by name it is still checked for availability
        with pytest.raises(registry.ImplementationUnavailableError):
            fam.dispatch("fast", "forward", (x,), {"k": 3.0}, {})


def test_poisoned_outputs_apply_even_after_an_unpoisoned_trace(monkeypatch):
    """Poisoning is trace-time; an earlier trace of the same op and shape must not be reused."""
    if native.extension_unavailable_reason() is not None:
        pytest.skip(f"needs te_ops._native for CUDA lowering: {native.extension_unavailable_reason()}")
    monkeypatch.setattr(native, "cuda_device_unavailable_reason", lambda: None)
    x = jnp.ones((4, 32), jnp.float32)

    def lowered():
        f = jax.jit(lambda x: te_ops.scaled_softmax(x, 1.0, implementation="native"))
        return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()

    plain = lowered()
    with native.poisoned_outputs():
        poisoned = lowered()
    after = lowered()
    assert "te_softmax_fwd" in plain and "output_operand_aliases" not in plain
    assert "output_operand_aliases" in poisoned  # the NaN buffer aliased to the result
    assert "output_operand_aliases" not in after


def test_a_build_without_an_op_folder_reports_that_op_unavailable(monkeypatch):
    """A module built with TE_OPS_ONLY / TE_OPS_EXCLUDE lacks some ops' handlers: their native
    implementation reports why (not an XLA 'no FFI handler registered' error at run time)."""

    class _Partial:
        @staticmethod
        def build_info():
            return {"enabled_ops": "router"}

    monkeypatch.setitem(native._loaded, "_fake_partial", _Partial())
    assert native.built_ops("_fake_partial") == ("router",)
    assert native.op_unavailable_reason("_fake_partial", "router") is None
    why = native.op_unavailable_reason("_fake_partial", "softmax")
    assert why is not None and "without the softmax handlers" in why and "router" in why
    assert registry.native_available("_fake_partial", "softmax")() == why
    # a module that is not loaded at all: its load error, whatever the op
    missing = native.extension_unavailable_reason("_not_a_module")
    assert missing is not None and native.op_unavailable_reason("_not_a_module", "softmax") == missing
