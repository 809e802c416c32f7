"""A weight file read tensor by tensor while its ranges arrive (worker/models/sources/arriving.py,
worker/models/safetensors_stream.py): every tensor equals safetensors' own read of the whole
file, a read waits for exactly its bytes, and a failed download reaches the waiting reader."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ferry.worker.models.errors import ModelSourceError
from ferry.worker.models.safetensors_stream import ArrivingSafetensors
from ferry.worker.models.sources.arriving import ArrivingFile, arriving_file, register, unregister


@pytest.fixture
def checkpoint(tmp_path):
    """A safetensors file of every dtype a checkpoint holds, and an empty tensor."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(37, 16, generator=generator).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=generator),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 24, generator=generator).to(torch.float16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=generator).double(),
        "positions": torch.arange(-5, 7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "codes": torch.randint(-128, 127, (5, 3), dtype=torch.int8, generator=generator),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def copy_in_ranges(source, dest, file: ArrivingFile, ranges: list[tuple[int, int]]) -> None:
    """Write `ranges` of `source` into `dest` at the same offsets, reporting each, as a download does."""
    data = source.read_bytes()
    fd = os.open(dest, os.O_WRONLY)
    try:
        for start, end in ranges:
            os.pwrite(fd, data[start:end], start)
            file.written(start, end)
    finally:
        os.close(fd)


def pieces(size: int, piece: int) -> list[tuple[int, int]]:
    return [(start, min(start + piece, size)) for start in range(0, size, piece)]


def test_every_tensor_equals_safe_open_when_ranges_arrive_in_any_order(checkpoint, tmp_path):
    size = checkpoint.stat().st_size
    building = tmp_path / "building"
    building.write_bytes(b"\0" * size)
    file = ArrivingFile(building, tmp_path / "final.safetensors", size)
    ranges = pieces(size, 97)
    random.Random(1).shuffle(ranges)
    writer = threading.Thread(target=copy_in_ranges, args=(checkpoint, building, file, ranges))
    writer.start()
    streamed = ArrivingSafetensors(file)
    read = {name: streamed.get_tensor(name).clone() for name in streamed.keys()}
    writer.join()
    with safe_open(str(checkpoint), framework="pt") as whole:
        assert sorted(read) == sorted(whole.keys())
        for name, tensor in read.items():
            expected = whole.get_tensor(name)
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
            assert torch.equal(tensor, expected), name
        assert torch.equal(streamed.get_slice("codes")[1:3, :2], whole.get_slice("codes")[1:3, :2])
    offsets = [streamed._entries[name]["data_offsets"][0] for name in streamed.keys()]
    assert offsets == sorted(offsets)  # the download's order


def test_a_read_waits_for_its_own_bytes_and_no_others(checkpoint, tmp_path):
    size = checkpoint.stat().st_size
    building = tmp_path / "building"
    building.write_bytes(b"\0" * size)
    file = ArrivingFile(building, tmp_path / "final.safetensors", size)
    copy_in_ranges(checkpoint, building, file, [(0, 8)])
    header_read = threading.Event()
    outcome = {}

    def reader():
        outcome["streamed"] = ArrivingSafetensors(file)
        header_read.set()

    thread = threading.Thread(target=reader)
    thread.start()
    assert not header_read.wait(0.2)  # the header's bytes are not all in yet
    with safe_open(str(checkpoint), framework="pt") as whole:
        header_end = 8 + int.from_bytes(checkpoint.read_bytes()[:8], "little")
        copy_in_ranges(checkpoint, building, file, [(8, header_end)])
        thread.join(10)
        streamed = outcome["streamed"]
        first, last = streamed.keys()[0], streamed.keys()[-1]
        begin, end = (header_end + o for o in streamed._entries[last]["data_offsets"])
        copy_in_ranges(checkpoint, building, file, [(begin, end)])  # the last tensor's bytes only
        assert torch.equal(streamed.get_tensor(last), whole.get_tensor(last))
        assert not file._covered(header_end, begin)  # the first tensor's bytes are still missing
        file.complete()  # (renamed whole: every byte is in)
        os.replace(building, file.final)
        copy_in_ranges(checkpoint, file.final, file, [(0, size)])
        assert torch.equal(streamed.get_tensor(first), whole.get_tensor(first))


def test_written_ranges_merge():
    file = ArrivingFile(None, None, 100)
    for start, end in [(10, 20), (30, 40), (20, 25), (50, 60), (25, 30), (0, 5)]:
        file.written(start, end)
    assert (file._starts, file._ends) == ([0, 10, 50], [5, 40, 60])
    assert file._covered(10, 40) and file._covered(12, 12) and not file._covered(4, 11)
    file.written(5, 50)
    assert (file._starts, file._ends) == ([0], [60])
    assert file._covered(0, 60) and not file._covered(59, 61)


def test_a_failed_download_reaches_the_waiting_reader(tmp_path):
    file = ArrivingFile(tmp_path / "building", tmp_path / "final.safetensors", 1000)
    errors = []

    def reader():
        try:
            ArrivingSafetensors(file)
        except ModelSourceError as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    file.fail(ModelSourceError("s3://b/m/: an object changed during the download"))
    thread.join(10)
    assert [str(e) for e in errors] == ["s3://b/m/: an object changed during the download"]
    with pytest.raises(ModelSourceError, match="object changed"):
        file.read(0, 8)  # and every later read
    whole = ArrivingFile(tmp_path / "building", tmp_path / "whole.safetensors", 8)
    whole.complete()
    whole.fail(ModelSourceError("s3://b/m/: another file is truncated"))  # the entry goes: no read of it
    with pytest.raises(ModelSourceError, match="another file is truncated"):
        whole.read(0, 8)


def test_a_corrupt_header_is_a_clear_error(tmp_path):
    path = tmp_path / "building"
    path.write_bytes((10 ** 9).to_bytes(8, "little") + b"{}")
    file = ArrivingFile(path, tmp_path / "final.safetensors", 10)
    file.complete()
    with pytest.raises(ModelSourceError, match="not a safetensors file: a header of 1000000000 bytes"):
        ArrivingSafetensors(file)
    path.write_bytes((2).to_bytes(8, "little") + b"[x")
    file = ArrivingFile(path, tmp_path / "final.safetensors", 10)
    file.complete()
    with pytest.raises(ModelSourceError, match="its header is not JSON"):
        ArrivingSafetensors(file)


def test_the_registry_finds_a_file_by_its_final_path(tmp_path):
    file = ArrivingFile(tmp_path / ".tmp" / "model.safetensors", tmp_path / "entry" / "model.safetensors", 8)
    register(file)
    try:
        assert arriving_file(tmp_path / "entry" / ".." / "entry" / "model.safetensors") is file
        assert arriving_file(tmp_path / ".tmp" / "model.safetensors") is None
    finally:
        unregister(file)
    assert arriving_file(tmp_path / "entry" / "model.safetensors") is None
