"""Triton kernels of rms_norm / layer_norm. Imported only when the Triton implementation runs (this
module imports triton at module scope; ``te_ops`` itself never imports it).

Rows are the flattened leading axes of x (``[ROWS, H]``, row-major); the statistics are float32
``[ROWS]``. All sizes are runtime scalars (a new row count or H does not recompile, except through
the constexpr block sizes chosen from H). ``IS_RMS`` selects RMSNorm (no mean, no beta).

* ``norm_fwd_kernel``: one tile of ``BLOCK_R`` rows x ``BLOCK_H >= H`` columns per program (short
  rows: several rows per program; H up to 8192: one row), the whole row in registers: load x (and
  the residual, rounding ``h = x + r`` to x's dtype and storing it), float32 row statistics, store
  y, mean and rstd. One read and one write of every element.
* ``norm_fwd_looped_kernel``: rows too long for registers, one row per program in ``BLOCK_H``
  chunks: mean (LayerNorm), then the centred sum of squares, then y (and h).
* ``norm_bwd_kernel``: a fixed number of programs, each walking row tiles ``pid, pid + G, ...``:
  per row ``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))`` with ``g = dy * w`` (+ the
  cotangent of the returned h), and float32 partial sums of ``dy * xhat`` and ``dy`` accumulated
  in registers and written once per program to ``[G, H]`` buffers (summed by the caller: no
  atomics, deterministic).
* ``norm_bwd_looped_kernel`` + ``norm_dparam_kernel``: long rows. dx one row per program in two
  chunked passes; the parameter gradients by a column-tiled kernel (grid: column tiles x G row
  groups) writing ``[G, H]`` partial sums.

Masked (padding) lanes load 0 and are excluded from the sums: ``xhat`` is forced to 0 there (a
loaded 0 minus the mean is not 0).
"""

import triton
import triton.language as tl


@triton.jit
def _load_h(x_ptr, r_ptr, h_ptr, offs, mask, HAS_RES: tl.constexpr, STORE_H: tl.constexpr):
    """The row values h as float32: x, or x + residual rounded to x's dtype (stored when STORE_H)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    hf = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        h = (hf + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_H:
            tl.store(h_ptr + offs, h, mask=mask)
        hf = h.to(tl.float32)
    return hf


@triton.jit
def _scale(w_ptr, cols, col_ok, ZERO_CENTERED: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


@triton.jit
def norm_fwd_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    b_ptr,
    ROWS,
    H,
    eps,
    y_ptr,
    h_ptr,
    mean_ptr,
    rstd_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BETA: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    """x, r, y, h: [ROWS, H]; w, b: [H]; mean, rstd: [ROWS] float32. r / b / h / mean are not
    touched when HAS_RES / HAS_BETA / (not IS_RMS) are off (the caller passes placeholders)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < ROWS
    col_ok = cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    hf = _load_h(x_ptr, r_ptr, h_ptr, offs, mask, HAS_RES, True)
    if IS_RMS:
        c = hf
    else:
        mean = tl.sum(hf, axis=1) / H
        tl.store(mean_ptr + rows, mean, mask=row_ok)
        c = tl.where(mask, hf - mean[:, None], 0.0)
    var = tl.sum(c * c, axis=1) / H
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = _scale(w_ptr, cols, col_ok, ZERO_CENTERED)
    y = c * rstd[:, None] * w[None, :]
    if HAS_BETA:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_fwd_looped_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    b_ptr,
    ROWS,
    H,
    eps,
    y_ptr,
    h_ptr,
    mean_ptr,
    rstd_ptr,
    BLOCK_H: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BETA: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    """Same operands as norm_fwd_kernel; one row per program, BLOCK_H columns at a time. h is
    recomputed from x and r in every pass (the same rounding each time) and stored in the last."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * H
    cols0 = tl.arange(0, BLOCK_H)
    if IS_RMS:
        mean = 0.0
    else:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            cols = start + cols0
            acc += _load_h(x_ptr, r_ptr, h_ptr, base + cols, cols < H, HAS_RES, False)
        mean = tl.sum(acc, axis=0) / H
        tl.store(mean_ptr + row, mean)
    acc2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + cols0
        ok = cols < H
        c = tl.where(ok, _load_h(x_ptr, r_ptr, h_ptr, base + cols, ok, HAS_RES, False) - mean, 0.0)
        acc2 += c * c
    rstd = 1.0 / tl.sqrt_rn(tl.sum(acc2, axis=0) / H + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, H, BLOCK_H):
        cols = start + cols0
        ok = cols < H
        hf = _load_h(x_ptr, r_ptr, h_ptr, base + cols, ok, HAS_RES, True)
        y = (hf - mean) * rstd * _scale(w_ptr, cols, ok, ZERO_CENTERED)
        if HAS_BETA:
            y = y + tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _xhat(h_ptr, mean_ptr, rstd_ptr, offs, rows, mask, row_ok, IS_RMS: tl.constexpr):
    """float32 xhat of a [BLOCK_R, BLOCK_H] tile (0 on masked lanes) and the rows' rstd."""
    hf = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    if IS_RMS:
        xhat = hf * rstd[:, None]
    else:
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (hf - mean[:, None]) * rstd[:, None], 0.0)
    return xhat, rstd


@triton.jit
def norm_bwd_kernel(
    h_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dy_ptr,
    dh_ptr,
    ROWS,
    H,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    """h, dy, dh, dx: [ROWS, H]; w: [H]; mean, rstd: [ROWS] float32; dw_part, db_part: [G, H]
    float32 with G = the number of programs. dh / mean / db_part are placeholders when HAS_DH is
    off / IS_RMS is on."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = _scale(w_ptr, cols, col_ok, ZERO_CENTERED)
    dw_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    n_tiles = tl.cdiv(ROWS, BLOCK_R)
    for t in range(pid, n_tiles, nprog):
        rows = t * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < ROWS
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
        xhat, rstd = _xhat(h_ptr, mean_ptr, rstd_ptr, offs, rows, mask, row_ok, IS_RMS)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / H
        inner = g - xhat * c1[:, None]
        if not IS_RMS:
            c2 = tl.sum(g, axis=1) / H
            inner = inner - c2[:, None]
            db_acc += dy
        dx = inner * rstd[:, None]
        if HAS_DH:
            dx = dx + tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
    part = pid.to(tl.int64) * H + cols
    tl.store(dw_part_ptr + part, tl.sum(dw_acc, axis=0), mask=col_ok)
    if not IS_RMS:
        tl.store(db_part_ptr + part, tl.sum(db_acc, axis=0), mask=col_ok)


@triton.jit
def norm_bwd_looped_kernel(
    h_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dy_ptr,
    dh_ptr,
    ROWS,
    H,
    dx_ptr,
    BLOCK_H: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    """dx of one long row per program: the two row sums in a first chunked pass, dx in a second."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * H
    cols0 = tl.arange(0, BLOCK_H)
    rstd = tl.load(rstd_ptr + row)
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.load(mean_ptr + row)
    s1 = tl.zeros([BLOCK_H], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + cols0
        ok = cols < H
        hf = tl.load(h_ptr + base + cols, mask=ok, other=0.0).to(tl.float32)
        xhat = tl.where(ok, (hf - mean) * rstd, 0.0)
        g = tl.load(dy_ptr + base + cols, mask=ok, other=0.0).to(tl.float32) * _scale(w_ptr, cols, ok, ZERO_CENTERED)
        s1 += g * xhat
        s2 += g
    c1 = tl.sum(s1, axis=0) / H
    c2 = tl.sum(s2, axis=0) / H
    for start in range(0, H, BLOCK_H):
        cols = start + cols0
        ok = cols < H
        hf = tl.load(h_ptr + base + cols, mask=ok, other=0.0).to(tl.float32)
        xhat = (hf - mean) * rstd
        g = tl.load(dy_ptr + base + cols, mask=ok, other=0.0).to(tl.float32) * _scale(w_ptr, cols, ok, ZERO_CENTERED)
        inner = g - xhat * c1
        if not IS_RMS:
            inner = inner - c2
        dx = inner * rstd
        if HAS_DH:
            dx = dx + tl.load(dh_ptr + base + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def norm_dparam_kernel(
    h_ptr,
    mean_ptr,
    rstd_ptr,
    dy_ptr,
    ROWS,
    H,
    dw_part_ptr,
    db_part_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_RMS: tl.constexpr,
):
    """Partial parameter gradients: program (column tile c, row group q) sums ``dy * xhat`` (and
    ``dy``) over the row tiles q, q + G, ... of its BLOCK_H columns into dw_part[q] (db_part[q])."""
    ct = tl.program_id(0)
    q = tl.program_id(1)
    nq = tl.num_programs(1)
    cols = ct * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    dw_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    n_tiles = tl.cdiv(ROWS, BLOCK_R)
    for t in range(q, n_tiles, nq):
        rows = t * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < ROWS
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
        xhat, _ = _xhat(h_ptr, mean_ptr, rstd_ptr, offs, rows, mask, row_ok, IS_RMS)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dw_acc += dy * xhat
        if not IS_RMS:
            db_acc += dy
    part = q.to(tl.int64) * H + cols
    tl.store(dw_part_ptr + part, tl.sum(dw_acc, axis=0), mask=col_ok)
    if not IS_RMS:
        tl.store(db_part_ptr + part, tl.sum(db_acc, axis=0), mask=col_ok)
