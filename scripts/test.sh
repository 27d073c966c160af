#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Exit status is pytest's; "no tests ran" is a failure.
# The 25 slowest tests and the seconds spent in set-up and in pytest are printed, to size the lanes (DESIGN.md §5).
# Tests run in one pytest-xdist worker per core, at most 8 (CPATTN_TEST_WORKERS sets the count; 0 runs them in
# this process; a later -n in the arguments wins). Each worker is a process: tests share no state through it.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/setup.sh || exit 1
t1=$SECONDS
. .venv/bin/activate
workers=${CPATTN_TEST_WORKERS:-$(python -c "import os; print(min(8, len(os.sched_getaffinity(0))))")}
python -m pytest -q -p no:cacheprovider --durations=25 -n "$workers" --dist worksteal "$@"
rc=$?
echo "scripts/test.sh: set-up $((t1 - t0)) s, pytest $((SECONDS - t1)) s" >&2
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
