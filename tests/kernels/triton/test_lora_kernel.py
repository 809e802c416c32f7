"""Triton batched multi-LoRA (shrink + expand, BGMV per row) against the grouped PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import reference
from ferry.kernels.metadata import LoraMapping
from ferry.kernels.triton.lora_kernel import _num_splits, add_lora
from tests.kernels.test_lora import make_lora
from tests.kernels.util import assert_close


def check_add_lora(slots, in_features, out_features, rank, num_slots, dtype, device, seed) -> None:
    y, x, lora_a, lora_b = make_lora(len(slots), in_features, out_features, rank, num_slots, dtype, seed)
    expected = y.clone()
    reference.add_lora(expected, x, lora_a, lora_b, LoraMapping.build(slots, "cpu"))
    out = y.to(device)
    add_lora(out, x.to(device), lora_a.to(device), lora_b.to(device), LoraMapping.build(slots, device))
    out = out.cpu()
    assert_close(out, expected, dtype)
    none = torch.tensor(slots, dtype=torch.int64) < 0
    assert torch.equal(out[none], y[none])  # rows without an adapter untouched, bitwise


MIXED = [2, -1, 0, 2, 1, -1, 3, 0, 2]

# (slots, in_features, out_features, rank, num_slots, dtype)
CASES = {
    "mixed-r8": (MIXED, 96, 80, 8, 4, torch.float32),
    "qkv-r48": (MIXED, 64, 200, 48, 4, torch.float32),  # fused q|k|v of rank 16: out not a block multiple
    "r64": (MIXED, 128, 96, 64, 4, torch.float32),  # the highest rank the issue asks for
    "one-slot": ([1] * 5, 72, 40, 8, 2, torch.float32),
    "decode-one-row": ([3], 48, 24, 8, 4, torch.float32),
    "split-input": ([0, -1, 1], 2100, 36, 8, 2, torch.float32),  # 4 splits of 768, the last one empty
    "mixed-bf16": (MIXED, 96, 80, 8, 4, torch.bfloat16),
    "qkv-r48-bf16": (MIXED, 64, 200, 48, 4, torch.bfloat16),
    "mixed-fp16": (MIXED, 96, 80, 8, 4, torch.float16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_add_lora(name, device, run):
    run(check_add_lora, *CASES[name], device, seed=len(name))


def check_no_adapter_rows(device) -> None:
    y, x, lora_a, lora_b = make_lora(4, 32, 24, 8, 2, torch.bfloat16, seed=1)
    out = y.to(device)
    add_lora(out, x.to(device), lora_a.to(device), lora_b.to(device), LoraMapping.build([-1] * 4, device))
    assert torch.equal(out.cpu(), y)


def test_no_adapter_rows_leave_y_unchanged(device, run):
    run(check_no_adapter_rows, device)


def check_strided_y(device) -> None:
    """y a column slice of a wider output (q of a fused qkv): the other columns untouched."""
    slots = [0, -1, 1, 1]
    wide, x, lora_a, lora_b = make_lora(len(slots), 48, 56, 8, 2, torch.float32, seed=2)
    expected = wide.clone()
    reference.add_lora(expected[:, 8:40], x, lora_a, lora_b[:, 8:40], LoraMapping.build(slots, "cpu"))
    out, mapping = wide.to(device), LoraMapping.build(slots, device)
    add_lora(out[:, 8:40], x.to(device), lora_a.to(device), lora_b[:, 8:40].to(device), mapping)
    assert_close(out.cpu(), expected, torch.float32)
    assert torch.equal(out.cpu()[:, :8], wide[:, :8]) and torch.equal(out.cpu()[:, 40:], wide[:, 40:])


def test_strided_y(device, run):
    run(check_strided_y, device)


def test_num_splits():
    """A decode row splits its input dim; a prefill batch, or a narrow input, does not."""
    assert _num_splits(1, 4096) == 8
    assert _num_splits(1, 16384) == 16
    assert _num_splits(64, 4096) == 4
    assert _num_splits(512, 4096) == 1
    assert _num_splits(1, 500) == 1
    assert _num_splits(3, 2100) == 4
