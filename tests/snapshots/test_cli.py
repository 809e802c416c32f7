"""`ferry snapshot save|load|inspect` against a file:// store."""

from __future__ import annotations

import json

from ferry.worker.cli import main as ferry


def test_save_inspect_load(llama_dir, tmp_path, capsys):
    url = (tmp_path / "snaps").as_uri()
    engine = [
        "--model",
        str(llama_dir),
        "--block-size",
        "4",
        "--kv-cache-bytes",
        str(64 * 2048),
        "--max-model-len",
        "128",
    ]
    system = "You are Ferry's helpful assistant. Answer briefly and cite the docs."
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    assert ferry(["snapshot", "save", url, *engine, "--system", system, "--prompt-file", str(prompt_file)]) == 0
    saved = capsys.readouterr().out
    assert saved.startswith("saved ") and " blocks, " in saved

    assert ferry(["snapshot", "inspect", url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["blocks"] > 4 and summary["chains"] == 2 and summary["tokens"] == summary["blocks"] * 4
    assert summary["model"]["block_size"] == 4 and len(summary["kept"]) == 1 and summary["age_s"] < 600

    assert ferry(["snapshot", "inspect", url]) == 0
    text = capsys.readouterr().out
    assert summary["fingerprint"] in text and f"{summary['blocks']} in 2 chains" in text

    assert ferry(["snapshot", "load", url, *engine]) == 0
    assert f"{summary['blocks']} blocks" in capsys.readouterr().out


def test_errors_are_one_line_and_an_exit_code(llama_dir, tmp_path, capsys):
    url = (tmp_path / "empty").as_uri()
    assert ferry(["snapshot", "inspect", url]) == 1
    assert "latest.json not found" in capsys.readouterr().err
    assert ferry(["snapshot", "load", url, "--model", str(llama_dir), "--max-model-len", "128"]) == 1
    assert ferry(["snapshot", "inspect", "ftp://nowhere/x"]) == 2
    assert "unsupported store URL" in capsys.readouterr().err
