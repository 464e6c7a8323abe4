"""Runs the Triton normalization kernels under TRITON_INTERPRET=1 on the CPU (no GPU, no torch) and
compares them with the reference: forward (y, h, mean, rstd) and backward (dx, dgamma, dbeta), RMSNorm
and LayerNorm, with and without residual / cotangent of h, zero-centred gamma, odd row lengths, the
in-register path (several rows per program, backward programs walking several tiles) and the
looped long-row path (forced at small H by lowering MAX_FUSED_H). Run as a script by
test_normalization.py (``interpret failures: 0`` on success)."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _triton_interpret import _fix_interpreter_for_numpy2, interpreted_call  # noqa: E402

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _close(name, got, want, dtype, scale=1.0):
    if want is None:
        return got is None
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    tol = TOL[dtype]
    ok = g.shape == w.shape and not np.isnan(g).any() and np.allclose(g, w, rtol=tol, atol=tol * scale)
    if not ok:
        print(
            f"  {name}: max |diff| {np.nanmax(np.abs(g - w)) if g.shape == w.shape else 'shape'} "
            f"nan={np.isnan(g).sum()}"
        )
    return ok


def main():
    from te_ops.normalization import reference as ref
    from te_ops.normalization import triton as tri

    _fix_interpreter_for_numpy2()
    tri.tb.triton_call = interpreted_call
    tri.num_sms = lambda: 1  # few backward programs: each walks several row tiles
    tri.BWD_PROGRAMS_PER_SM = 2
    tri.DPARAM_ROW_GROUPS_PER_SM = 2
    failures = 0
    cases = []
    for kind in ("rms", "layer"):
        for shape, dtype in [
            ((5, 16), jnp.float32),
            ((3, 7, 33), jnp.bfloat16),
            ((9, 100), jnp.float16),
            ((2, 1), jnp.float32),
            ((70, 8), jnp.float32),
        ]:
            for has_res in (False, True):
                cases.append((kind, shape, dtype, has_res, (kind == "layer") == has_res, False))
        cases.append((kind, (6, 100), jnp.float32, True, True, True))  # looped
        cases.append((kind, (5, 70), jnp.bfloat16, False, False, True))  # looped
    for kind, shape, dtype, has_res, zc, looped in cases:
        tri.MAX_FUSED_H, tri.LOOP_BLOCK_H = (64, 32) if looped else (8192, 4096)
        ks = jax.random.split(jax.random.key(len(shape) * 100 + shape[-1]), 7)
        x = (jax.random.normal(ks[0], shape) * 2 + 0.5).astype(dtype)
        n = shape[-1]
        gamma = jax.random.normal(ks[1], (n,), jnp.float32)
        beta = jax.random.normal(ks[2], (n,), jnp.bfloat16) if kind == "layer" else None
        r = jax.random.normal(ks[3], shape).astype(dtype) if has_res else None
        dy = jax.random.normal(ks[4], shape).astype(dtype)
        dh = jax.random.normal(ks[5], shape).astype(dtype) if has_res else None
        kw = dict(kind=kind, eps=1e-5, zero_centered_gamma=zc)
        y, res = tri.forward(x, gamma, beta, r, **kw)
        y_r, res_r = ref.forward(x, gamma, beta, r, **kw)
        tag = f"{kind} {shape} {jnp.dtype(dtype).name} res={has_res} zc={zc} looped={looped}"
        ok = _close("y", y, y_r, dtype, 4.0)
        ok &= _close("h", res.h, res_r.h, dtype)
        ok &= _close("rstd", res.rstd, res_r.rstd, jnp.float32, 10.0) if dtype == jnp.float32 else True
        if kind == "layer":
            ok &= _close("mean", res.mean, res_r.mean, jnp.float32) if dtype == jnp.float32 else True
        # the backward from the reference's residuals, so both sides see the same h/mean/rstd
        bkw = dict(kind=kind, zero_centered_gamma=zc)
        dx, dg, db = tri.backward(res_r, dy, dh, **bkw)
        dx_r, dg_r, db_r = ref.backward(res_r, dy, dh, **bkw)
        ok &= _close("dx", dx, dx_r, dtype, 4.0)
        rows = int(np.prod(shape[:-1]))
        ok &= _close("dgamma", dg, dg_r, jnp.float32, rows)
        ok &= _close("dbeta", db, db_r, jnp.float32, rows)
        if not ok:
            failures += 1
            print("FAIL", tag)
        else:
            print("ok", tag)
    print(f"interpret failures: {failures}")
    return failures


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    sys.exit(1 if main() else 0)
