#!/usr/bin/env bash
# The documentation checks (run by scripts/test.sh):
# - every relative link and anchor in README.md, CHANGELOG.md and docs/*.md resolves;
# - every `keel`, `keel-coordinator` and `keel-worker` subcommand and flag the docs show exists in
#   that program's --help (the binaries of BIN_DIR);
# - no tracked file mentions an issue number, notes the repository does not have, or a folder
#   beside the repository;
# - docs/performance.md's tables equal what scripts/docs_tables.py makes of docs/measured/.
#
# Usage: scripts/check-docs.sh [BIN_DIR]   (default: $CARGO_TARGET_DIR/release, else target/release)
# Needs python3 (standard library only). Exits 1 naming every problem.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
bin_dir=${1:-${CARGO_TARGET_DIR:-target}/release}
for p in keel keel-coordinator keel-worker; do
  if [ ! -x "$bin_dir/$p" ]; then
    echo "check-docs: $bin_dir/$p is missing: build with cargo build --release --bins" >&2
    exit 1
  fi
done
status=0
python3 scripts/check_docs.py "$bin_dir" || status=1
python3 scripts/docs_tables.py --check || status=1
exit $status
