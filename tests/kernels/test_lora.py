"""Batched multi-LoRA: `LoraMapping.build`, the grouped reference against its per-row definition,
and the CPU dispatch."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels import ops, reference
from ferry.kernels.metadata import LoraMapping
from tests.kernels.util import assert_close


def make_lora(tokens, in_features, out_features, rank, num_slots, dtype, seed):
    """(y, x, lora_a, lora_b), scaled so the LoRA term is as large as y: an error in it shows."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, out_features, generator=gen).to(dtype)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    lora_a = (torch.randn(num_slots, rank, in_features, generator=gen) / in_features**0.5).to(dtype)
    lora_b = (torch.randn(num_slots, out_features, rank, generator=gen) / rank**0.5).to(dtype)
    return y, x, lora_a, lora_b


def per_row(y, x, lora_a, lora_b, slots: list[int]) -> torch.Tensor:
    """The definition, one row at a time in float64: y[t] + lora_b[s] @ (lora_a[s] @ x[t])."""
    out = y.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += lora_b[s].double() @ (lora_a[s].double() @ x[t].double())
    return out.to(y.dtype)


SLOTS = {
    "mixed": [2, -1, 0, 2, 2, -1, 1, 0, 3, -1, 2],
    "one-slot": [1] * 9,
    "one-slot-and-none": [-1, 1, 1, -1, 1],
    "single-row": [3],
    # one adapter with most rows: a padded grid would be mostly padding, so the products run per adapter
    "skewed": [0] * 10 + [1, 2, -1],
    # slots 1 and 2 absent between 0 and 3: the grid pads them whole
    "gap": [3, 0, 3, -1, 0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(SLOTS))
def test_reference_matches_the_per_row_definition(name, dtype):
    slots = SLOTS[name]
    y, x, lora_a, lora_b = make_lora(len(slots), 40, 56, 8, 4, dtype, seed=len(slots))
    expected = per_row(y, x, lora_a, lora_b, slots)
    out = y.clone()
    reference.add_lora(out, x, lora_a, lora_b, LoraMapping.build(slots, "cpu"))
    assert_close(out, expected, dtype)
    none = torch.tensor(slots) < 0
    assert torch.equal(out[none], y[none])  # rows without an adapter untouched, bitwise
    assert not torch.equal(out[~none], y[~none])


def test_float32_is_tight_per_element():
    slots = SLOTS["mixed"]
    y, x, lora_a, lora_b = make_lora(len(slots), 64, 48, 16, 4, torch.float32, seed=3)
    out = y.clone()
    reference.add_lora(out, x, lora_a, lora_b, LoraMapping.build(slots, "cpu"))
    torch.testing.assert_close(out, per_row(y, x, lora_a, lora_b, slots), rtol=1e-5, atol=1e-5)


def test_16_bit_rounds_once_like_a_merged_weight():
    """bfloat16 in, float32 intermediate: the LoRA term is the exact product (x against the merged
    B A) rounded once, so nearly every element equals it bitwise; a bfloat16 intermediate would not."""
    y, x, lora_a, lora_b = make_lora(16, 256, 64, 16, 1, torch.bfloat16, seed=4)
    out = torch.zeros_like(y)
    reference.add_lora(out, x, lora_a, lora_b, LoraMapping.build([0] * 16, "cpu"))
    merged = (x.double() @ (lora_b[0].double() @ lora_a[0].double()).T).to(torch.bfloat16)  # [16, 64]
    assert (out == merged).double().mean() > 0.98


def test_no_adapter_rows_leave_y_bitwise_unchanged():
    y, x, lora_a, lora_b = make_lora(5, 32, 24, 8, 2, torch.bfloat16, seed=5)
    out = y.clone()
    mapping = LoraMapping.build([-1] * 5, "cpu")
    reference.add_lora(out, x, lora_a, lora_b, mapping)
    ops.add_lora(out, x, lora_a, lora_b, mapping)
    assert torch.equal(out, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SLOTS))
def test_cpu_dispatch_equals_the_reference(name, dtype, monkeypatch):
    monkeypatch.delenv("FERRY_ATTENTION_BACKEND", raising=False)
    slots = SLOTS[name]
    y, x, lora_a, lora_b = make_lora(len(slots), 48, 40, 16, 4, dtype, seed=6)
    mapping = LoraMapping.build(slots, "cpu")
    expected, out = y.clone(), y.clone()
    reference.add_lora(expected, x, lora_a, lora_b, mapping)
    assert ops.backend_for(x) == "cpu"
    ops.add_lora(out, x, lora_a, lora_b, mapping)
    assert torch.equal(out, expected)


def test_build_groups_rows_by_slot_ascending():
    mapping = LoraMapping.build([2, -1, 0, 2, 5, 0, -1, 2], "cpu")
    assert mapping.slot_of_row.dtype == torch.int64
    assert mapping.slot_of_row.tolist() == [2, -1, 0, 2, 5, 0, -1, 2]
    assert [(slot, rows.tolist()) for slot, rows in mapping.groups] == [(0, [2, 5]), (2, [0, 3, 7]), (5, [4])]
    assert all(rows.dtype == torch.int64 for _, rows in mapping.groups)
    assert mapping.all_rows_one_slot is None
    assert mapping.active


def test_build_one_slot_and_inactive_batches():
    one = LoraMapping.build([3, 3, 3], "cpu")
    assert one.all_rows_one_slot == 3 and one.active
    assert [(slot, rows.tolist()) for slot, rows in one.groups] == [(3, [0, 1, 2])]
    # One slot but a row without an adapter: rows must still be gathered.
    assert LoraMapping.build([3, -1, 3], "cpu").all_rows_one_slot is None
    for slots in ([-1, -1], []):
        none = LoraMapping.build(slots, "cpu")
        assert not none.active and none.groups == [] and none.all_rows_one_slot is None
        assert none.slot_of_row.shape == (len(slots),)


def test_build_takes_the_padded_grid_only_where_padding_is_cheap():
    assert LoraMapping.build(SLOTS["mixed"]).padded[:2] == (4, 4)  # 16 places for 8 adapted rows
    assert LoraMapping.build(SLOTS["gap"]).padded[:2] == (4, 2)
    assert LoraMapping.build(SLOTS["skewed"]).padded is None  # 30 places for 12 rows
    assert LoraMapping.build(SLOTS["one-slot-and-none"]).padded is None  # one adapter: no grid needed
    slots, width, rows, valid = LoraMapping.build(SLOTS["gap"]).padded
    assert rows.view(slots, width)[3].tolist() == [0, 2] and rows.view(slots, width)[0].tolist() == [1, 4]
    assert rows[valid].tolist() == LoraMapping.build(SLOTS["gap"]).adapted_rows.tolist()


def test_build_refuses_slots_below_minus_one():
    with pytest.raises(ValueError, match="-1"):
        LoraMapping.build([0, -2], "cpu")
