"""The README's results table, made from the latest JSON each suite wrote to bench/results/.

    python -m bench.report            # print the table
    python -m bench.report --write    # also replace README.md's section between the results markers

Every row is Ferry against the baseline measured in the same run, with the factor written so
that above 1 means Ferry is better (higher throughput, or lower latency); the machine each
suite ran on is named under the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common import RESULTS_DIR, ferry_beside

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PLOTS_DIR = REPO / "bench" / "plots"
START, END = "<!-- results:start -->", "<!-- results:end -->"
QUANTIZED_SUITES = ("quantized", "quantized_avx2", "quantized_q4_k_m", "quantized_q4_k_m_avx2", "quantized_q5_k_m",
                    "quantized_q6_k")
SUITE_NAMES = ("throughput", "prefix", "queue", "api", "specdec", "kernels", "linear_cpu", "cold_start", "s3_readers",
               *QUANTIZED_SUITES, "redis_capacity", "model_families", "model_families_int8", "lora", "lora_fleet",
               "window_kv")


@dataclass
class Row:
    suite: str
    metric: str  # what was measured, with its unit
    ferry: float | None
    baseline: float | None
    baseline_name: str
    higher_is_better: bool

    @property
    def factor(self) -> float | None:
        if not self.ferry or not self.baseline:
            return None
        return self.ferry / self.baseline if self.higher_is_better else self.baseline / self.ferry


def latest_path(suite: str, results_dir: Path = RESULTS_DIR) -> Path | None:
    """`<suite>-latest.json` (kept by `ferry bench`), else the suite's newest JSON file."""
    latest = results_dir / f"{suite}-latest.json"
    if latest.is_file():
        return latest
    candidates = sorted(results_dir.glob(f"{suite}*.json"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def latest_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict]:
    """Suite name -> its latest JSON, for the suites that have one."""
    found = {}
    for suite in SUITE_NAMES:
        path = latest_path(suite, results_dir)
        if path is not None:
            try:
                found[suite] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                print(f"bench.report: skipping {path}: {exc}", file=sys.stderr)
    return found


def _get(data: dict, *keys, default=None):
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def throughput_rows(data: dict) -> list[Row]:
    by_system = {r["system"]: r for r in data.get("results", []) if "system" in r}
    ferry = by_system.get("ferry")
    if ferry is None:
        return []
    n = _get(data, "workload", "n")
    # Ferry runs before and after each baseline where the run recorded them (in run order, one
    # more than the baselines); each baseline is set against the mean of the two beside it.
    ferry_runs = data.get("ferry_runs_tokens_per_s") or []
    baselines = [name for name in by_system if name != "ferry"]
    rows = []
    bracketed = len(ferry_runs) == len(baselines) + 1
    for i, name in enumerate(baselines):
        ferry_rate = ferry_beside(ferry_runs, i) if bracketed else ferry.get("tokens_per_s")
        rows.append(
            Row(
                "throughput", f"output tok/s, {n} requests", ferry_rate, by_system[name].get("tokens_per_s"), name, True
            )
        )
    return rows


def prefix_rows(data: dict) -> list[Row]:
    shared, cold, restore = (
        data.get("shared_prefix", {}),
        data.get("cold_start", {}),
        data.get("restore_vs_recompute", {}),
    )
    system = _get(data, "settings", "system_tokens")
    rows = [
        Row(
            "prefix",
            f"TTFT p50 (s), {system}-token shared prefix",
            _get(shared, "on", "p50_s"),
            _get(shared, "off", "p50_s"),
            "prefix cache off",
            False,
        ),
        Row(
            "prefix",
            "first TTFT (s) of a fresh worker",
            _get(cold, "restored", "first_ttft_s"),
            _get(cold, "cold", "first_ttft_s"),
            "no snapshot",
            False,
        ),
        Row(
            "prefix",
            f"{restore.get('tokens')} tokens of KV back (s)",
            restore.get("restore_s"),
            restore.get("recompute_s"),
            "recompute",
            False,
        ),
    ]
    return [r for r in rows if r.ferry is not None]


def queue_rows(data: dict) -> list[Row]:
    label = f"{data.get('jobs')} jobs"
    rows = [
        Row(
            "queue",
            f"output tok/s, {label}",
            _get(data, "queue", "tokens_per_s"),
            _get(data, "direct", "tokens_per_s"),
            "in-process engine",
            True,
        ),
        Row(
            "queue",
            f"TTFT p50 (ms), {label}",
            _queue_ttft(data),
            _get(data, "direct", "ttft_p50_ms"),
            "in-process engine",
            False,
        ),
        Row("queue", "TTFT p50 (ms), one job at a time", *_single_job_ttfts(data), "in-process engine", False),
    ]
    return [r for r in rows if r.ferry is not None]


def _queue_ttft(data: dict) -> float | None:
    """The queue path's TTFT p50: the direct one plus the median of per-run-pair differences
    where the suite measured them (robust to drift between runs), else the median run's own."""
    direct, paired = _get(data, "direct", "ttft_p50_ms"), data.get("added_ttft_paired_p50_ms")
    if direct is not None and paired is not None:
        return direct + paired
    return _get(data, "queue", "ttft_p50_ms")


def _single_job_ttfts(data: dict) -> tuple[float | None, float | None]:
    """(queue, direct) medians of the jobs sent one at a time: the hop itself, no batch to wait for."""
    singles = data.get("single_job_ttft_ms") or []
    if not singles:
        return None, None
    return statistics.median(s["queue"] for s in singles), statistics.median(s["direct"] for s in singles)


def specdec_rows(data: dict) -> list[Row]:
    rows = []
    for workload, batches in (data.get("results") or {}).items():
        for batch, systems in batches.items():
            base = systems.get("baseline", {}).get("tokens_per_s")
            for name, r in systems.items():
                if name != "baseline" and "tokens_per_s" in r:
                    metric = f"output tok/s, {name} speculation, {workload}, {batch.replace('batch', 'batch ')}"
                    rows.append(Row("specdec", metric, r["tokens_per_s"], base, "no speculation", True))
    return rows


def linear_cpu_rows(data: dict) -> list[Row]:
    """A decode batch, a large decode batch and a prefill chunk: the packed product against BLAS."""
    by_rows = {r["rows"]: r for r in data.get("results") or []}
    return [
        Row("linear_cpu", f"GFLOP/s, {rows}-row products, SmolLM2-135M layers", r["packed_gflops"], r["torch_gflops"],
            "torch F.linear", True)
        for rows, r in sorted(by_rows.items()) if rows in (1, 16, 64, 512)
    ]


def quantized_rows(data: dict) -> list[Row]:
    """Ferry on a GGUF's quantized blocks against llama.cpp one request at a time, and against its
    own float32 engine on the same file; labelled with the file's type (and the AVX2 kernels where
    those ran)."""
    results = data.get("results") or {}
    big = f"batch{_get(data, 'settings', 'batch')}"
    model = str(_get(data, "settings", "model") or "")
    kind = model.removesuffix(".gguf").rsplit(".", 1)[-1] if model.count(".") >= 2 else "Q4_1"
    kernel = str(data.get("kernel", ""))  # "int16 activations (AVX512_VNNI)", "... (AVX2)", or before: "float32 ..."
    kind += " GGUF" + (" (AVX2 kernels)" if kernel.startswith("float32") or kernel.endswith("(AVX2)") else "")
    gguf, fp32 = results.get("ferry-gguf", {}), results.get("ferry-fp32", {})
    llama = _get(results, "llama.cpp", "batch1", "tokens_per_s")
    # Which llama.cpp build ran (bench.quantized --llama-cpp-isa; older results: its native build).
    isa = _get(data, "llama_cpp_build", "isa")
    llama_cpp = "llama.cpp" + (f" ({isa.upper()} build)" if isa and isa != "native" else "")
    rows = [
        Row("quantized", f"output tok/s, {kind}, batch 1", _get(gguf, "batch1", "tokens_per_s"), llama,
            f"{llama_cpp}, one request", True),
        Row("quantized", f"output tok/s, {kind}, {big.replace('batch', 'batch ')}",
            _get(gguf, big, "tokens_per_s"), llama, f"{llama_cpp}, one request at a time", True),
        Row("quantized", f"output tok/s, {kind} kept quantized, batch 1", _get(gguf, "batch1", "tokens_per_s"),
            _get(fp32, "batch1", "tokens_per_s"), "Ferry float32 (dequantized)", True),
        Row("quantized", f"output tok/s, {kind} kept quantized, {big.replace('batch', 'batch ')}",
            _get(gguf, big, "tokens_per_s"), _get(fp32, big, "tokens_per_s"), "Ferry float32 (dequantized)", True),
        Row("quantized", f"resident weights (MB), {kind}", gguf.get("weight_mb"), fp32.get("weight_mb"),
            "Ferry float32 (dequantized)", False),
    ]
    return [r for r in rows if r.ferry is not None and r.baseline is not None]


def api_rows(data: dict) -> list[Row]:
    label = f"{data.get('clients')} streams"
    rows = [
        Row(
            "api",
            f"TTFT p50 (ms), {label}",
            _get(data, "client", "ttft_ms", "p50"),
            _get(data, "worker", "ttft_ms", "p50"),
            "worker's own (no HTTP)",
            False,
        ),
        Row(
            "api",
            f"time between tokens p50 (ms), {label}",
            _get(data, "client", "tpot_ms", "p50"),
            _get(data, "worker", "tbt_ms", "p50"),
            "worker's own (no HTTP)",
            False,
        ),
    ]
    return [r for r in rows if r.ferry is not None]


def _factor_leaves(data, path: str = "") -> list[tuple[str, float]]:
    """Every number whose key names a speedup or ratio, with its dotted path."""
    if isinstance(data, dict):
        return [leaf for k, v in data.items() for leaf in _factor_leaves(v, f"{path}.{k}" if path else str(k))]
    name = path.rsplit(".", 1)[-1].lower()
    if isinstance(data, int | float) and not isinstance(data, bool) and ("speedup" in name or "ratio" in name):
        return [(path, float(data))]
    return []


def generic_rows(suite: str, data: dict) -> list[Row]:
    """For suites without their own reader: each speedup or ratio the JSON reports, as a factor."""
    return [Row(suite, path, value, 1.0, "baseline", True) for path, value in _factor_leaves(data)]


def cold_start_rows(data: dict) -> list[Row]:
    """Weights from S3 on an empty node against weights on local disk, and a snapshot's first
    token against none (bench.cold_start); or, from --conversion, a start that finds the GGUF
    converted against the first start that converts it."""
    if "first_start_s" in data:
        return [Row("cold_start", "worker start to ready (s), GGUF already converted", data.get("later_start_s_p50"),
                    data.get("first_start_s"), "first start (converts)", False)]
    by = {(s["source"], s["snapshot"]): s for s in data.get("starts", [])}
    s3, local, s3_snap = by.get(("s3", False), {}), by.get(("local", False), {}), by.get(("s3", True), {})

    def after_ready(start: dict) -> float | None:
        return start["first_token_s"] - start["ready_s"] if start.get("first_token_s") else None

    return [Row("cold_start", "start to ready (s), weights from S3, empty node cache", s3.get("ready_s"),
                local.get("ready_s"), "weights on local disk", False),
            Row("cold_start", "ready to first token (s), 961-token prompt, snapshot restored", after_ready(s3_snap),
                after_ready(s3), "no snapshot", False)]


def s3_readers_rows(data: dict) -> list[Row]:
    """The worker's S3 reader (ferry-stream: tensors read as their bytes arrive; ferry-boto3 in
    results from before it) against each runai-model-streamer setting, at 64 MiB GETs against
    Ferry's reader with 64 MiB ranges where both ran: seconds from the first S3 call to every
    tensor in memory, in one run on one S3 server (bench.s3_readers)."""
    readers = data.get("readers") or {}
    size = f"{(data.get('model_bytes') or 0) / 1e6:.0f} MB"
    rows = []
    for name, r in readers.items():
        suffix = "-64mib" if name.endswith("-64mib") else ""
        ferry = next((f + suffix for f in ("ferry-stream", "ferry-boto3") if f + suffix in readers), None)
        if ferry is None:
            ferry = next((f for f in ("ferry-stream", "ferry-boto3") if f in readers), None)
        if name.startswith("runai") and ferry in readers:
            rows.append(Row("s3_readers", f"S3 to tensors in memory (s), {size} of safetensors, {ferry}",
                            readers[ferry]["seconds"], r.get("seconds"), f"runai-model-streamer ({name})", False))
    return rows


def model_families_rows(data: dict) -> list[Row]:
    """Ferry against transformers `generate` per model family, at batch 1 and the big batch."""
    rows = []
    layers = _get(data, "settings", "layers")
    int8 = _get(data, "settings", "quantization") == "int8"
    suite = "model_families_int8" if int8 else "model_families"
    ferry = ", Ferry int8 (Q8_0 blocks)" if int8 else ""
    for family, result in (data.get("results") or {}).items():
        for key, figures in result.items():
            if not key.startswith("batch") or not isinstance(figures, dict):
                continue
            rows.append(Row(suite, f"output tok/s, {family} ({layers} layers){ferry}, batch {key[5:]}",
                            figures.get("ferry_tokens_per_s"), figures.get("transformers_tokens_per_s"),
                            "transformers generate (float32, same values)" if int8 else "transformers generate", True))
    return [r for r in rows if r.ferry is not None and r.baseline is not None]


def lora_rows(data: dict) -> list[Row]:
    """A batch spread over adapters against the same batch on the base model alone."""
    throughput = _get(data, "results", "throughput") or {}
    systems = throughput.get("systems") or {}
    base = _get(systems, "base", "tokens_per_s")
    rows = [Row("lora", f"output tok/s, batch {throughput.get('requests')} over {throughput.get('adapters')} "
                f"adapters ({name})", _get(systems, name, "tokens_per_s"), base, "the base model alone", True)
            for name in systems if name != "base"]
    return [r for r in rows if r.ferry is not None and r.baseline is not None]


def lora_fleet_rows(data: dict) -> list[Row]:
    """Two workers with adapters split between them: jobs going to the adapter's holder against
    every worker serving what it reads."""
    modes = _get(data, "results", "modes") or {}
    on, off = modes.get("affinity") or {}, modes.get("no-affinity") or {}
    rows = [Row("lora_fleet", f"time to first token {p}, s (2 workers, adapters split)", _get(on, "ttft_s", p),
                _get(off, "ttft_s", p), "no affinity (FERRY_LORA_AFFINITY=false)", False) for p in ("p50", "p90")]
    rows.append(Row("lora_fleet", "adapter reads after start (2 workers, adapters split)",
                    on.get("adapter_reads_after_ready"), off.get("adapter_reads_after_ready"),
                    "no affinity (FERRY_LORA_AFFINITY=false)", False))
    return [r for r in rows if r.ferry is not None and r.baseline is not None]


def window_kv_rows(data: dict) -> list[Row]:
    """KV a sequence 4x past its sliding window holds, against one pool keeping every block."""
    rows = []
    for run in data.get("results") or []:
        shape = "every layer windowed" if run.get("family") == "mistral" else "full + windowed layers"
        rows.append(Row("window_kv", f"KV held (layer-blocks), {run.get('family')} ({shape}), "
                        f"{run.get('sequence_tokens')} tokens past a {run.get('window')}-token window",
                        run.get("kv_layer_blocks_held"), run.get("kv_layer_blocks_without_release"),
                        "every block kept", False))
    return [r for r in rows if r.ferry is not None and r.baseline is not None]


READERS = {
    "throughput": throughput_rows, "prefix": prefix_rows, "queue": queue_rows, "specdec": specdec_rows, "api": api_rows,
    "linear_cpu": linear_cpu_rows, "cold_start": cold_start_rows, "s3_readers": s3_readers_rows,
    "model_families": model_families_rows, "model_families_int8": model_families_rows,
    "lora": lora_rows, "lora_fleet": lora_fleet_rows, "window_kv": window_kv_rows,
    **{suite: quantized_rows for suite in QUANTIZED_SUITES},
}


def rows_for(suite: str, data: dict) -> list[Row]:
    reader = READERS.get(suite)
    return reader(data) if reader else generic_rows(suite, data)


def machine_label(data: dict) -> str:
    """A short description of where a result was measured, from whichever fields the suite wrote."""
    m = {**(data.get("env") or {}), **(data.get("machine") or {})}
    parts = [
        m.get("gpu") or m.get("device_name") or m.get("cpu") or m.get("machine") or m.get("platform"),
        f"{m.get('cores') or m.get('cpus')} cores" if (m.get("cores") or m.get("cpus")) else None,
        f"torch threads {m.get('torch_threads') or m.get('threads')}"
        if (m.get("torch_threads") or m.get("threads"))
        else None,
        f"torch {m['torch']}" if m.get("torch") else None,
        f"commit {m['commit']}" if m.get("commit") else None,
        data.get("created") or data.get("time"),
    ]
    model = (data.get("model") or _get(data, "workload", "model") or _get(data, "models", "name")
             or _get(data, "models", "target"))
    quick = data.get("quick") or _get(data, "settings", "quick")
    weights = _get(data, "models", "weights")
    parts += [
        f"model {str(model).removeprefix(str(REPO) + '/')}" if model else None,
        f"{weights} weights" if weights else None,
        "quick run" if quick else None,
    ]
    return ", ".join(str(p) for p in parts if p)


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def table(results: dict[str, dict]) -> str:
    lines = [
        "| suite | measure | Ferry | baseline | value | Ferry vs baseline |",
        "|---|---|---:|---|---:|---:|",
    ]
    for suite, data in results.items():
        for r in rows_for(suite, data):
            factor = f"**{r.factor:.2f}×**" if r.factor is not None else "–"
            base = "–" if r.baseline_name == "baseline" else _fmt(r.baseline)
            ferry = _fmt(r.ferry) if r.baseline_name != "baseline" else "–"
            lines.append(f"| {suite} | {r.metric} | {ferry} | {r.baseline_name} | {base} | {factor} |")
    lines.append("")
    lines.append("Each row sets Ferry (or the Ferry feature the suite measures) against the baseline run beside it; "
                 "above 1× means Ferry is better (more tokens/s, or less time). Measured on:")
    lines.append("")
    lines += [f"- {suite}: {machine_label(data)}" for suite, data in results.items()]
    return "\n".join(lines)


def plot_links(plots_dir: Path = PLOTS_DIR, base: Path = REPO) -> str:
    """The committed figures as README links, the throughput chart shown inline."""
    paths = sorted(plots_dir.glob("*.png"))
    if not paths:
        return ""
    links = " · ".join(f"[{p.stem}]({p.relative_to(base).as_posix()})" for p in paths)
    inline = next((f"![throughput]({p.relative_to(base).as_posix()})\n\n" for p in paths if p.stem == "throughput"), "")
    return (f"{inline}Plots (`ferry bench --plots-only` redraws them): {links}. "
            "How to read them: [bench/README.md](bench/README.md).")


def write_readme(section: str, readme: Path = README) -> None:
    """Replace what lies between the markers (appending a Results section with them if absent)."""
    text = readme.read_text()
    block = f"{START}\n{section}\n{END}"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Results\n\n" + block + "\n"
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite README.md's results section")
    args = parser.parse_args(argv)
    results = latest_results()
    if not results:
        print("bench.report: no results in bench/results/ yet; run `ferry bench --suite throughput`", file=sys.stderr)
        return 1
    section = "\n\n".join(part for part in (table(results), plot_links()) if part)
    print(section)
    if args.write:
        write_readme(section)
        print(f"wrote {README.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
