"""Snapshots through a real S3 API (moto's server on a free port, spoken to over HTTP by boto3)."""

from __future__ import annotations

import json
import os

import boto3
import pytest

from ferry.worker.common.objectstore import FileStore, S3Store, StoreError, open_store
from ferry.worker.snapshots import POINTER, list_snapshots, save_snapshot
from tests.snapshots.util import generate

pytestmark = pytest.mark.s3

PROMPT = list(range(7, 47))


def test_round_trip_through_s3(make_engine, restored_engine, s3_bucket):
    url = f"s3://{s3_bucket}/models/tiny"
    engine = make_engine()
    tokens, _ = generate(engine, PROMPT)
    info = save_snapshot(engine, url)
    assert info.url == url and info.blocks == 11

    client = boto3.client("s3", endpoint_url=os.environ["FERRY_S3_ENDPOINT_URL"])
    pointer = json.loads(client.get_object(Bucket=s3_bucket, Key=f"models/tiny/{POINTER}")["Body"].read())
    assert pointer["snapshot"] == info.key

    restored, restored_stats = restored_engine(url)
    assert restored_stats.restores == {"ok": 1}
    again, cached = generate(restored, PROMPT)
    assert cached == 36 and again == tokens


def test_keep_and_prune_on_s3(make_engine, s3_bucket):
    url = f"s3://{s3_bucket}/p"
    engine = make_engine()
    generate(engine, PROMPT)
    keys = [save_snapshot(engine, url).key for _ in range(3)]  # keep defaults to 3
    keys.append(save_snapshot(engine, url, keep=1).key)
    assert list(list_snapshots(open_store(url))) == keys[-1:]


def test_large_files_go_multipart(s3_bucket, tmp_path):
    store = S3Store(s3_bucket, "big", multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    data = os.urandom((11 << 20) + 123)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    sent: list[int] = []
    store.upload("blob.bin", src, sent.append)
    assert sum(sent) == len(data)
    head = store.client.head_object(Bucket=s3_bucket, Key="big/blob.bin")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 + 5 + 1 MiB
    dst = tmp_path / "dst.bin"
    store.download("blob.bin", dst)
    assert dst.read_bytes() == data


def test_missing_and_corrupt_on_s3_start_cold(make_engine, restored_engine, s3_bucket):
    url = f"s3://{s3_bucket}/m"
    assert restored_engine(url)[1].restores == {"missing": 1}
    engine = make_engine()
    generate(engine, PROMPT)
    info = save_snapshot(engine, url)
    client = boto3.client("s3", endpoint_url=os.environ["FERRY_S3_ENDPOINT_URL"])
    client.put_object(Bucket=s3_bucket, Key=f"m/{info.key}/shard-00000.safetensors", Body=b"not a shard")
    restored, restored_stats = restored_engine(url)
    assert restored_stats.restores == {"corrupt": 1}
    assert restored.kv_usage().num_cached_free_blocks == 0


def test_missing_bucket_starts_cold(make_engine, restored_engine, s3_bucket):
    engine, engine_stats = restored_engine(f"s3://{s3_bucket}-absent/x")
    assert engine_stats.restores == {"unreachable": 1}


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_read_chunks_streams_an_object_without_reading_it_whole(kind, request, tmp_path):
    store = FileStore(tmp_path / "store") if kind == "file" else S3Store(request.getfixturevalue("s3_bucket"), "c")
    data = os.urandom((17 << 20) + 5)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    store.upload("files/blob.jsonl", src)
    chunks = list(store.read_chunks("files/blob.jsonl"))
    assert b"".join(chunks) == data
    assert len(chunks) >= 3 and max(len(c) for c in chunks) <= 8 << 20
    with pytest.raises(StoreError):
        list(store.read_chunks("files/missing.jsonl"))
