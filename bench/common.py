"""What every benchmark shares: the machine description, percentiles, and the JSON writer."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def percentiles(values: list[float], points=(50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles, in the values' unit; None for an empty list."""
    if not values:
        return {f"p{p}": None for p in points}
    ordered = sorted(values)
    return {f"p{p}": ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))] for p in points}


def ferry_beside(ferry_runs: list[float], baseline_index: int) -> float:
    """Ferry's tokens/s set against the `baseline_index`-th baseline of a bracketed run: the mean
    of the Ferry runs just before and after it (`ferry_runs` in run order, one more than the
    baselines; bench.throughput)."""
    return statistics.mean(ferry_runs[baseline_index : baseline_index + 2])


def write_result(suite: str, payload: dict, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    payload = {"suite": suite, "created": stamp, "machine": machine(), **payload}
    path = out_dir / f"{suite}-{stamp}.json"
    text = to_json(payload)
    path.write_text(text)
    (out_dir / f"{suite}-latest.json").write_text(text)
    return path


_NUMBER_LIST = re.compile(r"\[\s*(-?[0-9][-0-9.eE+]*(?:,\s*-?[0-9][-0-9.eE+]*)*)\s*\]")


def to_json(payload: dict) -> str:
    """Indented JSON with lists of numbers (raw latency samples) on one line each."""
    return _NUMBER_LIST.sub(
        lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]", json.dumps(payload, indent=2)
    )
