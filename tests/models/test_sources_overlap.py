"""A model from S3 downloads while the engine is built: the configs and tokenizer come first, the
engine starts on them, and the loader reads each tensor as its bytes arrive (another process's
loader waits for each weight file whole).
Against moto's S3 server; the weight GETs are held back until the loader asks for the file, so
the order is certain without any timing."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from ferry.worker.common.objectstore import s3_client
from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.models import loader
from ferry.worker.models.errors import ModelSourceError
from ferry.worker.models.safetensors_stream import ArrivingSafetensors
from ferry.worker.models.sources import NodeCache, background, parse_ref, s3
from ferry.worker.models.sources.background import BackgroundFetch
from ferry.worker.models.sources.progress import DownloadCancelled
from ferry.worker.serve import early_start

pytestmark = pytest.mark.s3

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_cache_bytes=4 << 20, max_model_len=128)


@pytest.fixture
def held_weights(monkeypatch):
    """Ranged GETs of weight files wait until the event is set; every other GET goes at once."""
    release = threading.Event()
    get_range = s3._get_range

    def held(client, bucket, file, *args):
        if file.name.endswith(".safetensors"):
            assert release.wait(60), "the weights were never asked for"
        return get_range(client, bucket, file, *args)

    monkeypatch.setattr(s3, "_get_range", held)
    return release


def test_the_engine_is_built_while_the_weights_download(llama_dir, s3_bucket, tmp_path, monkeypatch, held_weights):
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"overlap/{path.name}")
    cache = tmp_path / "cache"
    asked = []  # (weight file, whether it was there) as the loader opens it
    open_weights = loader.open_weights

    def loader_opens(path):
        asked.append((path.name, path.exists()))
        held_weights.set()  # only now may the weights come: the engine was started without them
        return open_weights(path)

    monkeypatch.setattr(loader, "open_weights", loader_opens)
    fetch = BackgroundFetch(parse_ref(f"s3://{s3_bucket}/overlap/"), cache)
    entry = fetch.entry()
    assert (entry / "config.json").is_file() and (entry / "tokenizer.json").is_file()
    assert not (entry / "model.safetensors").exists() and NodeCache(cache).entries() == []  # nothing looks complete

    llm = LLM(str(entry), model_cache_dir=str(cache), **ENGINE)
    assert asked == [("model.safetensors", False)]
    assert fetch.result() == entry and [e.path for e in NodeCache(cache).entries()] == [entry]
    local = LLM(str(llama_dir), **ENGINE)
    prompt = "The quick brown fox"
    assert (llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
            == local.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids)


def test_tensors_load_as_their_bytes_arrive_before_the_file_is_whole(llama_dir, s3_bucket, tmp_path, monkeypatch):
    # ranges of 4 KiB: the GET of the file's last range is held until the loader has read tensors
    # from the ranges before it, which it can only do while the file is still downloading
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"stream/{path.name}")
    monkeypatch.setattr(s3, "RANGE_BYTES", 4096)
    weights = llama_dir / "model.safetensors"
    size = weights.stat().st_size
    last_start = (size - 1) // 4096 * 4096
    tensors_read = threading.Event()
    read_before_whole = []  # tensor names the loader read while the last range was held
    get_range, get_tensor = s3._get_range, ArrivingSafetensors.get_tensor

    def held(client, bucket, file, path, start, *args):
        if file.name == "model.safetensors" and start == last_start:
            assert tensors_read.wait(60), "the loader read no tensor before the file was whole"
        return get_range(client, bucket, file, path, start, *args)

    def counted(self, name):
        tensor = get_tensor(self, name)
        if not tensors_read.is_set():
            read_before_whole.append(name)
            if len(read_before_whole) == 3:
                tensors_read.set()
        return tensor

    monkeypatch.setattr(s3, "_get_range", held)
    monkeypatch.setattr(ArrivingSafetensors, "get_tensor", counted)
    cache = tmp_path / "cache"
    fetch = BackgroundFetch(parse_ref(f"s3://{s3_bucket}/stream/"), cache)
    llm = LLM(str(fetch.entry()), model_cache_dir=str(cache), **ENGINE)
    assert len(read_before_whole) == 3
    assert fetch.result() == fetch.entry() and (fetch.entry() / "model.safetensors").stat().st_size == size
    local = LLM(str(llama_dir), **ENGINE)
    prompt = "The quick brown fox jumps over"
    assert (llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
            == local.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids)


def test_a_download_failing_while_the_loader_waits_fails_the_load_and_leaves_nothing(
        llama_dir, s3_bucket, tmp_path, monkeypatch, held_weights):
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"changing/{path.name}")
    cache = tmp_path / "cache"
    open_weights = loader.open_weights

    def replaced_then_opens(path):
        s3_client().put_object(Bucket=s3_bucket, Key=f"changing/{path.name}", Body=b"another version")
        held_weights.set()  # the held GETs now ask for an ETag the object no longer has
        return open_weights(path)

    monkeypatch.setattr(loader, "open_weights", replaced_then_opens)
    fetch = BackgroundFetch(parse_ref(f"s3://{s3_bucket}/changing/"), cache)
    entry = fetch.entry()
    with pytest.raises(ModelSourceError, match="an object changed during the download"):
        LLM(str(entry), model_cache_dir=str(cache), **ENGINE)  # the loader gets the download's own error
    error = fetch.cancel()
    assert isinstance(error, ModelSourceError) and "an object changed during the download" in str(error)
    assert NodeCache(cache).entries() == [] and not entry.exists()


def test_another_process_loading_a_downloading_file_waits_for_it_whole(llama_dir, s3_bucket, tmp_path, monkeypatch,
                                                                       held_weights):
    # not this process's download (a second worker on the node, a tensor-parallel rank): no arriving
    # file is registered for it, and the loader waits for the whole file (node_cache.wait_for_file)
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"elsewhere/{path.name}")
    cache = tmp_path / "cache"
    waited = []
    wait_for_file = loader.wait_for_file

    def loader_waits(path):
        waited.append((path.name, path.exists()))
        held_weights.set()
        wait_for_file(path)

    monkeypatch.setattr(loader, "wait_for_file", loader_waits)
    monkeypatch.setattr(loader, "arriving_file", lambda path: None)  # as seen from another process
    fetch = BackgroundFetch(parse_ref(f"s3://{s3_bucket}/elsewhere/"), cache)
    llm = LLM(str(fetch.entry()), model_cache_dir=str(cache), **ENGINE)
    assert waited == [("model.safetensors", False)]
    local = LLM(str(llama_dir), **ENGINE)
    assert (llm.generate("Hello", GREEDY, use_tqdm=False)[0].token_ids
            == local.generate("Hello", GREEDY, use_tqdm=False)[0].token_ids)


def test_ferry_worker_starts_the_download_before_it_imports_torch():
    """`ferry worker`'s entry point starts the model's download first (worker/serve/early_start.py):
    the imports of torch and the engine then run while it downloads."""
    code = """
import sys
from ferry.worker.serve import early_start
seen = []
early_start.start = lambda argv: seen.append(("torch" in sys.modules, argv))
from ferry.worker import cli
try:
    cli.main(["worker", "--model", "s3://bucket/model/", "--help"])
except SystemExit:
    pass
print(seen, "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[(False, ['--model', 's3://bucket/model/', '--help'])] True", \
        done.stderr[-2000:]


def test_the_worker_takes_over_the_early_download_of_its_own_model(llama_dir, s3_bucket, tmp_path, monkeypatch):
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"early/{path.name}")
    cache = tmp_path / "cache"
    monkeypatch.setenv("FERRY_MODEL", f"s3://{s3_bucket}/early/")
    monkeypatch.setenv("FERRY_MODEL_CACHE", str(cache))
    early = early_start.start([])
    assert early is not None and early.ref.text == f"s3://{s3_bucket}/early/"
    assert background.take(parse_ref(f"s3://{s3_bucket}/early/"), cache, None) is early  # the same download
    assert (early.result() / "model.safetensors").is_file()
    assert early_start.start(["--model", str(llama_dir)]) is None  # a local model: nothing to fetch


def test_an_early_download_of_another_model_is_stopped(llama_dir, s3_bucket, tmp_path, monkeypatch, held_weights):
    # the settings name another cache than the entry point read: the early download stops (its weight
    # GET is held until then), nothing of it stays, and the worker's own download runs
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"other/{path.name}")
    early_cache, cache = tmp_path / "early-cache", tmp_path / "cache"
    monkeypatch.setenv("FERRY_MODEL_CACHE", str(early_cache))
    early = early_start.start(["--model", f"s3://{s3_bucket}/other/"])
    early.entry()  # the small files are in: its weights' GET is held
    taken = background.take(parse_ref(f"s3://{s3_bucket}/other/"), cache, None)
    assert taken is not early
    held_weights.set()
    with pytest.raises(DownloadCancelled):
        early.result()
    assert (taken.result() / "model.safetensors").is_file()
    assert NodeCache(early_cache).entries() == []
    assert [p.name for p in (early_cache / "downloads").iterdir()] == [".locks"]  # nothing half-written


def test_a_sharded_checkpoint_streams_shard_by_shard(llama_dir, s3_bucket, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(sharded, max_shard_size="100KB")
    for path in llama_dir.iterdir():
        if not path.name.endswith(".safetensors") and not (sharded / path.name).exists():
            (sharded / path.name).write_bytes(path.read_bytes())  # tokenizer files
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    for path in sharded.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"sharded/{path.name}")
    streamed = []  # shards the loader opened while the download was still running
    opened = threading.Event()
    init, get_range = ArrivingSafetensors.__init__, s3._get_range

    def recorded(self, file):
        streamed.append(file.final.name)
        opened.set()
        init(self, file)

    def last_shard_held(client, bucket, file, *args):
        if file.name == shards[-1]:  # the download cannot end before the loader opens a shard
            assert opened.wait(60), "the loader opened no shard while the download ran"
        return get_range(client, bucket, file, *args)

    monkeypatch.setattr(ArrivingSafetensors, "__init__", recorded)
    monkeypatch.setattr(s3, "_get_range", last_shard_held)
    cache = tmp_path / "cache"
    fetch = BackgroundFetch(parse_ref(f"s3://{s3_bucket}/sharded/"), cache)
    llm = LLM(str(fetch.entry()), model_cache_dir=str(cache), **ENGINE)
    fetch.result()
    assert streamed[0] == shards[0] and set(streamed) <= set(shards)  # in the index's order
    local = LLM(str(llama_dir), **ENGINE)
    prompt = "A sharded checkpoint"
    assert (llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
            == local.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids)
