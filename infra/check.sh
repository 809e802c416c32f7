#!/usr/bin/env bash
# Static security checks of terraform/ and infra/ with checkov (infra/checkov.yaml lists the
# skips and why). checkov lives in its own virtualenv, .venv-tools/, created on first use.
#   bash infra/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

tools=.venv-tools
want=$(grep -E '^checkov==' infra/requirements-tools.txt)
if ! "$tools/bin/pip" freeze 2>/dev/null | grep -qx "$want"; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install --quiet -r infra/requirements-tools.txt
fi

# No calls home: skip the policy-metadata download and the version check.
export BC_SKIP_MAPPING=TRUE CHECKOV_SKIP_VERSION_CHECK=1 ANSI_COLORS_DISABLED=1
"$tools/bin/checkov" --config-file infra/checkov.yaml
