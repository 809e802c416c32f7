"""Models named by hf:// and s3:// references, against real servers: moto's S3 server and a local
server speaking the Hub's HTTP API. What comes down serves exactly what the local files serve."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from ferry.worker.common.objectstore import s3_client
from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.models.errors import ModelSourceError
from ferry.worker.models.sources import NodeCache, fetch_model, parse_ref, s3
from ferry.worker.models.sources.refs import BadReferenceError
from ferry.worker.snapshots import fingerprint
from tests.gguf_files import write_gguf

pytestmark = pytest.mark.s3

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_cache_bytes=4 << 20, max_model_len=128)
PROMPTS = ["def fibonacci(n):", "The quick brown fox"]


def tokens(model, cache) -> list[list[int]]:
    llm = LLM(str(model), model_cache_dir=str(cache), **ENGINE)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def upload(bucket: str, directory, prefix: str) -> None:
    client = s3_client()
    for path in directory.iterdir():
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def assert_nothing_half_written(cache) -> None:
    downloads = cache / "downloads"
    assert NodeCache(cache).entries() == []
    assert [p.name for p in downloads.iterdir() if p.name != ".locks"] == [] if downloads.exists() else True


def test_references_parse_as_documented():
    ref = parse_ref("hf://org/name@v1.0")
    assert (ref.scheme, ref.repo, ref.path, ref.revision, ref.served_name) == ("hf", "org/name", "", "v1.0", "name")
    gguf = parse_ref("hf://org/name/sub/model.Q4_K_M.gguf")
    assert gguf.gguf and gguf.path == "sub/model.Q4_K_M.gguf" and gguf.served_name == "model.Q4_K_M.gguf"
    bucket = parse_ref("s3://bucket/models/llama/")
    assert (bucket.repo, bucket.path, bucket.served_name, bucket.gguf) == ("bucket", "models/llama/", "llama", False)
    assert parse_ref("s3://bkt/x.gguf").gguf
    assert parse_ref("org/name") is None and parse_ref("org/name", bare_hub_ids=True).source == "hf://org/name"
    assert parse_ref("./models/tiny", bare_hub_ids=True) is None and parse_ref("/abs/dir", bare_hub_ids=True) is None
    for bad in ("hf://justone", "hf://org/name/README.md", "hf://org/name@", "s3://Bad_Bucket/x"):
        with pytest.raises(BadReferenceError, match="model reference"):
            parse_ref(bad)


def test_s3_model_serves_the_tokens_of_its_local_directory(llama_dir, s3_bucket, tmp_path, monkeypatch):
    upload(s3_bucket, llama_dir, "tiny")
    monkeypatch.setattr(s3, "RANGE_BYTES", 64 << 10)  # many ranged GETs per file, written out of order
    cache = tmp_path / "cache"
    assert tokens(f"s3://{s3_bucket}/tiny/", cache) == tokens(llama_dir, tmp_path / "local")
    [entry] = NodeCache(cache).entries()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (entry.path / name).read_bytes() == (llama_dir / name).read_bytes()
    assert entry.source["ref"] == f"s3://{s3_bucket}/tiny/" and entry.source["bytes_per_s"] > 0


def test_gguf_in_s3_and_on_the_hub_serves_the_tokens_of_the_local_file(llama_dir, s3_bucket, hub, tmp_path):
    (tmp_path / "files").mkdir()
    gguf = write_gguf(llama_dir, tmp_path / "files" / "tiny.Q8_0.gguf", "Q8_0")
    s3_client().upload_file(str(gguf), s3_bucket, "ggufs/tiny.Q8_0.gguf")
    hub.add("org/tiny-gguf", gguf.parent)
    local = tokens(gguf, tmp_path / "local")
    assert tokens(f"s3://{s3_bucket}/ggufs/tiny.Q8_0.gguf", tmp_path / "s3") == local
    assert tokens("hf://org/tiny-gguf/tiny.Q8_0.gguf", tmp_path / "hub") == local


def test_hub_model_serves_the_tokens_of_its_local_directory(llama_dir, hub, tmp_path):
    (files := tmp_path / "repo").mkdir()
    for path in llama_dir.iterdir():
        shutil.copy(path, files / path.name)
    (files / "README.md").write_text("not a serving file")
    (files / "pytorch_model.bin").write_bytes(b"another weight format: never downloaded")
    repo = hub.add("org/tiny", files)
    cache = tmp_path / "cache"
    assert tokens("hf://org/tiny", cache) == tokens(llama_dir, tmp_path / "local")
    [entry] = NodeCache(cache).entries()
    assert entry.source["version"] == repo.commit
    assert sorted(p.name for p in entry.path.iterdir()) == sorted(
        ["source.json", *(p.name for p in llama_dir.iterdir())])
    assert hub.gets[("org/tiny", "README.md")] == hub.gets[("org/tiny", "pytorch_model.bin")] == 0


def test_a_pinned_revision_is_served_from_the_cache_without_asking_the_hub(llama_dir, hub, tmp_path):
    repo = hub.add("org/pinned", llama_dir, branches=("main", "v1"))
    cache = tmp_path / "cache"
    first = fetch_model(parse_ref("hf://org/pinned@v1"), cache)
    gets = hub.count_gets("org/pinned")
    del hub.repos["org/pinned"]  # the Hub forgets it: only the cache can answer now
    assert fetch_model(parse_ref(f"hf://org/pinned@{repo.commit}"), cache) == first
    assert hub.count_gets("org/pinned") == gets
    with pytest.raises(ModelSourceError, match="hf://org/pinned@v1: the repository 'org/pinned' does not exist"):
        fetch_model(parse_ref("hf://org/pinned@v1"), cache)  # a branch moves: it is always asked


def test_the_hub_commit_is_part_of_the_snapshot_fingerprint(llama_dir, hub, tmp_path):
    hub.add("org/fp", llama_dir)
    from_hub = LLM("hf://org/fp", model_cache_dir=str(tmp_path / "cache"), **ENGINE).engine
    local = LLM(str(llama_dir), **ENGINE).engine
    assert json.loads((from_hub.model_dir / "source.json").read_text())["version"] == hub.repos["org/fp"].commit
    assert fingerprint(from_hub) != fingerprint(local)


def test_a_bare_hub_id_downloads_when_the_local_hf_cache_lacks_it(llama_dir, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    hub.add("org/bare", llama_dir)
    llm = LLM("org/bare", model_cache_dir=str(tmp_path / "cache"), **ENGINE)
    assert llm.engine.model_dir.parent == tmp_path / "cache" / "downloads"


def test_the_cache_cap_evicts_the_least_recently_used_model(llama_dir, hub, tmp_path):
    for name in ("one", "two", "three"):
        hub.add(f"org/{name}", llama_dir)  # three repos, three commits, one size
    cache = tmp_path / "cache"
    one = fetch_model(parse_ref("hf://org/one"), cache)
    fetch_model(parse_ref("hf://org/two"), cache)
    fetch_model(parse_ref("hf://org/one"), cache)  # used again: now "two" is the least recent
    cap = sum(e.size for e in NodeCache(cache).entries()) + 1000  # room for two models
    three = fetch_model(parse_ref("hf://org/three"), cache, max_bytes=cap)
    assert [e.path for e in NodeCache(cache).entries()] == [three, one]


def test_a_crashed_download_leaves_nothing_that_looks_complete_and_is_cleaned_up(llama_dir, hub, tmp_path):
    hub.add("org/crash", llama_dir, truncate={"model.safetensors": 1000})
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match="hf://org/crash: model.safetensors is truncated"):
        fetch_model(parse_ref("hf://org/crash"), cache)
    assert_nothing_half_written(cache)
    ref = parse_ref("hf://org/crash")
    hub.add("org/crash", llama_dir)
    key = ref.cache_key(hub.repos["org/crash"].commit)
    leftover = cache / "downloads" / f".tmp-{key}-99999-deadbeef"  # as a killed process leaves it
    (leftover / "model.safetensors").parent.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    path = fetch_model(ref, cache)
    assert path.name == key and not leftover.exists()


def test_s3_errors_name_the_reference_and_the_cause(llama_dir, s3_bucket, tmp_path):
    upload(s3_bucket, llama_dir, "tiny")
    missing_bucket = f"nobucket-{uuid.uuid4().hex[:8]}"
    cases = {
        f"s3://{missing_bucket}/tiny/": f"the bucket '{missing_bucket}' does not exist",
        f"s3://{s3_bucket}/nothing/": "no model under",
        f"s3://{s3_bucket}/tiny/missing.gguf": "no object 'tiny/missing.gguf'",
    }
    for text, cause in cases.items():
        with pytest.raises(ModelSourceError, match=f"^{text}: {cause}"):
            fetch_model(parse_ref(text), tmp_path / "cache")
    assert_nothing_half_written(tmp_path / "cache")


def test_an_unreachable_source_serves_the_copy_already_cached(llama_dir, hub, tmp_path, monkeypatch):
    hub.add("org/offline", llama_dir)
    cache = tmp_path / "cache"
    cached = fetch_model(parse_ref("hf://org/offline"), cache)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")  # nothing listens there
    assert fetch_model(parse_ref("hf://org/offline"), cache) == cached
    with pytest.raises(ModelSourceError, match="hf://org/other: the Hub .* is unreachable"):
        fetch_model(parse_ref("hf://org/other"), cache)
