"""Triton tile functions run under TRITON_INTERPRET=1 on the CPU (fp32 dot operands: the interpreter's bf16 dot is
wrong), each against torch. Data movement tiles are checked bitwise."""

import textwrap
from interpreter import run_interpreted


SCRIPT = textwrap.dedent(
    r"""
    import torch, triton, triton.language as tl
    from weave_moe.backends.weave.kernels import tiles

    torch.manual_seed(0)

    @triton.jit
    def _dispatch(x, dst, tok, slot, start, count, H, BR: tl.constexpr, BH: tl.constexpr,
                  PIPELINED: tl.constexpr = True):
        tiles.dispatch_rows(x, dst, tok, slot, start, count, H, BR, BH, PIPELINED)

    @triton.jit
    def _gemm0(a, g, w13, h, e, rs, nr, ns, H, I, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        tiles.gemm0_tile(a, g, w13, h, e, rs, nr, ns, H, I, BM, BN, BK, True)

    @triton.jit
    def _gemm1(h, w2, y, e, rs, nr, ns, H, I, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        tiles.gemm1_tile(h, w2, y, e, rs, nr, ns, H, I, BM, BN, BK, True)

    @triton.jit
    def _combine(y, pos, w, tok, dst, start, count, H, K: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
        tiles.combine_rows(y, pos, w, tok, dst, start, count, H, K, BR, BH)

    @triton.jit
    def _reduce(comb, mask, out, start, count, H, T, EP, BR: tl.constexpr, BH: tl.constexpr):
        tiles.reduce_rows(comb, mask, out, start, count, H, T, EP, BR, BH)

    # dispatch: bitwise, odd H, partial block, untouched rows stay poisoned
    H = 72
    x = torch.randn(10, H).to(torch.bfloat16)
    dst = torch.full((12, H), float("nan"), dtype=torch.bfloat16)
    tok = torch.tensor([9, 0, 4, 4, 7], dtype=torch.int32)
    slot = torch.tensor([0, 5, 2, 11, 6], dtype=torch.int32)
    for pipelined in (True, False):
        dst = torch.full((12, H), float("nan"), dtype=torch.bfloat16)
        _dispatch[(1,)](x, dst, tok, slot, 1, 3, H, 4, 32, pipelined)
        assert torch.equal(dst[5].view(torch.int16), x[0].view(torch.int16))
        assert torch.equal(dst[2].view(torch.int16), x[4].view(torch.int16))
        assert torch.equal(dst[11].view(torch.int16), x[4].view(torch.int16))
        assert dst[0].isnan().all() and dst[6].isnan().all()
    # ... rows of one step (H <= BH) and of whole steps (H a multiple of BH), both loops
    for H, BH, pipelined in ((24, 32, True), (64, 32, True), (96, 32, True), (64, 32, False)):
        x = torch.randn(10, H).to(torch.bfloat16)
        dst = torch.full((12, H), float("nan"), dtype=torch.bfloat16)
        _dispatch[(1,)](x, dst, tok, slot, 0, 5, H, 8, BH, pipelined)
        for i in range(5):
            assert torch.equal(dst[slot[i]].view(torch.int16), x[tok[i]].view(torch.int16)), (H, i)
        assert dst[[1, 3, 4, 7, 8, 9, 10]].isnan().all()

    # gemm0 with gather and fused silu-mul; odd sizes, partial tiles
    H, I, E = 40, 24, 3
    a = torch.randn(20, H).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).to(torch.bfloat16)
    gather = torch.randint(0, 20, (30,), dtype=torch.int32)
    h = torch.full((30, I), float("nan"), dtype=torch.bfloat16)
    for n_start in (0, 16):
        _gemm0[(1,)](a, gather, w13, h, 2, 5, 11, n_start, H, I, 16, 16, 16)
    gu = a[gather[5:16].long()].float() @ w13[2].float().T
    want = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
    torch.testing.assert_close(h[5:16].float(), want.float(), atol=2e-2, rtol=2e-2)
    assert h[:5].isnan().all() and h[16:].isnan().all()

    # gemm1
    w2 = (torch.randn(E, H, I) / I ** 0.5).to(torch.bfloat16)
    hh = torch.randn(30, I).to(torch.bfloat16)
    y = torch.full((30, H), float("nan"), dtype=torch.bfloat16)
    for n_start in (0, 16, 32):
        _gemm1[(1,)](hh, w2, y, 1, 3, 9, n_start, H, I, 16, 16, 16)
    want = (hh[3:12].float() @ w2[1].float().T)
    torch.testing.assert_close(y[3:12].float(), want, atol=2e-2, rtol=2e-2)
    assert y[:3].isnan().all() and y[12:].isnan().all()

    # gemm1 as two halves sharing A (BLOCK_N >= 256 path), H not a multiple of the tile
    H2, I2 = 300, 24
    w2b = (torch.randn(E, H2, I2) / I2 ** 0.5).to(torch.bfloat16)
    y2 = torch.full((30, H2), float("nan"), dtype=torch.bfloat16)
    for n_start in (0, 256):
        _gemm1[(1,)](hh, w2b, y2, 2, 4, 7, n_start, H2, I2, 16, 256, 16)
    want = hh[4:11].float() @ w2b[2].float().T
    torch.testing.assert_close(y2[4:11].float(), want, atol=2e-2, rtol=2e-2)
    assert y2[:4].isnan().all() and y2[11:].isnan().all()

    # combine: weighted sum of y rows, -1 skipped
    K = 3
    y = torch.randn(8, H).to(torch.bfloat16)
    pos = torch.tensor([[0, -1, 3], [2, 5, 7], [-1, -1, -1], [1, 4, -1]], dtype=torch.int32)
    w = torch.rand(4, K)
    tokd = torch.tensor([6, 1, 3, 0], dtype=torch.int32)
    dst = torch.full((8, H), float("nan"), dtype=torch.bfloat16)
    _combine[(1,)](y, pos, w, tokd, dst, 0, 4, H, K, 4, 32)
    for i in range(4):
        want = sum((w[i, j] * y[pos[i, j]].float() for j in range(K) if pos[i, j] >= 0), torch.zeros(H))
        torch.testing.assert_close(dst[tokd[i]].float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    assert dst[2].isnan().all()

    # reduce over ranks by bit mask, one to three ranks; the rows no rank sent hold NaN (never written), which must not
    # reach the sum: masked loads with several rows per task, loaded and zeroed with one row per task (decode)
    T = 5
    for EP in (1, 2, 3):
        mask = torch.tensor([0b101, 0, 0b111, 0b010, 0b001], dtype=torch.int32) & ((1 << EP) - 1)
        comb = torch.randn(EP * T, H).to(torch.bfloat16)
        for d in range(EP):
            for t in range(T):
                if not (mask[t] >> d) & 1:
                    comb[d * T + t] = float("nan")
        for rows in (8, 1):
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
            if rows == 8:
                _reduce[(1,)](comb, mask, out, 0, T, H, T, EP, 8, 32)
            else:
                for t in range(T):
                    _reduce[(1,)](comb, mask, out, t, 1, H, T, EP, 1, 32)
            for t in range(T):
                want = sum((comb[d * T + t].float() for d in range(EP) if (mask[t] >> d) & 1), torch.zeros(H))
                torch.testing.assert_close(out[t].float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    print("TILES OK")
    """
)


def test_tiles_under_interpreter():
    run_interpreted(SCRIPT, "TILES OK", timeout=300)


TMA_SCRIPT = textwrap.dedent(
    r"""
    import torch, triton, triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
    from weave_moe.backends.weave.kernels import tiles
    torch.manual_seed(0)

    @triton.jit
    def _gemm0t(a, g, w, d, h, e, rs, nr, ns, H, I, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        tiles.gemm0_tile(a, g, w, h, e, rs, nr, ns, H, I, BM, BN, BK, True, 2, d, True)

    @triton.jit
    def _gemm0i(a, g, w, d, h, e, rs, nr, ns, H, I, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                TMA: tl.constexpr):
        tiles.gemm0_tile(a, g, w, h, e, rs, nr, ns, H, I, BM, BN, BK, True, 2, d, TMA, True)

    @triton.jit
    def _gemm0w(a, g, w, d, h, e, rs, nr, ns, H, I, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                TMA: tl.constexpr):
        tiles.gemm0_tile(a, g, w, h, e, rs, nr, ns, H, I, BM, BN, BK, True, 2, d, TMA, True, True)

    @triton.jit
    def _gemm1t(h, w, wd, y, e, rs, nr, ns, H, I, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        tiles.gemm1_tile(h, w, y, e, rs, nr, ns, H, I, BM, BN, BK, True, 2, wd, True)

    H, I, E = 40, 24, 3
    a = torch.randn(20, H).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H) / H ** 0.5).to(torch.bfloat16)
    gather = torch.randint(0, 20, (30,), dtype=torch.int32)
    h = torch.full((30, I), float("nan"), dtype=torch.bfloat16)
    d = TensorDescriptor.from_tensor(w13.view(E * 2 * I, H), [16, 16])
    for n_start in (0, 16):
        _gemm0t[(1,)](a, gather, w13, d, h, 2, 5, 11, n_start, H, I, 16, 16, 16)
    gu = a[gather[5:16].long()].float() @ w13[2].float().T
    want = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
    torch.testing.assert_close(h[5:16].float(), want.float(), atol=2e-2, rtol=2e-2)
    assert h[:5].isnan().all() and h[16:].isnan().all()
    # the LAST expert (tile past the end of the tensor: zero fill) and expert 0 (tile into the up rows)
    for e in (0, E - 1):
        h.fill_(float("nan"))
        for n_start in (0, 16):
            _gemm0t[(1,)](a, gather, w13, d, h, e, 0, 7, n_start, H, I, 16, 16, 16)
        gu = a[gather[0:7].long()].float() @ w13[e].float().T
        want = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
        torch.testing.assert_close(h[0:7].float(), want.float(), atol=2e-2, rtol=2e-2)

    # gemm0 on the interleaved w13 (gate j at row 2j, up j at 2j + 1): two MMAs (3-D TMA descriptor) and ONE MMA over
    # the tile's 2 * BN interleaved rows (WIDE, 2-D descriptor), each with pointer loads and with TMA
    from weave_moe.backends.weave.kernels.grouped_gemm import interleave_w13
    w13i = interleave_w13(w13)
    variants = ((_gemm0i, TensorDescriptor.from_tensor(w13i.view(E * I, 2, H), [16, 1, 16])),
                (_gemm0w, TensorDescriptor.from_tensor(w13i.view(E * 2 * I, H), [32, 16])))
    for kernel, desc in variants:
        for tma in (False, True):
            for e, rs, nr in ((2, 5, 11), (0, 0, 7), (E - 1, 3, 16)):
                h.fill_(float("nan"))
                for n_start in (0, 16):
                    kernel[(1,)](a, gather, w13i, desc, h, e, rs, nr, n_start, H, I, 16, 16, 16, tma)
                gu = a[gather[rs:rs + nr].long()].float() @ w13[e].float().T
                want = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
                torch.testing.assert_close(h[rs:rs + nr].float(), want.float(), atol=2e-2, rtol=2e-2)
                assert h[:rs].isnan().all() and h[rs + nr:].isnan().all()

    # gemm1: H=40 not a multiple of the half width, I=24 not a multiple of BK
    H, I, E = 40, 24, 3
    hh = torch.randn(30, I).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I) / I ** 0.5).to(torch.bfloat16)
    y = torch.full((30, H), float("nan"), dtype=torch.bfloat16)
    wd = TensorDescriptor.from_tensor(w2.view(E * H, I), [16, 16])
    for e, rs, nr in ((1, 4, 9), (E - 1, 20, 10), (0, 0, 3)):
        y.fill_(float("nan"))
        for n_start in (0, 32):
            _gemm1t[(1,)](hh, w2, wd, y, e, rs, nr, n_start, H, I, 16, 32, 16)
        want = (hh[rs:rs + nr].float() @ w2[e].float().T).to(torch.bfloat16)
        torch.testing.assert_close(y[rs:rs + nr].float(), want.float(), atol=2e-2, rtol=2e-2)
        assert y[:rs].isnan().all() and y[rs + nr:].isnan().all()
    print("TMA TILES OK")
    """
)


def test_tma_tiles_under_interpreter():
    """The TMA GEMM tiles (KernelConfig.tma): partial tiles, K tails, a tile running past its expert into the next
    expert's rows (never stored) and past the end of the tensor (zero fill), rows outside the tile left poisoned."""
    run_interpreted(TMA_SCRIPT, "TMA TILES OK")
