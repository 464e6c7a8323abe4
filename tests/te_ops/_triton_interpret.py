"""Runs the Triton permutation kernels under TRITON_INTERPRET=1 on the CPU (no GPU, no torch).

``interpreted_call`` stands in for ``triton_bridge.triton_call``: same arguments, but it runs the
kernel eagerly with Triton's interpreter on NumPy buffers wrapped in a minimal torch-like shim
(the interpreter only needs data_ptr/dtype/untyped_storage/...). Outputs start NaN-poisoned, as in
the GPU tests, so an unwritten element shows up. Run as a script by test_permutation_interpret.py.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


class _Storage:
    def __init__(self, arr):
        self.arr = arr

    def data_ptr(self):
        return self.arr.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):
        pass


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name


_NAMES = {
    "float32": "float32",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "bool": "int8",
    "int8": "int8",
    "bfloat16": "bfloat16",
    "uint8": "uint8",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}


# One dtype object per name, alive for the whole process: Triton's argument specialisation caches
# by the dtype object's identity, so a fresh object per tensor could reuse a dead one's id and be
# taken for another dtype.
_DTYPES = {name: _Dtype(name) for name in set(_NAMES.values())}


class NpTensor:
    def __init__(self, arr):
        self.arr = arr
        self.dtype = _DTYPES[_NAMES[str(arr.dtype)]]

    def data_ptr(self):
        return self.arr.ctypes.data

    def untyped_storage(self):
        return _Storage(self.arr)

    def storage_offset(self):
        return 0

    def size(self):
        return self.arr.shape

    def stride(self):
        return tuple(s // self.arr.itemsize for s in self.arr.strides)

    def new_empty(self, *a, **k):
        t = NpTensor.__new__(NpTensor)
        t.dtype = self.dtype
        return t

    def set_(self, storage, offset, size, stride):
        self.arr = storage.arr


def _fix_interpreter_for_numpy2():
    """Triton 3.6's interpreter turns scalar tensors into Python ints with int(1-element array),
    which NumPy >= 2.5 refuses; use .item() instead (same value)."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_te_ops_numpy2_fix", False):
        return
    interpreter._te_ops_numpy2_fix = True
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def interpreted_call(
    kernel,
    *args,
    out_shape,
    grid,
    constexprs=None,
    num_warps=4,
    num_stages=2,
    input_output_aliases=None,
    zeroed_outputs=(),
    name=None,
    divisible_by_16=(),
    maxnreg=None,
    scratch_bytes_per_program=None,
):
    _fix_interpreter_for_numpy2()
    aliases = dict(input_output_aliases or {})
    n_user = len(out_shape)
    if scratch_bytes_per_program is not None:  # the te_scratch parameter (the interpreter's TMA needs none)
        out_shape = [*out_shape, jax.ShapeDtypeStruct((16,), jnp.uint8)]
    bufs = []
    for a in args:
        if hasattr(a, "shape") and not isinstance(a, (np.generic, int, float)):
            arr = np.array(jax.device_get(a)).copy()
            if arr.dtype == np.bool_:
                arr = arr.astype(np.int8)
            bufs.append(np.ascontiguousarray(arr))
        else:
            bufs.append(a.item() if isinstance(a, np.generic) else a)
    outs = []
    for i, s in enumerate(out_shape):
        if i in aliases.values():
            outs.append(None)
            continue
        dt = np.dtype(s.dtype)
        if i in zeroed_outputs:
            outs.append(np.zeros(s.shape, dt))
        elif np.issubdtype(dt, np.floating) or str(dt) == "bfloat16" or str(dt).startswith("float8"):
            outs.append(np.full(s.shape, np.nan, dt))
        else:
            outs.append(np.full(s.shape, np.iinfo(dt).max, dt))
    for i, o in aliases.items():
        outs[o] = bufs[i]
    written = [outs[i] for i in range(len(out_shape)) if i not in aliases.values()]
    kargs = [NpTensor(b) if isinstance(b, np.ndarray) else b for b in bufs] + [NpTensor(w) for w in written]
    grid = tuple(int(g) for g in grid)
    if min(grid) > 0:
        kernel[grid](*kargs, **(constexprs or {}))
    # copy back (a zero-copy jnp.asarray of a NumPy buffer that dies here would read freed memory)
    return [jnp.array(np.array(o, copy=True), copy=True) for o in outs[:n_user]]


def main():
    from te_ops._core import triton_bridge
    from te_ops.permutation import reference as ref
    from te_ops.permutation import triton as tri

    _fix_interpreter_for_numpy2()
    triton_bridge.triton_call = interpreted_call
    tri.tb.triton_call = interpreted_call
    rng = np.random.default_rng(0)
    failures = 0
    # n0: num_out_tokens (None = T * k); smaller values overflow the buffer (pairs dropped)
    for t_, e_, h, k, align, with_probs, dtype, n0 in [
        (37, 8, 40, 2, None, True, np.float32, None),
        (37, 8, 40, 2, 4, False, np.float32, None),
        (20, 64, 16, 3, None, False, np.float32, None),
        (20, 64, 16, 3, 8, True, np.float32, None),
        (9, 8, 24, 2, 4, True, jnp.bfloat16, None),
        (70, 256, 32, 8, 16, True, np.float32, None),
        (37, 8, 40, 2, None, True, np.float32, 29),
        (37, 8, 40, 2, 4, True, np.float32, 29),
        (20, 8, 16, 3, 8, False, np.float32, 7),
        (70, 16, 32, 4, 16, True, np.float32, 50),
        (70, 256, 32, 8, None, True, np.float32, 100),
    ]:
        scores = rng.standard_normal((t_, e_))
        scores[:, : e_ // 2] -= 100.0  # uneven: the first half of the experts is never chosen
        top = np.argsort(-scores, axis=1)[:, :k]
        rm = np.zeros((t_, e_), bool)
        np.put_along_axis(rm, top, True, axis=1)
        x = jnp.asarray(rng.standard_normal((t_, h)), dtype)
        probs = jnp.asarray(rng.random((t_, e_)) * rm, jnp.float32) if with_probs else None
        rmj = jnp.asarray(rm)
        n0 = t_ * k if n0 is None else n0
        got, _ = tri.dispatch_forward(x, rmj, probs, num_out_tokens=n0, align_size=align)
        want, _ = ref.dispatch_forward(x, rmj, probs, num_out_tokens=n0, align_size=align)
        if n0 < t_ * k and int(want[5]) == 0:
            failures += 1
            print(f"FAIL overflow case drops nothing T={t_} E={e_} A={align} n0={n0}")
        for name, g, w in zip(
            ["out", "permuted_probs", "row_id_map", "pad_offsets", "tokens_per_expert", "num_dropped"],
            got,
            want,
            strict=True,
        ):
            if w is None:
                continue
            if not np.array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64)):
                failures += 1
                print(f"FAIL dispatch {name} T={t_} E={e_} A={align} probs={with_probs} n0={n0}")
        row_id_map = want[2]
        n = want[0].shape[0]
        y = jnp.asarray(rng.standard_normal((n, h)), dtype)
        g_out = jnp.asarray(rng.standard_normal((n, h)), dtype)
        g_pp = jnp.asarray(rng.standard_normal((n,)), jnp.float32) if with_probs else None
        res = ref.DispatchResiduals(row_id_map, t_, with_probs)
        checks = [
            (
                "dispatch_bwd",
                tri.dispatch_backward(res, g_out, g_pp, num_out_tokens=n0, align_size=align),
                ref.dispatch_backward(res, g_out, g_pp, num_out_tokens=n0, align_size=align),
            ),
            (
                "combine_fwd",
                (tri.combine_forward(y, row_id_map, probs)[0],),
                (ref.combine_forward(y, row_id_map, probs)[0],),
            ),
        ]
        cres = ref.CombineResiduals(y if with_probs else None, row_id_map, probs, n)
        g = jnp.asarray(rng.standard_normal((t_, h)), dtype)
        checks.append(("combine_bwd", tri.combine_backward(cres, g), ref.combine_backward(cres, g)))
        for name, got, want in checks:
            for gi, wi in zip(got, want, strict=False):
                if wi is None:
                    continue
                ok = np.allclose(np.asarray(gi, np.float64), np.asarray(wi, np.float64), rtol=2e-2, atol=2e-2)
                if not ok:
                    failures += 1
                    print(f"FAIL {name} T={t_} E={e_} A={align} probs={with_probs} n0={n0}")
    x = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    sizes, idx = jnp.array([3, 0, 5, 4], jnp.int32), jnp.array([2, 0, 3, 1], jnp.int32)
    (o, m), _ = tri.sort_forward(x, sizes, idx)
    (ro, rm_), rres = ref.sort_forward(x, sizes, idx)
    if not (np.array_equal(o, ro) and np.array_equal(m, rm_)):
        failures += 1
        print("FAIL sort_forward")
    g = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    if not np.array_equal(tri.sort_backward(rres, g), ref.sort_backward(rres, g)):
        failures += 1
        print("FAIL sort_backward")
    print(f"interpret failures: {failures}")
    return failures


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    sys.exit(1 if main() else 0)
