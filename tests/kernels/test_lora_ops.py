"""The batched shrink/expand (lm_console/kernels/lora_ops.py): each implementation against a
per-token loop written from the definition, y[t] += s[slot] * B[slot] (A[slot] x[t]). The Triton
kernels run under the interpreter here (this directory's conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from lm_console.kernels import lora_ops


def _case(dtype: torch.dtype, tokens: int = 23, d_in: int = 48, d_out: int = 80, rank: int = 12, slots: int = 4,
          seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=gen).to(dtype)
    a = torch.randn(slots, rank, d_in, generator=gen).to(dtype)
    b = torch.randn(slots, d_out, rank, generator=gen).to(dtype)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    token_slots[0], token_slots[1] = -1, slots - 1  # the base and the last slot both present
    scalings = torch.rand(slots, generator=gen) * 2 + 0.25
    y = torch.randn(tokens, d_out, generator=gen).to(dtype)
    return y, x, a, b, token_slots, scalings


def _loop(y, x, a, b, token_slots, scalings):  # noqa: ANN001, ANN202
    out = y.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] += scalings[s].double() * (b[s].double() @ (a[s].double() @ x[t].double()))
    return out


IMPLS = ["torch", "cpu", "triton"]


def _run(impl: str, y, x, a, b, token_slots, scalings):  # noqa: ANN001, ANN202
    if impl == "torch":
        return lora_ops.add_lora_torch(y, x, a, b, token_slots, scalings)
    if impl == "cpu":
        if not lora_ops.cpu_kernel_available():
            pytest.skip("no C compiler")
        return lora_ops.add_lora_cpu(y, x, a, b, token_slots, scalings)
    pytest.importorskip("triton")
    return lora_ops.add_lora_triton(y, x, a, b, token_slots, scalings)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_implementation_matches_the_definition(impl, dtype) -> None:
    y, x, a, b, token_slots, scalings = _case(dtype)
    expected = _loop(y, x, a, b, token_slots, scalings)
    base_rows = token_slots < 0
    got = _run(impl, y.clone(), x, a, b, token_slots, scalings)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= tol * scale
    assert torch.equal(got[base_rows], y[base_rows]), "tokens with slot -1 must be left alone"


@pytest.mark.parametrize("impl", IMPLS)
def test_negative_control_the_wrong_slot_is_caught(impl) -> None:
    """The comparison above fails when one token reads its neighbour slot's adapter."""
    y, x, a, b, token_slots, scalings = _case(torch.float32)
    expected = _loop(y, x, a, b, token_slots, scalings)
    wrong = token_slots.clone()
    t = int((wrong >= 0).nonzero()[0])
    wrong[t] = (wrong[t] + 1) % a.shape[0]
    got = _run(impl, y.clone(), x, a, b, wrong, scalings)
    assert (got.double() - expected).abs().max().item() > 1e-4 * expected.abs().max().item()


def test_the_c_kernel_refuses_a_slot_out_of_range() -> None:
    if not lora_ops.cpu_kernel_available():
        pytest.skip("no C compiler")
    y, x, a, b, token_slots, scalings = _case(torch.float32)
    token_slots[3] = a.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        lora_ops.add_lora_cpu(y, x, a, b, token_slots, scalings)


def test_lmc_lora_kernel_picks_the_implementation(monkeypatch) -> None:
    y, x, a, b, token_slots, scalings = _case(torch.float32)
    calls: list[str] = []
    for impl in ("torch", "cpu"):
        real = getattr(lora_ops, f"add_lora_{impl}")
        monkeypatch.setattr(lora_ops, f"add_lora_{impl}",
                            lambda *args, _impl=impl, _real=real, **kw: calls.append(_impl) or _real(*args, **kw))
    monkeypatch.setenv("LMC_LORA_KERNEL", "torch")
    lora_ops.add_lora(y.clone(), x, a, b, token_slots, scalings)
    assert calls == ["torch"]
    monkeypatch.setenv("LMC_LORA_KERNEL", "bogus")
    with pytest.raises(ValueError, match="LMC_LORA_KERNEL='bogus'"):
        lora_ops.add_lora(y.clone(), x, a, b, token_slots, scalings)


@pytest.mark.skipif(not lora_ops.cpu_kernel_available(), reason="no C compiler: no C LoRA kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_gives_a_token_the_same_bits_in_any_batch(dtype) -> None:
    """The C kernel tiles tokens of one slot (16 at a time, 4 per pass): a token's delta must
    not depend on the tile it lands in, its place there, or the other slots in the batch."""
    gen = torch.Generator().manual_seed(3)
    num_slots, rank, d_in, d_out = 3, 24, 200, 70  # odd sizes: partial output blocks
    a = torch.randn(num_slots, rank, d_in, generator=gen).to(dtype)
    b = torch.randn(num_slots, d_out, rank, generator=gen).to(dtype)
    scalings = torch.tensor([0.5, 2.0, 1.0])
    x = torch.randn(40, d_in, generator=gen).to(dtype)
    base = torch.randn(40, d_out, generator=gen).to(dtype)
    slots = torch.tensor([(7 * t) % 4 - 1 for t in range(40)], dtype=torch.int64)  # -1..2, interleaved

    def run(rows: list[int]) -> torch.Tensor:
        y = base[rows].clone()
        return lora_ops.add_lora_cpu(y, x[rows].contiguous(), a, b, slots[rows].contiguous(), scalings)

    whole = run(list(range(40)))
    for t in range(40):
        assert torch.equal(run([t])[0], whole[t]), t
    order = list(range(40))
    torch.manual_seed(0)
    shuffled = torch.randperm(40).tolist()
    assert torch.equal(run(shuffled), whole[shuffled])
    assert torch.equal(run(order[5:23])[3], whole[8])
