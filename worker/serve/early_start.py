"""`ferry worker`'s model download, begun by its entry point before the worker's own imports (torch,
transformers, the engine: about 4 s that an hf:// or s3:// download runs behind).

It reads only what the download needs, as the worker's settings do: the model (`--model`, else
FERRY_MODEL), the node cache (FERRY_MODEL_CACHE_DIR, else FERRY_MODEL_CACHE, else the default) and
its cap (FERRY_MODEL_CACHE_MAX_GB); an empty variable is an unset one. The worker's loading takes
the download over when its settings name the same model and cache (`background.take`); anything
else (a local model, a value that does not parse) leaves the download to that loading.
"""

from __future__ import annotations

import argparse
import os

from ferry.worker.models.sources import DEFAULT_CACHE_DIR, cache_dir_from_env
from ferry.worker.models.sources.background import BackgroundFetch, start_early


def start(argv: list[str]) -> BackgroundFetch | None:
    """The download of the model `ferry worker argv` will serve, started now (None: nothing to fetch)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model")
    known, _ = parser.parse_known_args(argv)
    env = {name.upper(): value for name, value in os.environ.items() if value != ""}
    model = known.model or env.get("FERRY_MODEL")
    cache_dir = cache_dir_from_env(env) or DEFAULT_CACHE_DIR
    try:
        max_gb = float(env["FERRY_MODEL_CACHE_MAX_GB"]) if "FERRY_MODEL_CACHE_MAX_GB" in env else None
    except ValueError:
        return None
    return start_early(model, cache_dir, None if max_gb is None else int(max_gb * 1e9))
