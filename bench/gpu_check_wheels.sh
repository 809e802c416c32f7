#!/usr/bin/env bash
# Downloads, as CPython 3.12 x86-64 wheels into .whl/, the modules Ferry's engine imports that the
# GPU machines' image lacks (bench/gpu_check.py's environment step names them), at the versions of
# this checkout's .venv, and builds Ferry's own wheel (the `ferry` namespace) beside them. The device
# run then installs them with --no-index (README, "One-shot GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(gguf xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py
          pydantic pydantic-core annotated-types typing-inspection redis)
PIP=.venv/bin/pip
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
for name in "${PACKAGES[@]}"; do
  version=$($PIP show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  spec=$name${version:+==$version}
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec" 2>&1 | grep -v '^WARNING: Location' || true
done
rm -f .whl/ferry-*.whl
$PIP wheel -q --no-deps --no-build-isolation -w .whl . 2>&1 | grep -v '^WARNING: Location' || true
ls .whl
du -sh .whl
