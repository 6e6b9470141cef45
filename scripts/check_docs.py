#!/usr/bin/env python3
"""The documentation checks behind scripts/check-docs.sh (Python 3, standard library only).

Usage: scripts/check_docs.py BIN_DIR

1. Every relative link and image in README.md, CHANGELOG.md and docs/*.md points at a file or
   folder of the repository, and every `#anchor` at a heading of the target Markdown file (GitHub's
   slugs).
2. Every command line those files show for `keel`, `keel-coordinator` or `keel-worker` (in code
   blocks and inline code) names a subcommand that program's `--help` lists, and only flags that
   the `--help` of that program (and subcommand) lists. Rows of a Markdown table whose first cell
   names a program have the flags of their second cell checked against it.
3. No tracked file mentions an issue number (the word "issue" followed by a number, or a hash
   sign followed by one; a reference into another repository, owner/repo then a hash sign and a
   number, is a citation and allowed), the design notes that are not in the repository, or a
   folder beside it.

Exits 1 naming every problem.
"""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = ("keel", "keel-coordinator", "keel-worker")
problems = []


def problem(where, text):
    problems.append("%s: %s" % (where, text))


def doc_files():
    files = ["README.md", "CHANGELOG.md"]
    docs = os.path.join(REPO, "docs")
    files += sorted("docs/" + f for f in os.listdir(docs) if f.endswith(".md"))
    return [f for f in files if os.path.exists(os.path.join(REPO, f))]


# --- Markdown: code regions, headings, slugs ------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")


def split_code(text):
    """(prose lines with inline code, [code block lines]) as (line number, text) lists."""
    prose, code, in_fence = [], [], False
    for n, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        (code if in_fence else prose).append((n, line))
    return prose, code


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"`", "", s)
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    with open(path, encoding="utf-8") as f:
        prose, _ = split_code(f.read())
    seen, out = {}, set()
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else "%s-%d" % (base, k))
    for _, line in prose:  # explicit HTML anchors
        for a in re.findall(r'<a\s+(?:name|id)="([^"]+)"', line):
            out.add(a)
    return out


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def strip_inline_code(line):
    return re.sub(r"`[^`]*`", "", line)


def check_links(doc):
    path = os.path.join(REPO, doc)
    with open(path, encoding="utf-8") as f:
        prose, _ = split_code(f.read())
    base = os.path.dirname(path)
    for n, line in prose:
        for target in LINK.findall(strip_inline_code(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(base, file_part)) if file_part else path
            where = "%s:%d" % (doc, n)
            if not dest.startswith(REPO + os.sep) and dest != REPO:
                problem(where, "link %s leaves the repository" % target)
                continue
            if not os.path.exists(dest):
                problem(where, "broken link %s (no %s)" % (target, os.path.relpath(dest, REPO)))
                continue
            if anchor and dest.endswith(".md"):
                if anchor not in anchors(dest):
                    problem(where, "broken anchor %s (no such heading in %s)" % (target, os.path.relpath(dest, REPO)))


# --- commands and flags against --help ----------------------------------------------------

help_cache = {}


def help_text(bin_dir, argv):
    key = tuple(argv)
    if key not in help_cache:
        exe = os.path.join(bin_dir, argv[0])
        r = subprocess.run([exe] + argv[1:] + ["--help"], capture_output=True, text=True)
        help_cache[key] = r.stdout + r.stderr if r.returncode == 0 else None
    return help_cache[key]


def subcommands(text):
    subs, on = set(), False
    for line in text.split("\n"):
        if re.match(r"^Commands:", line):
            on = True
            continue
        if on:
            m = re.match(r"^  ([a-z][\w-]*)\s", line + " ")
            if m:
                subs.add(m.group(1))
            elif line.strip() and not line.startswith(" "):
                on = False
    return subs


def flags(text):
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)) | {"-h", "-V"}


def check_command(bin_dir, where, words):
    """words: a shell command's words, the first a Keel program."""
    prog = os.path.basename(words[0])
    top = help_text(bin_dir, [prog])
    if top is None:
        problem(where, "%s --help failed (is %s built?)" % (prog, os.path.join(bin_dir, prog)))
        return
    subs = subcommands(top)
    argv = [prog]
    rest = words[1:]
    if rest and not rest[0].startswith("-") and subs:
        word = rest[0]
        if word in subs:
            argv.append(word)
            rest = rest[1:]
        elif prog != "keel-worker" or re.match(r"^[a-z][a-z0-9-]*$", word):
            problem(where, "`%s %s`: %s has no subcommand %s (it has: %s)" % (prog, word, prog, word, ", ".join(sorted(subs))))
            return
    elif prog == "keel" and rest and rest[0].startswith("--") and rest[0] not in ("--help", "--version"):
        problem(where, "`keel %s`: keel takes a subcommand first" % rest[0])
        return
    text = help_text(bin_dir, argv)
    if text is None:
        problem(where, "`%s --help` failed" % " ".join(argv))
        return
    known = flags(text)
    for w in rest:
        for f in re.findall(r"^(--[a-z][a-z0-9-]*)", w):
            if f not in known:
                problem(where, "`%s` has no flag %s (see `%s --help`)" % (" ".join(argv), f, " ".join(argv)))


SHELL_SPLIT = re.compile(r"\s*(?:\|\||&&|[|;&()])\s*")


def commands_in(line):
    """The Keel command lines in one line of shell: lists of words."""
    out = []
    for part in SHELL_SPLIT.split(line):
        words = part.split()
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words and words[0] in ("sudo", "exec", "nice"):
            words = words[1:]
        if not words:
            continue
        first = words[0]
        name = os.path.basename(first.replace("$bin/", "").replace("${bin}/", ""))
        if len(words) > 1 and words[1].endswith(":"):
            continue  # what a program prints ("keel local: submitted job-1"), not a command
        if name in PROGRAMS and (first == name or "/" in first):
            cut = []
            for w in words:
                if w.startswith("#"):
                    break
                cut.append(w)
            out.append([name] + cut[1:])
    return out


def check_commands(bin_dir, doc):
    path = os.path.join(REPO, doc)
    with open(path, encoding="utf-8") as f:
        prose, code = split_code(f.read())
    # Code blocks: join backslash continuations.
    joined, buf, start = [], "", None
    for n, line in code:
        if start is None:
            start = n
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        joined.append((start, buf + line))
        buf, start = "", None
    for n, line in joined:
        for words in commands_in(line):
            check_command(bin_dir, "%s:%d" % (doc, n), words)
    # Inline code in prose.
    for n, line in prose:
        for span in re.findall(r"`([^`]+)`", line):
            for words in commands_in(span):
                check_command(bin_dir, "%s:%d" % (doc, n), words)
        # Table rows: | `program` [subcommand] | `--flag`, ... |
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if len(cells) >= 2:
            progs = re.findall(r"`(keel(?:-coordinator|-worker)?)(?: ([a-z][\w-]*))?`", cells[0])
            row_flags = re.findall(r"`(--[a-z][a-z0-9-]*)`", cells[1])
            if progs:
                check_commands.current = progs
            elif cells[0] and not set(cells[0]) <= set("-: "):
                check_commands.current = []
            current = getattr(check_commands, "current", [])
            if current and row_flags:
                known = set()
                for prog, sub in current:
                    text = help_text(bin_dir, [prog] + ([sub] if sub else []))
                    if text is None:
                        problem("%s:%d" % (doc, n), "`%s --help` failed" % " ".join([prog] + ([sub] if sub else [])))
                        continue
                    known |= flags(text)
                    # A row for a program with subcommands may document a flag common to them.
                    for s in subcommands(text) if not sub else ():
                        t = help_text(bin_dir, [prog, s])
                        if t:
                            known |= flags(t)
                for f in row_flags:
                    if f not in known:
                        problem("%s:%d" % (doc, n), "%s is not a flag of %s" % (f, ", ".join(" ".join(p for p in pr if p) for pr in current)))


# --- words that must not appear ------------------------------------------------------------

def tracked_files():
    """git's tracked files; outside a git checkout (CI's copy of the tree, .ci/run), every file but
    the build and corpus folders that git ignores."""
    r = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if r.returncode == 0 and r.stdout:
        return [f for f in r.stdout.split("\0") if f]
    skip = {".git", "target", "corpora", "demo-out", "bench-out", "node_modules", "__pycache__"}
    out = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith("target-")]
        out += [os.path.relpath(os.path.join(root, n), REPO) for n in names]
    return sorted(out)


def check_tracked_files():
    notes = "STACK" + ".md"
    beside = "../" + "shared"
    issue = re.compile(r"(?i)\bissues?\s+#?\d+|(?:^|[^\w/&#])#\d{1,5}\b")
    # Not issue numbers: the BERT paper's "Task #1", and `keel fill-mask`'s "[MASK] #1:" output.
    allowed_hash = re.compile(r"(?i)\btask #\d|\[mask\] #\d")
    for rel in tracked_files():
        if not rel or rel.endswith((".css", ".png", ".gz", ".jsonl")) or os.path.basename(rel) == "vocab.txt":
            continue
        if rel.startswith("fixtures/wordpiece/"):
            continue
        path = os.path.join(REPO, rel)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for n, line in enumerate(lines, 1):
            if notes in line:
                problem("%s:%d" % (rel, n), "mentions %s, which the repository does not have" % notes)
            if beside in line:
                problem("%s:%d" % (rel, n), "mentions %s, a folder a user's clone does not have" % beside)
            for m in issue.finditer(line):
                if allowed_hash.search(line[max(0, m.start() - 6):m.end()]):
                    continue
                problem("%s:%d" % (rel, n), "mentions an issue number (%s)" % m.group(0).strip())


def main():
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    bin_dir = os.path.abspath(sys.argv[1])
    docs = doc_files()
    for doc in docs:
        check_links(doc)
        check_commands(bin_dir, doc)
    check_tracked_files()
    for p in problems:
        print("check-docs: " + p)
    if problems:
        print("check-docs: %d problem(s)" % len(problems))
        return 1
    print("check-docs: %d docs: links, anchors, commands and flags hold; no tracked file names an issue" % len(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
