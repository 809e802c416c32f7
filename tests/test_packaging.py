"""One import namespace: Ferry's code is `ferry.*`, Hugging Face's `kernels` (which transformers
requires) imports beside it, the wheel holds only the namespace, and every `FERRY_*` variable is
declared by one settings class."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ferry.api.settings import ApiSettings
from ferry.autoscaler.settings import AutoscalerSettings
from ferry.worker.common.settings import FerrySettings
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.tools.up import UpSettings
from ferry.worker.webhooks.settings import WebhookSettings

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    # `python -c` from the repository root: the checkout's folders are on sys.path, the case where
    # a top-level `kernels/` package of Ferry's used to shadow Hugging Face's.
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_hugging_face_kernels_and_ferry_import_side_by_side(llama_dir):
    code = f"""
import kernels, transformers.modeling_utils
from transformers.integrations import hub_kernels
assert kernels.__file__.endswith("site-packages/kernels/__init__.py"), kernels.__file__
assert hasattr(kernels, "get_kernel") and hub_kernels.is_kernels_available()
from ferry.kernels import ops
from ferry.worker.engine import LLM, SamplingParams
out = LLM({str(llama_dir)!r}, kv_cache_bytes=1 << 22).generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
assert len(out[0].token_ids) == 4, out
print("ok")
"""
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


def test_the_names_from_before_the_namespace_are_aliases_not_copies():
    code = """
import ferry.worker.engine, ferry.worker.engine.llm, ferry.api.main
from worker.engine import LLM
import worker.engine.llm, api.main
assert LLM is ferry.worker.engine.LLM and worker.engine.llm is ferry.worker.engine.llm
assert api.main is ferry.api.main and worker.engine.llm.__spec__.name == "ferry.worker.engine.llm"
print("ok")
"""
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


SETTINGS = [WorkerSettings, ApiSettings, WebhookSettings, AutoscalerSettings, UpSettings]


def test_no_ferry_variable_is_declared_twice():
    owners: dict[str, list[str]] = {}
    for cls in SETTINGS:
        for name in cls.own_variable_names():
            owners.setdefault(name, []).append(cls.__name__)
    for name in FerrySettings.variable_names():
        owners.setdefault(name, []).append("FerrySettings")
    assert {name: who for name, who in owners.items() if len(who) > 1} == {}
    assert all(issubclass(cls, FerrySettings) for cls in SETTINGS)


@pytest.mark.slow
def test_the_wheel_holds_only_the_ferry_namespace(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info/ beside the sources.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("worker", "api", "kernels", "infra", "bench", "tests"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("ferry-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"ferry"}
    wanted = {"ferry/worker/engine/llm.py", "ferry/api/main.py", "ferry/kernels/ops.py", "ferry/autoscaler/cli.py",
              "ferry/kernels/cpu/csrc/bindings.cpp", "ferry/worker/common/settings.py"}
    assert wanted <= set(names)
    assert not any(name.startswith(("ferry/bench", "bench/", "ferry/tests", "ferry/infra")) for name in names)
