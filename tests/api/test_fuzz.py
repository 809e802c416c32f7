"""Fuzz every operation of the OpenAPI schema (valid and invalid inputs) against the running stack
with schemathesis: no 5xx, and every response matches the schema (status, content type, body).

The CLI runs in a subprocess (its pytest plugin fails on pytest 9: `Function._nodeid`); the run is
bounded by its examples per operation (the deterministic coverage phase is left out: ~1000 cases).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.conftest import KEY_A

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_no_server_errors_and_responses_match_the_schema(stack, tmp_path):
    cli = Path(sys.executable).with_name("schemathesis")
    done = subprocess.run(
        [str(cli), "run", stack.url + "/openapi.json",
         "--header", f"Authorization: Bearer {KEY_A}",
         "--checks", CHECKS, "--mode", "all", "--phases", "fuzzing",
         "--max-examples", "15", "--seed", "1", "--workers", "1", "--request-timeout", "60",
         "--generation-database", "none", "--suppress-health-check", "all", "--no-color",
         "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=220, cwd=tmp_path,
    )
    (tmp_path / "schemathesis.out").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"see {tmp_path / 'schemathesis.out'}\n" + done.stdout[-8000:] + done.stderr[-2000:]
