#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Exit status is pytest's; "no tests ran" is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
