#!/usr/bin/env bash
# Writes the real-text corpora that Keel's tests, demo, examples and benchmarks read, from
# Debian packages, into corpora/ inside the repository (git ignores it). Each corpus is UTF-8 in
# BERT's pretraining layout: one sentence (verse, line) per line, one blank line between
# documents.
#
#   corpora/en-kjv/kjv.txt            King James Bible (bible-kjv): a verse a line, a chapter a document
#   corpora/en-fortunes/fortunes.txt  English fortune quotations (fortunes, fortunes-min): one a document
#   corpora/zh-poetry/poetry.txt      Tang and Song poems and Chinese sayings (fortunes-zh): one a document
#
# Installs the packages when they are missing (through scripts/setup.sh, sudo when not root).
# Each file is written once (to a temporary name, then renamed), so a second call does nothing;
# `--force` writes them again. Prints the folder it wrote to.
#
# Usage: scripts/corpora.sh [--force] [en-kjv] [en-fortunes] [zh-poetry]   (default: all three)
set -euo pipefail
export LC_ALL=C   # byte-wise sed and awk: the same corpora whatever the locale
cd "$(dirname "$0")/.."
out="$(pwd)/corpora"
force=0
wanted=()
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    en-kjv|en-fortunes|zh-poetry) wanted+=("$arg") ;;
    *) echo "corpora: unknown argument '$arg' (expected --force, en-kjv, en-fortunes or zh-poetry)" >&2; exit 2 ;;
  esac
done
[ ${#wanted[@]} -gt 0 ] || wanted=(en-kjv en-fortunes zh-poetry)

# need FILE: whether FILE's corpus was asked for and must be (re)written.
need() {
  local name
  name=$(basename "$(dirname "$1")")
  [[ " ${wanted[*]} " == *" $name "* ]] || return 1
  [ "$force" = 1 ] || [ ! -s "$1" ]
}

missing=()
need "$out/en-kjv/kjv.txt" && missing+=(bible-kjv)
need "$out/en-fortunes/fortunes.txt" && missing+=(fortunes fortunes-min)
need "$out/zh-poetry/poetry.txt" && missing+=(fortunes-zh)
if [ ${#missing[@]} -gt 0 ]; then
  scripts/setup.sh "${missing[@]}"
fi

# write FILE: stdin to FILE through a temporary name, so a reader never sees half a corpus.
write() {
  mkdir -p "$(dirname "$1")"
  cat > "$1.tmp.$$"
  [ -s "$1.tmp.$$" ] || { echo "corpora: wrote nothing for $1" >&2; rm -f "$1.tmp.$$"; exit 1; }
  mv -f "$1.tmp.$$" "$1"
  echo "corpora: wrote $1 ($(wc -c < "$1") bytes)"
}

# fortune files (%-separated) to documents: ANSI colour codes and trailing blanks dropped, blank
# lines inside a fortune dropped (a blank line is the document separator), empty fortunes skipped.
# A file's end ends its last fortune too: some files lack the closing `%`, and their last
# fortune was once glued to the next file's first.
fortunes_to_documents() {
  local f
  for f in "$@"; do sed -e 's/\x1b\[[0-9;]*m//g' "$f"; echo "%"; done | awk '
    function flush() { if (n > 0) { if (docs++) print ""; for (i = 1; i <= n; i++) print buf[i] } n = 0 }
    { sub(/[ \t\r]+$/, "") }
    /^%$/ { flush(); next }
    /^$/ { next }
    { buf[++n] = $0 }
    END { flush() }'
}

fdir=/usr/share/games/fortunes
if need "$out/en-kjv/kjv.txt"; then
  # `bible -f` prints "Ge1:1 In the beginning ...": the reference is dropped, a new chapter
  # starts a new document.
  bible -f "Ge1:1-Re22:21" | awk '{
      ref = $1; chapter = ref; sub(/:.*/, "", chapter);
      if (NR > 1 && chapter != last) print "";
      last = chapter; sub(/^[^ ]+ /, ""); print }' | write "$out/en-kjv/kjv.txt"
fi
if need "$out/en-fortunes/fortunes.txt"; then
  files=$( (dpkg -L fortunes fortunes-min) | grep -E "^$fdir/[a-z0-9-]+\$" | sort -u)
  # shellcheck disable=SC2086
  fortunes_to_documents $files | write "$out/en-fortunes/fortunes.txt"
fi
if need "$out/zh-poetry/poetry.txt"; then
  # The poems first (Tang, then Song), then the sayings: a prefix of the corpus is poetry.
  fortunes_to_documents "$fdir/tang300" "$fdir/song100" "$fdir/chinese" | write "$out/zh-poetry/poetry.txt"
fi
