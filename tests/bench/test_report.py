"""bench.report and bench.plots on results in the shapes the suites write."""

from __future__ import annotations

import json
import os

import pytest

from bench import report

THROUGHPUT = {
    "suite": "throughput",
    "created": "20260101-000000",
    "machine": {"cpu": "AMD EPYC", "cores": 2, "torch_threads": 1, "torch": "2.13.0+cpu", "commit": "abc1234"},
    "workload": {"n": 8, "model": "m"},
    "results": [
        {"system": "ferry", "tokens_per_s": 90.0, "ttft_ms": {"p50": 500, "p90": 900, "p99": 1200},
         "tbt_ms": {"p50": 80, "p90": 120, "p99": 300},
         "kv": {"used_over_allocated_mean": 0.9, "peak_allocated_tokens": 3000, "pool_tokens": 20000}},
        {"system": "hf-static8", "tokens_per_s": 45.0, "ttft_ms": {"p50": 700, "p90": 900, "p99": 1000},
         "tbt_ms": {"p50": 90, "p90": 100, "p99": 130}},
    ],
    "concurrency_sweep": [
        {"max_num_seqs": 1, "tokens_per_s": 20.0},
        {"max_num_seqs": 4, "tokens_per_s": 55.0},
        {"max_num_seqs": 8, "tokens_per_s": 90.0},
    ],
}
PREFIX = {
    "benchmark": "prefix",
    "settings": {"system_tokens": 1024},
    "env": {"torch": "2.13.0+cpu", "threads": 1, "machine": "x86_64"},
    "shared_prefix": {"on": {"p50_s": 2.0, "p99_s": 3.0}, "off": {"p50_s": 8.0, "p99_s": 9.0}},
    "cold_start": {
        "restored": {"first_ttft_s": 0.5, "ttft_s": [0.5, 0.6]},
        "cold": {"first_ttft_s": 5.0, "ttft_s": [5.0, 0.6]},
    },
    "restore_vs_recompute": {"tokens": 1152, "gib": 0.05, "restore_s": 0.5, "recompute_s": 10.0},
}
SPECDEC = {
    "machine": {"cpu": "x"},
    "results": {"complete": {"batch1": {
        "baseline": {"tokens_per_s": 50.0},
        "ngram": {"tokens_per_s": 60.0, "speedup": 1.2},
        "draft": {"tokens_per_s": 40.0, "speedup": 0.8},
    }}},
}
LINEAR_CPU = {
    "machine": {"cpu": "x"},
    "results": [{"rows": r, "torch_gflops": 50.0, "packed_gflops": g, "speedup": g / 50.0} for r, g in
                ((1, 10.0), (4, 40.0), (16, 100.0), (64, 125.0), (512, 50.0))],
}
KERNELS = {"machine": {"gpu": "H100"}, "decode": {"bandwidth_ratio": 0.8, "acceptance_rate": 0.7}, "note": "text"}


def test_throughput_sets_each_baseline_against_the_ferry_runs_beside_it():
    data = json.loads(json.dumps(THROUGHPUT))
    data["results"].append({"system": "hf-single", "tokens_per_s": 10.0})
    data["ferry_runs_tokens_per_s"] = [80.0, 100.0, 60.0]  # ferry, hf-static8, ferry, hf-single, ferry
    rows = report.rows_for("throughput", data)
    assert [(r.baseline_name, r.ferry, round(r.factor, 2)) for r in rows] == [
        ("hf-static8", 90.0, 2.0),
        ("hf-single", 80.0, 8.0),
    ]


def test_rows_are_factors_above_one_when_ferry_is_better():
    rows = report.rows_for("throughput", THROUGHPUT) + report.rows_for("prefix", PREFIX)
    assert [(r.baseline_name, round(r.factor, 2)) for r in rows] == [
        ("hf-static8", 2.0), ("prefix cache off", 4.0), ("no snapshot", 10.0), ("recompute", 20.0),
    ]


def test_specdec_rows_set_each_proposer_against_no_speculation():
    rows = report.rows_for("specdec", SPECDEC)
    assert [(r.metric, r.factor) for r in rows] == [
        ("output tok/s, ngram speculation, complete, batch 1", 1.2),
        ("output tok/s, draft speculation, complete, batch 1", 0.8),
    ]


def test_suites_without_a_reader_show_their_speedups_and_ratios():
    rows = report.rows_for("kernels", KERNELS)
    assert [(r.metric, r.factor) for r in rows] == [("decode.bandwidth_ratio", 0.8)]


def test_table_names_the_machine_of_every_suite():
    text = report.table({"throughput": THROUGHPUT, "prefix": PREFIX})
    assert "| throughput | output tok/s, 8 requests | 90 | hf-static8 | 45 | **2.00×** |" in text
    assert "- throughput: AMD EPYC, 2 cores, torch threads 1, torch 2.13.0+cpu, commit abc1234" in text
    assert "- prefix: x86_64, torch threads 1, torch 2.13.0+cpu" in text


def test_write_readme_replaces_only_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nintro\n{report.START}\nold table\n{report.END}\n\n## After\nkept\n")
    report.write_readme("new table", readme)
    assert readme.read_text() == f"# Title\n\nintro\n{report.START}\nnew table\n{report.END}\n\n## After\nkept\n"
    bare = tmp_path / "BARE.md"
    bare.write_text("# Bare\n")
    report.write_readme("t", bare)
    assert bare.read_text() == f"# Bare\n\n## Results\n\n{report.START}\nt\n{report.END}\n"


def test_latest_prefers_the_latest_file_then_the_newest(tmp_path):
    for name, mtime in (("prefix-quick.json", 100), ("prefix.json", 200)):
        (tmp_path / name).write_text(json.dumps(PREFIX))
        os.utime(tmp_path / name, (mtime, mtime))
    assert report.latest_path("prefix", tmp_path).name == "prefix.json"
    (tmp_path / "prefix-latest.json").write_text("{}")
    os.utime(tmp_path / "prefix-latest.json", (50, 50))
    assert report.latest_path("prefix", tmp_path).name == "prefix-latest.json"
    assert report.latest_path("queue", tmp_path) is None


def test_linear_cpu_rows_are_packed_over_blas_at_the_chosen_row_counts():
    rows = report.rows_for("linear_cpu", LINEAR_CPU)
    assert [(r.metric.split(",")[1].strip(), r.factor) for r in rows] == [
        ("1-row products", 0.2), ("16-row products", 2.0), ("64-row products", 2.5), ("512-row products", 1.0),
    ]


def test_render_all_draws_each_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plots import render_all

    paths = render_all(
        {"throughput": THROUGHPUT, "prefix": PREFIX, "specdec": SPECDEC, "kernels": KERNELS, "linear_cpu": LINEAR_CPU},
        tmp_path,
    )
    assert sorted(p.name for p in paths) == [
        "kernels.png", "kv-memory.png", "latency-cdf.png", "linear_cpu.png", "prefix.png", "specdec.png",
        "throughput-vs-concurrency.png", "throughput.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_queue_rows_include_single_jobs_against_the_engine():
    data = {
        "jobs": 32,
        "queue": {"tokens_per_s": 95.0},
        "direct": {"tokens_per_s": 100.0, "ttft_p50_ms": 1000.0},
        "added_ttft_paired_p50_ms": 12.0,
        "single_job_ttft_ms": [
            {"direct": 40.0, "queue": 44.0},
            {"direct": 42.0, "queue": 47.0},
            {"direct": 50.0, "queue": 52.0},
        ],
    }
    rows = {row.metric: row for row in report.queue_rows(data)}
    assert rows["TTFT p50 (ms), 32 jobs"].ferry == 1012.0
    single = rows["TTFT p50 (ms), one job at a time"]
    assert (single.ferry, single.baseline) == (47.0, 42.0)
    assert single.factor == 42.0 / 47.0  # less time is better: baseline / Ferry


def test_model_families_rows_set_ferry_against_transformers_per_family_and_batch():
    data = {
        "machine": {"cpu": "x"},
        "settings": {"layers": 12, "batch": 32},
        "results": {
            "llama": {"model": "llama-12l-random", "parameters_m": 100.0,
                      "batch1": {"ferry_tokens_per_s": 60.0, "transformers_tokens_per_s": 30.0},
                      "batch32": {"ferry_tokens_per_s": 600.0, "transformers_tokens_per_s": 200.0}},
            "mixtral": {"batch1": {"ferry_tokens_per_s": 40.0, "transformers_tokens_per_s": None}},
        },
        "goal": {"family": "mixtral", "ratio": 6.0, "met": True},
    }
    rows = report.rows_for("model_families", data)
    assert [(r.metric, r.baseline_name, r.factor) for r in rows] == [
        ("output tok/s, llama (12 layers), batch 1", "transformers generate", 2.0),
        ("output tok/s, llama (12 layers), batch 32", "transformers generate", 3.0),
    ]
    assert "model_families" in report.SUITE_NAMES


def test_quantized_rows_name_the_llama_cpp_build_that_ran():
    data = {
        "settings": {"batch": 32, "model": "SmolLM2-135M-Instruct.Q4_K_M.gguf"},
        "kernel": "int16 activations (AVX2)",
        "results": {"ferry-gguf": {"weight_mb": 104.0, "batch1": {"tokens_per_s": 150.0},
                                   "batch32": {"tokens_per_s": 450.0}},
                    "ferry-fp32": {"weight_mb": 538.0, "batch1": {"tokens_per_s": 50.0},
                                   "batch32": {"tokens_per_s": 400.0}},
                    "llama.cpp": {"batch1": {"tokens_per_s": 75.0}}},
        "llama_cpp_build": {"isa": "avx2", "cmake_args": "-DGGML_NATIVE=OFF ..."},
    }
    rows = report.rows_for("quantized_q4_k_m_avx2", data)
    assert [(r.metric, r.baseline_name, r.factor) for r in rows[:2]] == [
        ("output tok/s, Q4_K_M GGUF (AVX2 kernels), batch 1", "llama.cpp (AVX2 build), one request", 2.0),
        ("output tok/s, Q4_K_M GGUF (AVX2 kernels), batch 32", "llama.cpp (AVX2 build), one request at a time", 6.0),
    ]
    del data["llama_cpp_build"]  # results written before the option: llama.cpp's native build
    assert report.rows_for("quantized_q4_k_m_avx2", data)[0].baseline_name == "llama.cpp, one request"


WINDOW_KV = {
    "machine": {"cpu": "x"},
    "results": [
        {"family": "mistral", "window": 64, "block_size": 16, "sequence_tokens": 272, "layers": 2,
         "kv_layer_blocks_held": 10, "kv_layer_blocks_without_release": 34,
         "series_tokens_and_layer_blocks": [[16, 2], [80, 10], [271, 10]]},
        {"family": "gemma2", "window": 64, "block_size": 16, "sequence_tokens": 272, "layers": 4, "full_layers": 2,
         "window_layers": 2, "kv_layer_blocks_held": 44, "kv_layer_blocks_without_release": 68,
         "series_tokens_and_layer_blocks": [[16, 4], [80, 20], [271, 44]]},
    ],
}


def test_window_kv_rows_set_the_kv_held_against_every_block_kept_and_draw_the_growth(tmp_path):
    rows = report.rows_for("window_kv", WINDOW_KV)
    assert [(r.metric, r.baseline_name, round(r.factor, 2)) for r in rows] == [
        ("KV held (layer-blocks), mistral (every layer windowed), 272 tokens past a 64-token window",
         "every block kept", 3.4),
        ("KV held (layer-blocks), gemma2 (full + windowed layers), 272 tokens past a 64-token window",
         "every block kept", 1.55),
    ]
    assert "window_kv" in report.SUITE_NAMES
    pytest.importorskip("matplotlib")
    from bench.plots import render_all

    [path] = render_all({"window_kv": WINDOW_KV}, tmp_path)
    assert path.name == "window_kv.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
