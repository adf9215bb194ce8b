"""The Triton kernels of swiglu_matmul.py (the fused fc1 + SwiGLU benchmark candidate): one
loading its blocks through pointers, one through tensor descriptors (Hopper's TMA), sharing how
programs map to output tiles."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(M, FFN, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs in groups of GROUP_M row tiles sweep the columns together: their gate and up
    # blocks stay in L2 across the group. Returns this program's (row tile, column tile).
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(FFN, BN)
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def swiglu_matmul_kernel(X, W, Out, M, FFN, K, stride_xm, stride_wn, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, FFN, BM, BN, GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    # Out-of-range rows and columns load row 0 (their results are not stored).
    x_ptrs = X + tl.where(rows < M, rows, 0).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    gate_ptrs = W + tl.where(cols < FFN, cols, 0).to(tl.int64)[None, :] * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + FFN * stride_wn
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            wg = tl.load(gate_ptrs)
            wu = tl.load(up_ptrs)
        else:
            left = K - k * BK
            x = tl.load(x_ptrs, mask=ks[None, :] < left, other=0.0)
            wg = tl.load(gate_ptrs, mask=ks[:, None] < left, other=0.0)
            wu = tl.load(up_ptrs, mask=ks[:, None] < left, other=0.0)
        gate = tl.dot(x, wg, gate)
        up = tl.dot(x, wu, up)
        x_ptrs += BK
        gate_ptrs += BK
        up_ptrs += BK
    # The separate matmul rounds its output; then SwiGLU in fp32, rounded once.
    g = gate.to(Out.dtype.element_ty).to(tl.float32)
    u = up.to(Out.dtype.element_ty).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    out_ptrs = Out + rows.to(tl.int64)[:, None] * FFN + cols[None, :]
    tl.store(out_ptrs, y.to(Out.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < FFN))


@triton.jit
def swiglu_matmul_tma_kernel(x_desc, w_desc, out_desc, M, FFN, K, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, GROUP_M: tl.constexpr):
    # As swiglu_matmul_kernel, its blocks loaded by tensor descriptors: reads past an edge
    # are zeros (a gate block past FFN reads up rows, whose columns are not stored), and the
    # store drops what lies outside the output.
    pid_m, pid_n = grouped_tile(M, FFN, BM, BN, GROUP_M)
    m0 = pid_m * BM
    n0 = pid_n * BN
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        x = x_desc.load([m0, k * BK])
        gate = tl.dot(x, w_desc.load([n0, k * BK]).T, gate)
        up = tl.dot(x, w_desc.load([FFN + n0, k * BK]).T, up)
    g = gate.to(out_desc.dtype).to(tl.float32)
    u = up.to(out_desc.dtype).to(tl.float32)
    out_desc.store([m0, n0], (g * tl.sigmoid(g) * u).to(out_desc.dtype))
