"""Every PNG that Ferry's benchmarks and training draw: one function per figure, matplotlib only here.

Each function takes the JSON a suite wrote (a dict, as loaded) or plain lists, draws one figure
and saves it; nothing here runs a benchmark.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training(histories, path: Path) -> Path:
    """Train loss (smoothed) and held-out loss per step, one colour per model."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for h, colour in zip(histories, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        window = 10
        smooth = [sum(h.train_loss[max(0, i - window + 1) : i + 1]) / len(h.train_loss[max(0, i - window + 1) : i + 1])
                  for i in range(len(h.train_loss))]
        ax.plot(h.steps, smooth, color=colour, alpha=0.6, label=f"{h.name} train ({h.num_params / 1e6:.2f}M params)")
        ax.plot(h.eval_steps, h.eval_loss, "o-", color=colour, markersize=3, label=f"{h.name} held out")
    ax.set_xlabel("step (8 × 256 tokens)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_ylim(top=min(9.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Ferry demo and draft models on the Python standard library")
    return _save(fig, path)


def _percentile_points(summary: dict, key: str) -> tuple[list[float], list[float]]:
    """(latencies in ms, cumulative share): an empirical CDF from a raw list of seconds when the
    suite kept one (`<key>_s`), else the p50/p90/p99 points it reported (`<key>_ms`)."""
    raw = summary.get(f"{key}_s")
    if isinstance(raw, list) and raw:
        xs = sorted(v * 1e3 for v in raw)
        return xs, [(i + 1) / len(xs) for i in range(len(xs))]
    points = sorted((int(p[1:]), v) for p, v in (summary.get(f"{key}_ms") or {}).items() if v is not None)
    return [v for _, v in points], [p / 100 for p, _ in points]


def plot_throughput(data: dict, out_dir: Path) -> list[Path]:
    """Tokens/s per system, TTFT/TBT CDFs and Ferry's KV memory, from bench.throughput's JSON."""
    results = [r for r in data.get("results", []) if "tokens_per_s" in r]
    if not results:
        return []
    workload = data.get("workload", {})
    # Requests decoded together: one, static batches of 8, or up to all of them (continuous batching).
    at_once = {"hf-single": "1", "hf-static8": "8"}
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [
        f"{r['system']}\n({at_once.get(r['system'], '≤' + str(workload.get('n', '?')))} at once)" for r in results
    ]
    bars = ax.bar(labels, [r["tokens_per_s"] for r in results],
                  color=["tab:green" if r["system"] == "ferry" else "tab:gray" for r in results])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput by batching strategy and concurrency\n{workload.get('n')} requests, "
                 f"model {Path(str(workload.get('model', '?'))).name}", fontsize=10)
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft", "time to first token"), (axes[1], "tbt", "time between tokens")):
        raw = all(isinstance(r.get(f"{key}_s"), list) for r in results)
        for r in results:
            xs, ys = _percentile_points(r, key)
            if xs:
                ax.plot(xs, ys, "-" if raw else "o-", drawstyle="steps-post" if raw else "default", label=r["system"],
                        color="tab:green" if r["system"] == "ferry" else None)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)")
        ax.set_ylabel("share of requests" if key == "ttft" else "share of token gaps")
        ax.set_title(f"{title}: CDF" + ("" if raw else " at p50 / p90 / p99"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "latency-cdf.png"))

    sweep = data.get("concurrency_sweep") or []
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        levels = [row["max_num_seqs"] for row in sweep]
        ax.plot(levels, [row["tokens_per_s"] for row in sweep], "o-", color="tab:green", label="ferry (max_num_seqs)")
        for r, at, color in (
            ("hf-single", 1, "tab:blue"),
            ("hf-static8", 8, "tab:orange"),
            ("hf-cb", workload.get("n"), "tab:red"),
        ):
            base = next((x for x in results if x["system"] == r), None)
            if base is not None and at:
                ax.plot([at], [base["tokens_per_s"]], "s", color=color, label=r)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests decoded at once")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput vs concurrency (same workload prefix at each level)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "throughput-vs-concurrency.png"))

    kv = next((r.get("kv") for r in results if r["system"] == "ferry" and r.get("kv")), None)
    if kv:
        fig, ax = plt.subplots(figsize=(6, 4))
        peak = kv["peak_allocated_tokens"]
        values = [kv["pool_tokens"], peak, peak * kv["used_over_allocated_mean"]]
        bars = ax.bar(["reserved pool", "peak allocated", "holding KV\n(peak × mean used share)"], values,
                      color=["tab:gray", "tab:blue", "tab:green"])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_yscale("log")
        ax.set_ylabel("token slots (log)")
        ax.set_title(f"Ferry KV cache: {kv['used_over_allocated_mean']:.1%} of allocated slots hold KV")
        paths.append(_save(fig, out_dir / "kv-memory.png"))
    return paths


def plot_prefix(data: dict, out_dir: Path) -> list[Path]:
    """Prefix cache on/off TTFT, snapshot cold start, restore vs recompute, from bench.prefix's JSON."""
    shared, cold, restore = data.get("shared_prefix"), data.get("cold_start"), data.get("restore_vs_recompute")
    if not shared:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    x = range(2)
    for offset, (mode, colour) in zip((-0.2, 0.2), (("on", "tab:green"), ("off", "tab:gray")), strict=True):
        bars = ax.bar([i + offset for i in x], [shared[mode]["p50_s"], shared[mode]["p99_s"]], width=0.4,
                      color=colour, label=f"prefix cache {mode}")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(list(x), ["p50", "p99"])
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"shared {data.get('settings', {}).get('system_tokens', '?')}-token prefix")
    ax.legend()
    if cold:
        ax = axes[1]
        for mode, colour in (("restored", "tab:green"), ("cold", "tab:gray")):
            ttft = cold[mode]["ttft_s"]
            ax.plot(
                range(1, len(ttft) + 1),
                ttft,
                "o-",
                color=colour,
                label="snapshot restored" if mode == "restored" else "no snapshot",
            )
        ax.set_xlabel("request # on a fresh engine")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("TTFT (s)")
        ax.set_title("cold start")
        ax.legend()
    if restore:
        ax = axes[2]
        bars = ax.bar(["restore snapshot", "recompute (prefill)"], [restore["restore_s"], restore["recompute_s"]],
                      color=["tab:green", "tab:gray"])
        ax.bar_label(bars, fmt="%.2f s")
        ax.set_title(f"{restore.get('tokens')} tokens of KV ({restore.get('gib', 0):.2f} GiB)")
    return [_save(fig, out_dir / "prefix.png")]


def plot_queue(data: dict, out_dir: Path) -> list[Path]:
    """The Redis path against the in-process engine, from bench.queue's JSON."""
    direct, queue = data.get("direct"), data.get("queue")
    if not (direct and queue):
        return []
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for offset, (name, r, colour) in zip(
        (-0.2, 0.2), (("in-process engine", direct, "tab:gray"), ("via Redis worker", queue, "tab:green")), strict=True
    ):
        bars = axes[0].bar(
            [offset, 1 + offset], [r["ttft_p50_ms"], r["ttft_p99_ms"]], width=0.4, color=colour, label=name
        )
        axes[0].bar_label(bars, fmt="%.0f")
    axes[0].set_xticks([0, 1], ["TTFT p50", "TTFT p99"])
    axes[0].set_ylabel("ms")
    axes[0].legend()
    bars = axes[1].bar(["in-process engine", "via Redis worker"], [direct["tokens_per_s"], queue["tokens_per_s"]],
                       color=["tab:gray", "tab:green"])
    axes[1].bar_label(bars, fmt="%.0f")
    axes[1].set_ylabel("output tokens / s")
    fig.suptitle(f"{data.get('jobs')} concurrent jobs")
    return [_save(fig, out_dir / "queue.png")]


def plot_batch(data: dict, out_dir: Path) -> list[Path]:
    """A batch against the same requests as individual jobs (and while live requests come), and
    live TTFT p50 and p90 with and without it (bench.batch)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels, walls = ["individual jobs", "one batch"], [data["jobs_wall_s"], data["batch_wall_s"]]
    if data.get("batch_with_live_wall_s"):  # older results have no such figure
        labels.append("one batch,\nlive requests coming")
        walls.append(data["batch_with_live_wall_s"])
    bars = axes[0].bar(labels, walls, color=["tab:gray", "tab:green", "tab:olive"][: len(walls)])
    axes[0].bar_label(bars, fmt="%.1f")
    axes[0].set_ylabel(f"wall s for {data['lines']} requests")
    for i, (phase, color) in enumerate((("ttft_idle", "tab:gray"), ("ttft_with_batch", "tab:orange"))):
        xs = [j + (i - 0.5) * 0.4 for j in range(2)]
        values = [data[phase].get(q) or 0 for q in ("p50", "p90")]
        bars = axes[1].bar(xs, values, width=0.4, color=color,
                           label="no batch" if phase == "ttft_idle" else "batch running")
        axes[1].bar_label(bars, fmt="%.0f")
    axes[1].set_xticks(range(2), ["p50", "p90"])
    axes[1].set_ylabel("live TTFT, ms")
    axes[1].legend()
    fig.suptitle(f"Batch API, {data['max_tokens']} tokens per line")
    return [_save(fig, out_dir / "batch.png")]


def plot_specdec(data: dict, out_dir: Path) -> list[Path]:
    """Speculative decoding's speedup over no speculation, per workload, batch and proposer."""
    cases = [(f"{workload}\n{batch.replace('batch', 'batch ')}", systems)
             for workload, batches in (data.get("results") or {}).items() for batch, systems in batches.items()]
    proposers = sorted({name for _, systems in cases for name in systems if name != "baseline"})
    if not cases or not proposers:
        return []
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(proposers)
    for i, name in enumerate(proposers):
        xs = [j + (i - (len(proposers) - 1) / 2) * width for j in range(len(cases))]
        bars = ax.bar(xs, [systems.get(name, {}).get("speedup", 0) for _, systems in cases], width=width, label=name)
        ax.bar_label(bars, fmt="%.2f×", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), [label for label, _ in cases])
    ax.set_ylabel("speedup over no speculation (×)")
    weights = (data.get("models") or {}).get("weights")
    ax.set_title("speculative decoding, greedy" + (f" ({weights} weights)" if weights else ""))
    ax.legend(title="proposer")
    return [_save(fig, out_dir / "specdec.png")]


def plot_linear_cpu(data: dict, out_dir: Path) -> list[Path]:
    """GFLOP/s of the packed CPU product and of torch's F.linear against the rows of x."""
    results = sorted(data.get("results") or [], key=lambda r: r["rows"])
    if not results:
        return []
    rows = [r["rows"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rows, [r["packed_gflops"] for r in results], "o-", color="tab:green", label="Ferry packed weights")
    ax.plot(rows, [r["torch_gflops"] for r in results], "o-", color="tab:gray", label="torch F.linear (BLAS)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.set_xlabel("rows of x (decode batch or prefill chunk)")
    ax.set_ylabel("GFLOP/s")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("float32 projections of 30 SmolLM2-135M layers, weights from memory")
    return [_save(fig, out_dir / "linear_cpu.png")]


def plot_lora(data: dict, out_dir: Path) -> list[Path]:
    """Output tokens/s of a batch spread over LoRA adapters beside the base model alone (left) and
    the time to first token of a request whose adapter comes from S3 (right)."""
    results = data.get("results") or {}
    systems = (results.get("throughput") or {}).get("systems") or {}
    cold = (results.get("cold") or {}).get("ttft_median_s") or {}
    if not systems:
        return []
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(systems)
    left.bar(names, [systems[n]["tokens_per_s"] for n in names],
             color=["tab:gray" if n == "base" else "tab:green" for n in names])
    for i, n in enumerate(names):
        left.annotate(f"{systems[n]['over_base']:.2f}x", (i, systems[n]["tokens_per_s"]), ha="center", va="bottom")
    left.set_ylabel("output tokens/s")
    left.set_title("batch over 8 adapters vs the base model")
    if cold:
        labels = {"cold_adapter_s": "adapter from S3\n(never seen)", "warm_adapter_s": "same adapter\nagain",
                  "base_s": "base model"}
        keys = [k for k in labels if k in cold]
        right.bar([labels[k] for k in keys], [cold[k] * 1e3 for k in keys], color="tab:blue")
        right.set_ylabel("time to first token, ms")
        right.set_title("a request's first token")
    else:
        right.axis("off")
    fig.suptitle(f"multi-LoRA, {_get_model(data)}")
    return [_save(fig, out_dir / "lora.png")]


def plot_lora_fleet(data: dict, out_dir: Path) -> list[Path]:
    """Two workers, adapters split between them: time to first token (left) and adapter reads
    after start (right), jobs sent to the adapter's holder against every worker serving what it reads."""
    modes = (data.get("results") or {}).get("modes") or {}
    if not modes:
        return []
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(modes)
    points = ("p50", "p90", "max")
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ttft = modes[name]["ttft_s"]
        left.bar([j + i * width for j in range(len(points))], [ttft[p] * 1e3 for p in points], width, label=name)
    left.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(points))], list(points))
    left.set_ylabel("time to first token, ms")
    left.legend()
    left.set_title("jobs' first token")
    right.bar(names, [modes[n]["adapter_reads_after_ready"] for n in names], color=[f"C{i}" for i in range(len(names))])
    right.set_ylabel("adapter reads after start")
    right.set_title(f"{data.get('settings', {}).get('jobs')} jobs over {data.get('settings', {}).get('adapters')} "
                    "adapters")
    fig.suptitle(f"LoRA affinity, 2 workers, {_get_model(data)}")
    return [_save(fig, out_dir / "lora_fleet.png")]


def plot_quantized(data: dict, out_dir: Path, suite: str = "quantized") -> list[Path]:
    """Output tokens/s per system and batch (left) and resident weight MB per system (right); one
    figure per file type and kernel (`suite`: quantized, quantized_q4_k_m, quantized_q4_k_m_avx2, ...)."""
    results = data.get("results") or {}
    if not results:
        return []
    systems = list(results)
    workloads = sorted({w for r in results.values() for w in r if w.startswith("batch")}, key=lambda w: int(w[5:]))
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(workloads))]
        rates = [results[system].get(w, {}).get("tokens_per_s", 0) for w in workloads]
        labels = [f"{r:.0f}" if r else "not run" for r in rates]  # llama.cpp decodes one request at a time
        ax.bar_label(ax.bar(xs, rates, width=width, label=system), labels=labels, fontsize=8)
    ax.set_xticks(range(len(workloads)), [w.replace("batch", "batch ") for w in workloads])
    ax.set_ylabel("output tokens/s (greedy)")
    ax.legend()
    kernel = " (AVX2 kernels)" if str(data.get("kernel", "")).startswith("float32") else ""
    ax.set_title(f"{_get_model(data)}{kernel}: tokens/s")
    mem.bar_label(mem.bar(systems, [results[s].get("weight_mb", 0) for s in systems], color="tab:gray"), fmt="%.0f")
    mem.set_ylabel("resident weights (MB)")
    mem.set_title("weights in memory")
    return [_save(fig, out_dir / f"{suite}.png")]


def plot_structured(data: dict, out_dir: Path) -> list[Path]:
    """Tokens/s with and without a JSON schema per batch (left), mask time per step (right), bench.structured."""
    runs = data.get("runs") or []
    batches = sorted({r["batch"] for r in runs})
    if not batches:
        return []

    def run(batch: int, system: str) -> dict:
        return next((r for r in runs if r["batch"] == batch and r["system"] == system), {})

    fig, (ax, mask) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    for i, (system, colour) in enumerate((("plain", "tab:gray"), ("schema", "tab:blue"))):
        xs = [j + (i - 0.5) * 0.4 for j in range(len(batches))]
        rates = [run(b, system).get("tok_s") or 0 for b in batches]
        labels = [f"{r:.0f}" if system == "plain" else f"{r:.0f} ({run(b, system).get('slowdown', 0):.0%} slower)"
                  for b, r in zip(batches, rates, strict=True)]
        ax.bar_label(ax.bar(xs, rates, width=0.4, color=colour, label="no grammar" if system == "plain"
                            else "JSON schema"), labels=labels, fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("output tokens/s (greedy)")
    ax.set_title(f"{data.get('model', 'model')}: tokens/s".replace(" (bundled GGUF)", ""))
    ax.legend()
    for i, (pct, colour) in enumerate((("p50", "tab:blue"), ("p90", "tab:purple"))):
        xs = [j + (i - 0.5) * 0.4 for j in range(len(batches))]
        values = [(run(b, "schema").get("mask_ms") or {}).get(pct) or 0 for b in batches]
        mask.bar_label(mask.bar(xs, values, width=0.4, color=colour, label=pct), fmt="%.2f", fontsize=8)
    mask.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    mask.set_ylabel("grammar masks per step, ms")
    mask.set_title("mask fill + apply")
    mask.legend()
    return [_save(fig, out_dir / "structured.png")]


def plot_redis_capacity(data: dict, out_dir: Path) -> list[Path]:
    """Redis shards a fleet needs, from bench.redis_capacity's JSON."""
    sizing = data.get("sizing") or {}
    fleets = sizing.get("fleets")
    if not fleets:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar([str(f["gpus"]) for f in fleets], [f["shards"] for f in fleets], color="tab:red")
    ax.bar_label(bars, fmt="%d")
    ax.set_xlabel("GPU workers")
    ax.set_ylabel("Redis shards (primaries)")
    ax.set_title(f"{sizing['gpu_tokens_per_s']:.0f} tok/s per GPU, {sizing['headroom']:.0%} of a node per shard")
    return [_save(fig, out_dir / "redis_capacity.png")]


def plot_s3_readers(data: dict, out_dir: Path) -> list[Path]:
    """MB/s from S3 to tensors in memory per reader (bench.s3_readers), raw-get (no tensors) the
    ceiling; each bar labelled with its seconds and the ranged GETs the server answered."""
    readers = data.get("readers") or {}
    if not readers:
        return []
    names = list(readers)
    colours = ["tab:gray" if n == "raw-get" else "tab:green" if n.startswith("ferry") else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(11, 4))
    bars = ax.bar(names, [readers[n]["bytes_per_s"] / 1e6 for n in names], color=colours)
    ax.bar_label(bars, labels=[f"{readers[n]['seconds']:.2f} s, {readers[n].get('ranged_gets', 0):.0f} GETs"
                               for n in names])
    ax.margins(y=0.12)  # room for the tallest bar's label
    ax.set_ylabel("MB/s, first S3 call to tensors in memory")
    ax.set_title(f"S3 readers on moto, {data.get('model', 'model')}", fontsize=10)
    return [_save(fig, out_dir / "s3_readers.png")]


def plot_window_kv(data: dict, out_dir: Path) -> list[Path]:
    """KV a sequence holds as it grows past its sliding window (bench.window_kv): per run, the
    blocks of one layer held at each step, against one pool that keeps every block of every layer."""
    runs = [r for r in data.get("results") or [] if r.get("series_tokens_and_layer_blocks")]
    if not runs:
        return []
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.6), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        tokens, held = zip(*run["series_tokens_and_layer_blocks"], strict=True)
        block, layers = run["block_size"], run["layers"]
        ax.plot(tokens, held, color="tab:green", label="Ferry")
        ax.plot(tokens, [-(-t // block) * layers for t in tokens], color="tab:gray", linestyle="--",
                label="every block kept")
        ax.axvline(run["window"], color="black", linewidth=0.6)
        shape = "every layer windowed" if run["family"] == "mistral" else (
            f"{run['full_layers']} full + {run['window_layers']} windowed layers")
        ax.set_title(f"{run['family']} ({shape}), window {run['window']}", fontsize=9)
        ax.set_xlabel("tokens in the sequence")
        ax.set_ylabel(f"KV held (blocks of {block} tokens x layer)")
        ax.legend(fontsize=8)
    return [_save(fig, out_dir / "window_kv.png")]


def _get_model(data: dict) -> str:
    return (data.get("settings") or {}).get("model", "model")


def plot_factors(suite: str, rows, out_dir: Path) -> list[Path]:
    """Any suite's factors (bench.report rows: > 1 means Ferry is better) as horizontal bars."""
    rows = [r for r in rows if r.factor is not None]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(10, max(2.5, 1.0 + 0.45 * len(rows))))
    bars = ax.barh([r.metric for r in rows], [r.factor for r in rows],
                   color=["tab:green" if r.factor >= 1 else "tab:red" for r in rows])
    ax.bar_label(bars, fmt="%.2f×")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("Ferry vs baseline (×, > 1 is better)")
    ax.set_title(f"{suite}: speedup" if suite == "specdec" else suite)
    return [_save(fig, out_dir / f"{suite}.png")]


def render_all(results: dict[str, dict], out_dir: Path) -> list[Path]:
    """Every figure the given suite results (name -> JSON) support; returns the files written."""
    from bench.report import QUANTIZED_SUITES, rows_for

    drawers = {
        "throughput": plot_throughput, "prefix": plot_prefix, "queue": plot_queue, "specdec": plot_specdec,
        "batch": plot_batch, "linear_cpu": plot_linear_cpu, "quantized": plot_quantized,
        "redis_capacity": plot_redis_capacity, "structured": plot_structured, "lora": plot_lora,
        "lora_fleet": plot_lora_fleet, "s3_readers": plot_s3_readers, "window_kv": plot_window_kv,
    }
    paths = []
    for suite, data in results.items():
        if suite in QUANTIZED_SUITES:
            paths += plot_quantized(data, out_dir, suite)
            continue
        drawer = drawers.get(suite)
        paths += drawer(data, out_dir) if drawer else plot_factors(suite, rows_for(suite, data), out_dir)
    return paths
