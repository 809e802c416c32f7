"""LoRA adapters end to end: `ferry worker` on a tiny llama started with FERRY_LORA_MODULES, `ferry api`,
and the official `openai` client naming an adapter as its model. Greedy tokens equal the offline
engine's with the same adapter (and differ from the base model's: the adapter was applied); an
adapter registered at run time serves at once; a corrupt adapter fails its jobs alone."""

from __future__ import annotations

import hashlib
import json

import httpx
import openai
import pytest
import redis

from ferry.worker.engine import LLM, LoRARequest, SamplingParams
from ferry.worker.protocol import Keys
from tests.api.conftest import REDIS_URL, Proc, delete_prefix, free_port, new_prefix, stack_env, wait_until
from tests.lora_adapters import write_adapter

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(600),
              # peft (writing the test adapters) reads an attribute transformers 5 deprecates
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]

KEY_ADMIN, KEY_USER = "sk-lora-e2e-admin", "sk-lora-e2e-user"
PROMPT = "The quick brown fox"
MAX_TOKENS = 8


class LoraStack:
    def __init__(self, url: str, prefix: str, procs: dict[str, Proc], base_dir, adapters: dict):
        self.url, self.prefix, self.procs, self.base_dir, self.adapters = url, prefix, procs, base_dir, adapters

    def openai(self, key: str = KEY_USER) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def job(self, job_id: str) -> dict:
        headers = {"Authorization": f"Bearer {KEY_USER}"}
        return httpx.get(f"{self.url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()

    def job_tokens(self, completion_id: str) -> list[int]:
        return self.job(completion_id.removeprefix("cmpl-"))["output"]["token_ids"]


@pytest.fixture(scope="module")
def lstack(tiny_model_factory, tmp_path_factory):
    base_dir = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("loras")
    adapters = {
        "sql": write_adapter(base_dir, root / "sql", r=8, alpha=16, targets=("q_proj", "v_proj"), seed=0),
        "poet": write_adapter(base_dir, root / "poet", r=8, alpha=16, targets=("q_proj", "v_proj"), seed=1),
        "broken": write_adapter(base_dir, root / "broken", seed=2),
    }
    (adapters["broken"] / "adapter_model.safetensors").write_bytes(b"\x00not a safetensors file")
    keys = ",".join(f"{hashlib.sha256(k.encode()).hexdigest()}:{spec}"
                    for k, spec in ((KEY_ADMIN, "ops;admin=true"), (KEY_USER, "tenant-a")))
    prefix, port = new_prefix(), free_port()
    env = stack_env(prefix, base_dir, FERRY_API_KEYS=keys,
                    FERRY_LORA_MODULES=f"sql={adapters['sql']},broken={adapters['broken']}")
    logs = tmp_path_factory.mktemp("lora-logs")
    procs = {"worker": Proc("worker", ["worker"], env, logs),
             "api": Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)], env, logs)}
    stack = LoraStack(f"http://127.0.0.1:{port}", prefix, procs, base_dir, adapters)
    try:
        wait_until(lambda: httpx.get(stack.url + "/readyz").status_code == 200, 180, "the stack", procs.values())
        yield stack
    finally:
        for proc in procs.values():
            proc.stop()
        delete_prefix(prefix)


@pytest.fixture(scope="module")
def offline(lstack):
    """The offline engine's greedy tokens for PROMPT: per adapter name, and None for the base model."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [None, "sql", "poet"]
    with LLM(str(lstack.base_dir), enable_lora=True) as llm:
        loras = [None if n is None else LoRARequest(n, i, str(lstack.adapters[n])) for i, n in enumerate(names)]
        outs = llm.generate([PROMPT] * len(names), params, use_tqdm=False, lora_request=loras)
    return {name: list(out.token_ids) for name, out in zip(names, outs, strict=True)}


def complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_an_operator_adapter_serves_the_offline_engines_tokens(lstack, offline):
    with lstack.openai() as client:
        listed = {m.id: m for m in client.models.list().data}
        assert listed["sql"].model_extra == {"parent": "tiny", "root": str(lstack.adapters["sql"])}
        adapted = complete(client, "sql")
        base = complete(client, "tiny")
    assert adapted.model == "sql" and base.model == "tiny"
    assert lstack.job_tokens(adapted.id) == offline["sql"]
    assert lstack.job_tokens(base.id) == offline[None]
    assert offline["sql"] != offline[None]  # the adapter changes the answer: it was applied


def test_every_route_answers_with_the_adapters_name(lstack):
    with lstack.openai() as client:
        chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
        response = client.responses.create(model="sql", input="hi", max_output_tokens=2, temperature=0)
    assert chat.model == response.model == "sql"
    job = lstack.job(chat.id.removeprefix("chatcmpl-"))
    assert job["model"] == "sql" and job["status"] == "succeeded"


def test_an_adapter_loaded_at_run_time_serves_at_once(lstack, offline):
    body = {"lora_name": "poet", "lora_path": str(lstack.adapters["poet"])}
    r = httpx.post(lstack.url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY_ADMIN}"})
    assert r.status_code == 200, r.text
    with lstack.openai() as client:
        adapted = complete(client, "poet")
    assert adapted.model == "poet"
    assert lstack.job_tokens(adapted.id) == offline["poet"] != offline["sql"]


def test_a_corrupt_adapter_fails_its_job_and_the_base_model_serves_on(lstack, offline):
    assert "LoRA adapter not loaded" in lstack.procs["worker"].log()  # at start, one line; the worker serves on
    with lstack.openai() as client:
        with pytest.raises(openai.UnprocessableEntityError) as failed:
            complete(client, "broken")
        assert failed.value.body["code"] == "lora_load_failed" and "broken" in failed.value.body["message"]
        assert lstack.job_tokens(complete(client, "tiny").id) == offline[None]


def test_the_heartbeat_lists_the_adapters_the_engine_holds(lstack):
    with lstack.openai() as client:
        complete(client, "sql")
    rdb = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = Keys(lstack.prefix)

    def held() -> set[str]:
        return {name for worker in rdb.zrange(keys.workers, 0, -1)
                for name in json.loads(rdb.hget(keys.worker(worker), "loras") or "[]")}

    wait_until(lambda: "sql" in held(), 10, "the heartbeat to list sql")
    assert "broken" not in held()
    rdb.close()
