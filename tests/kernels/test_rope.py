"""Rotary embedding kernels against the fp32 reference, values and gradients."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _kernel_util import LOW_PRECISION, assert_within_torch_error, leaf, spy_launches

from roundpipe.kernels import RotaryEmbedding, apply_rope
from roundpipe.kernels.rope import _rotate_half, apply_rope_ref

KERNEL = "_rope_kernel"   # forward and backward (the transpose rotation) are one kernel


def _cos_sin(B, T, D, dtype=torch.float32, theta=10000.0, device="cpu"):
    pos = torch.randint(0, 4096, (B, T), device=device)
    return RotaryEmbedding(D, theta, device=device).cos_sin(pos, dtype)


def _hf_style(q, k, cos, sin):
    """What eager PyTorch model code does (HF apply_rotary_pos_emb) in the input dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@pytest.mark.parametrize("B,hq,hk,T,D", [(1, 4, 2, 1, 64), (2, 3, 3, 5, 128), (1, 5, 1, 7, 6)])
def test_fp32_matches_reference(monkeypatch, B, hq, hk, T, D):
    """fp32 rotations (GQA head counts, T=1, odd head counts) and their gradients match the reference."""
    launched = spy_launches(monkeypatch)
    q, k = torch.randn(B, hq, T, D), torch.randn(B, hk, T, D)
    cos, sin = _cos_sin(B, T, D)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    ours, ref = [leaf(q), leaf(k)], [leaf(q), leaf(k)]
    out, out_ref = apply_rope(*ours, cos, sin), apply_rope_ref(*ref, cos, sin)
    for a, b in zip(out, out_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.autograd.backward(out, [dq, dk])
    torch.autograd.backward(out_ref, [dq, dk])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
    assert launched.count(KERNEL) == 2, launched   # one launch forward, one backward


def test_strided_layouts_and_shared_cos(monkeypatch):
    """A transposed [B, T, H, D] projection, a [T, D] cos/sin and differently strided cos/sin work."""
    launched = spy_launches(monkeypatch)
    B, T, H, D = 2, 5, 4, 32
    q = torch.randn(B, T, H, D).transpose(1, 2)
    k = torch.randn(B, T, 2, D).transpose(1, 2)
    cos, sin = _cos_sin(1, T, D)
    sin_strided = torch.cat([sin, sin], dim=-1)[..., :D]  # a different layout from cos
    for c, s in ((cos[0], sin[0]), (cos, sin), (cos, sin_strided)):
        for a, b in zip(apply_rope(q, k, c, s), apply_rope_ref(q, k, c, s)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert launched.count(KERNEL) == 3, launched


def _check_low_precision(B, Hq, Hk, T, D, dtype, device="cpu", theta=10000.0):
    """Rotations and gradients at most ~2x as far from the fp32 reference's autograd as eager PyTorch in `dtype`."""
    q, k = torch.randn(B, Hq, T, D, device=device), torch.randn(B, Hk, T, D, device=device)
    cos, sin = _cos_sin(B, T, D, theta=theta, device=device)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    ref = [leaf(q), leaf(k)]
    out_ref = apply_rope_ref(*ref, cos, sin)
    torch.autograd.backward(out_ref, [dq, dk])
    got = {}
    for name, fn in (("ours", apply_rope), ("torch", _hf_style)):
        ins = [leaf(q, dtype), leaf(k, dtype)]
        out = fn(*ins, cos.to(dtype), sin.to(dtype))
        torch.autograd.backward(out, [dq.to(dtype), dk.to(dtype)])
        got[name] = [*out, ins[0].grad, ins[1].grad]
    # The reference uses fp32 cos/sin; both low-precision paths see the rounded tables.
    refs = [*out_ref, ref[0].grad, ref[1].grad]
    for i, label in enumerate(["q", "k", "dq", "dk"]):
        assert_within_torch_error(f"{dtype} {label}", got["ours"][i].float(), got["torch"][i].float(), refs[i])


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_within_twice_torch_error(monkeypatch, dtype):
    """fp16/bf16 rotations and gradients are at most ~2x as far from fp32 as eager PyTorch."""
    launched = spy_launches(monkeypatch)
    _check_low_precision(2, 4, 2, 6, 64, dtype)
    assert launched.count(KERNEL) == 2, launched


# Run in a child: on the old int32 arithmetic the wrapped offset points below the buffer and the
# interpreter (or a GPU) faults, which would take the whole test session down with it.
_HEAD_OFFSET_PAST_INT32 = textwrap.dedent("""
    import torch
    from roundpipe.kernels.rope import _rope, apply_rope_ref
    D, sxh = 8, 2**30 + 64                   # heads at 0, 2**30 + 64, 2**31 + 128: the last passes int32
    try:
        buf = torch.empty(2 * sxh + D, dtype=torch.float16)   # 4 GiB of address space, three rows touched
    except RuntimeError as exc:
        raise SystemExit(f"skip: no 4 GiB of address space ({exc})")
    q = buf.as_strided((1, 3, 1, D), (2 * sxh + D, sxh, D, 1))
    q.copy_(torch.randn(1, 3, 1, D).half())
    k = torch.randn(1, 1, 1, D).half()
    cos, sin = torch.randn(1, D).half(), torch.randn(1, D).half()
    for backward in (False, True):
        qo, ko = _rope(q, k, cos, sin, backward)
        s = -sin.roll(D // 2, -1) if backward else sin   # the transpose: (sin1, sin2) -> (-sin2, -sin1)
        qr, kr = apply_rope_ref(q, k, cos, s)
        assert torch.equal(qo, qr) and torch.equal(ko, kr), (backward, (qo.float() - qr.float()).abs().max())
    print("ok")
""")


def test_head_offsets_past_int32_are_computed_in_int64():
    """A q whose head stride times head index passes 2**31 elements is read from the right rows, both directions.

    Covers the load offsets (the outputs are fresh contiguous tensors, so their
    offsets stay small; the same int64 head index feeds both).  Needs 4 GiB of
    address space, not of memory: torch.empty does not touch the pages.
    """
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    if torch.cuda.is_available():
        pytest.skip("the interpreter path; on a GPU the strided CPU buffer would need a 4 GiB device copy")
    done = subprocess.run([sys.executable, "-c", _HEAD_OFFSET_PAST_INT32], env=env, capture_output=True, text=True,
                          timeout=300)
    if "skip: " in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_bad_arguments_name_the_argument():
    """Odd head dims, mismatched T and bad cos shapes raise errors naming the tensors."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = _cos_sin(1, 3, 8)
    with pytest.raises(ValueError, match="q.shape"):
        apply_rope(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="cos.shape"):
        apply_rope(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(TypeError, match="k.dtype"):
        apply_rope(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(7)


@pytest.mark.cuda
def test_cuda_compiled_matches_reference(monkeypatch):
    """On a GPU the compiled kernel's bf16 rotations and gradients, for a Qwen-like shape, are within ~2x eager
    PyTorch's error."""
    launched = spy_launches(monkeypatch, "cuda")
    _check_low_precision(2, 32, 8, 1024, 128, torch.bfloat16, "cuda", theta=1e6)
    assert launched.count(KERNEL) == 2, launched
