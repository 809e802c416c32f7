"""S3 readers for model weights (issue 37): Ferry's own boto3 reader against runai-model-streamer
(the reader vLLM uses), and both against the S3 server's raw ranged-GET throughput, in one run on
one moto S3 server on this machine holding SmolLM2-135M-Instruct's safetensors (the bundled GGUF
converted; bfloat16 by default, 269 MB, as the Hub publishes it; `--weights-dtype float32`: 538 MB).

Each reader runs in a fresh process (`bench/s3_read.py`), from its first S3 call (the listing) to
every tensor of the checkpoint being a torch CPU tensor in that process's memory:

  raw-get          bench.cold_start.raw_get_throughput: 16 parallel ranged GETs of 16 MiB, bodies
                   dropped (the ceiling: no tensors)
  ferry-boto3      ferry.worker.models.sources.s3 (list_files + download: 16 parallel ranged GETs
                   of 16 MiB pwritten into a temporary directory), then safetensors' safe_open on
                   every tensor, as the worker does
  ferry-boto3-64mib  the same with 64 MiB ranges (its RANGE_BYTES set in that process): fewer GETs
  ferry-stream     what `ferry worker` does: the same download into a node cache on its own thread,
                   and the loader reading each tensor as its bytes arrive (worker/models/sources/
                   arriving.py): no second read of the file; the config and tokenizer (3.5 MB) come
                   first and count in its seconds
  ferry-stream-64mib the same with 64 MiB ranges
  runai            runai-model-streamer 0.17.1's SafetensorsStreamer (+ runai-model-streamer-s3)
                   at its defaults (its log: 8 concurrent S3 reads of 8 MiB blocks)
  runai-c16        the same with RUNAI_STREAMER_CONCURRENCY=16 (Ferry's parallelism)
  runai-c16-16mib  the same with 16 MiB blocks (RUNAI_STREAMER_CHUNK_BYTESIZE) and 16 MiB parts for
                   the AWS CRT below it (RUNAI_STREAMER_S3_CLIENT_PART_SIZE): Ferry's GET size, as
                   near as runai gets (it also cuts its reads at its CPU ring buffers)
  runai-c16-64mib  the same with 64 MiB blocks and parts: fewer, larger GETs

runai runs with the Python of a separate environment, `.venv-runai/` (`--runai-python`), made on
first use from .venv's Python with --system-site-packages and a .pth file naming .venv's
site-packages, so .venv's torch is reused (never downloaded): the two packages are installed there
with --no-deps, plus humanize. If that or the read fails, the runai readers are left out with the
reason in the JSON and the table. runai reaches moto through AWS_ENDPOINT_URL, path-style
addressing (RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0), AWS_EC2_METADATA_DISABLED=true, the fake
credentials and region in the environment, and a 60 s low-throughput timeout
(RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS, see `runai_env`: at its 1 s every read from moto failed).
The server's ranged GETs are counted per run: moto reads the whole object for each one, so on
moto a reader's time follows its number of GETs more than its bytes, and raw-get is the ceiling
for 16 MiB GETs only (a reader sending fewer, larger GETs can pass it).

Every tensor a reader returns is checked against safetensors' own load of the local file (dtype,
shape and a sha256 of its bytes): a reader that returns other bytes fails the run. The readers
take turns (the order rotates each run); per reader the median of `--runs` runs is kept, its
bytes/s (the safetensors files' bytes over its seconds), and its ratio to raw-get and to
ferry-boto3 (bytes/s over bytes/s: above 1 is faster).

    python -m bench.s3_readers                     # bfloat16 weights, 3 runs per reader
    python -m bench.s3_readers --weights-dtype float32 --runs 5
    python -m bench.s3_readers --no-runai          # raw-get and the ferry-boto3 readers only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from bench.cold_start import BUCKET, PREFIX, bfloat16_copy
from bench.common import moto_s3, write_result

REPO = Path(__file__).resolve().parents[1]
RUNAI_PACKAGES = ("runai-model-streamer==0.17.1", "runai-model-streamer-s3==0.17.1", "humanize==4.17.0")
RUN_TIMEOUT_S = 600
REFERENCE, CEILING = "ferry-boto3", "raw-get"
RUNAI_LOG = "[RunAI Streamer]"  # its INFO lines (RUNAI_STREAMER_LOG_TO_STDERR=1): the CPU ring, the overall MiB/s


@dataclass(frozen=True)
class Reader:
    """One row of the comparison: a reader of bench/s3_read.py and the environment it runs in."""

    name: str
    script: str  # bench/s3_read.py's reader: raw-get | ferry-boto3 | ferry-stream | runai
    env: dict[str, str] = field(default_factory=dict)  # on top of the S3 server's

    @property
    def runai(self) -> bool:
        return self.script == "runai"


def _runai_blocks(size: int) -> dict[str, str]:
    """runai at concurrency 16 reading blocks of `size` bytes, each one GET where its ring allows."""
    return {"RUNAI_STREAMER_CONCURRENCY": "16", "RUNAI_STREAMER_CHUNK_BYTESIZE": str(size),
            "RUNAI_STREAMER_S3_CLIENT_PART_SIZE": str(size)}


READERS = (
    Reader("raw-get", "raw-get"),
    Reader("ferry-boto3", "ferry-boto3"),
    Reader("ferry-boto3-64mib", "ferry-boto3", {"BENCH_S3_RANGE_BYTES": str(64 << 20)}),
    Reader("ferry-stream", "ferry-stream"),
    Reader("ferry-stream-64mib", "ferry-stream", {"BENCH_S3_RANGE_BYTES": str(64 << 20)}),
    Reader("runai", "runai"),
    Reader("runai-c16", "runai", {"RUNAI_STREAMER_CONCURRENCY": "16"}),
    Reader("runai-c16-16mib", "runai", _runai_blocks(16 << 20)),
    Reader("runai-c16-64mib", "runai", _runai_blocks(64 << 20)),
)


class WrongBytesError(RuntimeError):
    """A reader returned tensors that differ from the checkpoint's."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.s3_readers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per reader, taking turns (the median is kept)")
    p.add_argument("--weights-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--runai-python", default=str(REPO / ".venv-runai" / "bin" / "python"),
                   help="the Python that runs runai (its environment is made here on first use)")
    p.add_argument("--no-runai", action="store_true", help="raw-get and the ferry-boto3 readers only")
    p.add_argument("--results-dir", type=Path, default=None)
    return p.parse_args(argv)


def check_tensors(reader: str, expected: dict[str, list], got: dict[str, list] | None) -> None:
    """WrongBytesError unless `got` holds exactly the checkpoint's tensors with their bytes
    (name -> [dtype, shape, sha256], bench.s3_read.tensor_digest)."""
    if got is None:
        raise WrongBytesError(f"{reader} returned no tensors")
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    wrong = sorted(name for name in expected.keys() & got.keys() if expected[name] != got[name])
    if missing or extra or wrong:
        parts = [f"{what} {names[:5]}{' ...' if len(names) > 5 else ''}"
                 for what, names in (("missing", missing), ("unexpected", extra), ("other bytes in", wrong)) if names]
        raise WrongBytesError(f"{reader}: {'; '.join(parts)}")


@dataclass(frozen=True)
class Run:
    """One read by one reader."""

    seconds: float  # its first S3 call to every tensor in memory (raw-get: the GETs alone)
    ranged_gets: int  # ranged GETs the server answered meanwhile (on moto each costs a whole-object read)
    phases: dict[str, float]  # ferry-boto3: list_s, download_s, load_s (safe_open); others: none


@dataclass
class Measured:
    """Every run of every reader, against one S3 server."""

    runs: dict[str, list[Run]]  # reader -> its runs, in run order
    left_out: dict[str, str]  # reader -> why it has no figure
    runai_log: dict[str, list[str]]  # runai reader -> its first run's RUNAI_LOG lines


def summarize(measured: Measured, model_bytes: int) -> dict[str, dict]:
    """Per reader with runs: its median seconds, bytes/s, bytes/s over raw-get's and over
    ferry-boto3's (above 1: faster; None without that reader), ranged GETs and phases (medians)."""
    runs = {name: r for name, r in measured.runs.items() if r}
    medians = {name: statistics.median(run.seconds for run in r) for name, r in runs.items()}
    rate = {name: model_bytes / s for name, s in medians.items()}
    return {name: {"seconds": medians[name], "bytes_per_s": rate[name],
                   "vs_raw_get": rate[name] / rate[CEILING] if CEILING in rate else None,
                   "vs_ferry_boto3": rate[name] / rate[REFERENCE] if REFERENCE in rate else None,
                   "ranged_gets": statistics.median(run.ranged_gets for run in r),
                   "phases_s": {phase: statistics.median(run.phases[phase] for run in r) for phase in r[0].phases},
                   "runs_s": [run.seconds for run in r]}
            for name, r in runs.items()}


def reference_digests(files: list[Path]) -> dict[str, list]:
    """Every tensor of the safetensors `files`, as safetensors itself loads them locally."""
    from safetensors.torch import load_file

    from bench.s3_read import tensor_digest

    return {name: tensor_digest(t) for path in files for name, t in load_file(path).items()}


def runai_python(path: str) -> tuple[Path | None, str | None]:
    """(the Python whose environment has runai-model-streamer, None), made there first where it is
    missing, or (None, why) when that fails."""
    python = Path(path)
    if not python.exists():
        venv = python.parent.parent
        tqdm.write(f"runai: creating {venv}")
        made = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                              capture_output=True, text=True)
        if made.returncode:
            return None, f"could not create {venv}: {made.stderr.strip()[-300:]}"
        # --system-site-packages reaches the interpreter .venv was made from, not .venv: this file
        # puts .venv's site-packages (torch, boto3, numpy, ferry) on the new environment's path.
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True)
        if site.returncode:
            return None, f"{python} does not run: {site.stderr.strip()[-300:]}"
        Path(site.stdout.strip(), "ferry-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if _runai_importable(python):
        return python, None
    tqdm.write(f"runai: installing {' '.join(RUNAI_PACKAGES)} into {python.parent.parent}")
    # --no-deps: their one heavy requirement, torch, is .venv's and must not be fetched again.
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *RUNAI_PACKAGES],
                               capture_output=True, text=True)
    if installed.returncode:
        return None, f"pip install {' '.join(RUNAI_PACKAGES)} failed: {installed.stderr.strip()[-300:]}"
    if not _runai_importable(python):
        check = subprocess.run([str(python), "-c", "import runai_model_streamer"], capture_output=True, text=True)
        return None, f"runai_model_streamer does not import: {check.stderr.strip()[-300:]}"
    return python, None


def _runai_importable(python: Path) -> bool:
    check = subprocess.run([str(python), "-c", "import runai_model_streamer, runai_model_streamer_s3"],
                           capture_output=True)
    return check.returncode == 0


def runai_env(endpoint_url: str) -> dict[str, str]:
    """What runai's S3 client (the AWS CRT through the C++ SDK, and boto3 for its listing) needs
    to reach moto. RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS: the CRT drops a connection that carries
    under 1 byte/s for this long (runai's 1 s, at least 3 s in the CRT), and moto reads the whole
    object for every ranged GET before it sends a byte, so at runai's defaults (8 GETs at once, on 2
    cores) every read failed (AWS_ERROR_HTTP_CHANNEL_THROUGHPUT_FAILURE, then "File access error")."""
    return {"AWS_ENDPOINT_URL": endpoint_url, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "us-east-1",
            "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "60000", "RUNAI_STREAMER_LOG_TO_STDERR": "1"}


def run_reader(python: Path, reader: Reader, env: dict[str, str]) -> tuple[dict | None, str]:
    """One run of `reader` in a fresh process: (its JSON, its stderr), or (None, why it failed)."""
    try:
        done = subprocess.run([str(python), "-m", "bench.s3_read", reader.script, BUCKET, PREFIX], cwd=REPO,
                              env={**os.environ, **env, **reader.env}, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"no result after {RUN_TIMEOUT_S} s"
    if done.returncode:
        return None, f"exit code {done.returncode}: {failure(done.stderr)}"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def failure(stderr: str) -> str:
    """The lines of a failed reader's stderr that say why: its first two ERROR lines (runai's
    own log, colour codes removed) and the exception it ended with."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in stderr.strip().splitlines()]
    errors = [line for line in lines if "[ERROR" in line][:2]
    return " | ".join([*errors, lines[-1]] if lines else errors)[:1500]


class RangedGets(logging.Filter):
    """Counts the ranged GETs moto answered (werkzeug's request lines with status 206) and drops
    every request line: on moto each one costs a read of the whole object."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if '" 206 ' in record.getMessage():
            self.count += 1
        return False


def upload(weights: Path) -> None:
    """Every file of the checkpoint to s3://BUCKET/PREFIX/ (the config too: Ferry's listing needs it)."""
    from ferry.worker.common.objectstore import s3_client

    client = s3_client(max_connections=16)
    for path in weights.iterdir():
        if path.name == "source.json":  # the node cache's own record of the conversion, not the model's
            continue
        client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")


def usable_readers(args: argparse.Namespace) -> tuple[list[Reader], dict[bool, Path], dict[str, str]]:
    """(the readers that can run, the Python for each kind: runai or not, why the others cannot)."""
    python = {False: Path(sys.executable)}
    if args.no_runai:
        return [r for r in READERS if not r.runai], python, {r.name: "--no-runai" for r in READERS if r.runai}
    python[True], why = runai_python(args.runai_python)
    if why:
        return [r for r in READERS if not r.runai], python, {r.name: why for r in READERS if r.runai}
    return list(READERS), python, {}


def measure(args: argparse.Namespace, weights: Path, expected: dict[str, list]) -> Measured:
    """Every usable reader `--runs` times against one moto server, taking turns (the order
    rotates each run). A runai reader whose run fails is left out with the reason; a Ferry one
    failing, or any reader returning other tensors than `expected`, fails the whole run."""
    readers, python, left_out = usable_readers(args)
    out = Measured({r.name: [] for r in readers}, left_out, {})
    gets = RangedGets()
    with moto_s3(BUCKET) as moto, tqdm(total=args.runs * len(readers), desc="s3 readers", unit="read") as bar:
        upload(weights)
        server_log = logging.getLogger("werkzeug")
        server_log.setLevel(logging.INFO)
        server_log.addFilter(gets)
        for run in range(args.runs):
            for reader in readers[run % len(readers):] + readers[:run % len(readers)]:
                bar.set_postfix_str(reader.name)
                bar.update()
                if reader.name in out.left_out:
                    continue
                env = {**moto.env, **(runai_env(moto.endpoint_url) if reader.runai else {})}
                before = gets.count
                result, log = run_reader(python[reader.runai], reader, env)
                if result is None and not reader.runai:
                    raise RuntimeError(f"{reader.name} failed: {log}")
                if result is None:
                    out.left_out[reader.name] = f"the read failed: {log}"
                    out.runs[reader.name] = []  # no figure from a reader that failed a run
                    out.runai_log.pop(reader.name, None)
                    continue
                if reader.name != CEILING:
                    check_tensors(reader.name, expected, result["tensors"])
                out.runs[reader.name].append(Run(result["seconds"], gets.count - before, result["phases"]))
                if reader.runai and reader.name not in out.runai_log:
                    out.runai_log[reader.name] = [line for line in log.splitlines() if RUNAI_LOG in line]
        server_log.removeFilter(gets)
    return out


def main(argv: list[str] | None = None) -> int:
    from ferry.worker.models.bundled import SMOLLM2_SERVED_NAME
    from ferry.worker.models.loader import resolve_model_path
    from ferry.worker.models.sources.s3 import PARALLEL_GETS, RANGE_BYTES

    args = _parse(argv)
    load_before = os.getloadavg()
    weights = resolve_model_path(SMOLLM2_SERVED_NAME, REPO / ".ferry" / "models")
    work = Path(tempfile.mkdtemp(prefix="ferry-s3-readers-"))
    try:
        if args.weights_dtype == "bfloat16":
            weights = bfloat16_copy(weights, work / "weights-bf16")
        files = sorted(p for p in weights.iterdir() if p.suffix == ".safetensors")
        model_bytes = sum(p.stat().st_size for p in files)
        expected = reference_digests(files)
        measured = measure(args, weights, expected)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = {
        "model": f"SmolLM2-135M-Instruct ({args.weights_dtype} safetensors)",
        "model_bytes": model_bytes,
        "tensors": len(expected),
        "readers": summarize(measured, model_bytes),
        "left_out": measured.left_out,
        "runai_log": measured.runai_log,
        "reader_env": {r.name: r.env for r in READERS},
        "runai_env": {k: v for k, v in runai_env("").items() if k != "AWS_ENDPOINT_URL"},
        "settings": {"runs": args.runs, "weights_dtype": args.weights_dtype, "runai_packages": list(RUNAI_PACKAGES),
                     "ferry_parallel_gets": PARALLEL_GETS, "ferry_range_bytes": RANGE_BYTES},
        "conditions": {"load_average_start": load_before, "load_average_end": os.getloadavg()},
    }
    path = write_result("s3_readers", payload, args.results_dir)
    print(table(payload))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def table(payload: dict) -> str:
    """The printed summary: one line per reader, then the readers left out and why."""
    lines = [f"{payload['model']}, {payload['model_bytes'] / 1e6:.0f} MB, {payload['tensors']} tensors",
             f"{'reader':<18} {'seconds':>8} {'MB/s':>8} {'vs raw-get':>11} {'vs ferry-boto3':>15} {'GETs/run':>9}"]
    for name, r in payload["readers"].items():
        ratios = [f"{x:.2f}x" if x is not None else "-" for x in (r["vs_raw_get"], r["vs_ferry_boto3"])]
        phases = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in r["phases_s"].items())
        lines.append(f"{name:<18} {r['seconds']:>8.2f} {r['bytes_per_s'] / 1e6:>8.1f} {ratios[0]:>11} {ratios[1]:>15} "
                     f"{r['ranged_gets']:>9.0f}" + (f"  ({phases})" if phases else ""))
    lines += [f"{name:<18} left out: {' '.join(why.split())[:300]}" for name, why in payload["left_out"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
