"""The docs, the README, the benches, the deploy files and the source speak of the product
only: not of how it was made (issue numbers, work sessions, tools, people, paths outside
the repository). Measured figures with their commands stay; the context of a
measurement is said as what ran on the machine ("measured while other test suites ran").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What is read: every text file under these (generated stubs and results left out).
SCANNED = ["README.md", "Dockerfile", "Makefile", ".ci", "docs", "bench", "deploy", "scripts",
           "proto", "service", "client/hookserve"]
SUFFIXES = {".md", ".py", ".proto", ".txt", ".yml", ".yaml", ".toml", ".sh", ".cfg", ".ini",
            ".json", ""}
SKIPPED_PARTS = {"v1", "results", "wheels", "__pycache__", "img"}

#: name -> pattern of words about how the project was made. Case-insensitive.
PATTERNS = {
    "issue number": r"\bissues? ?#?\d+",
    "people": r"\bengineers?\b|\bcolleagues?\b",
    "work sessions": r"\b(?:other|helper|work|parallel|agent|coding)(?:'s)? sessions?\b"
                     r"|\bsessions? (?:were|was) running\b",
    "tools": r"\bdevice tool\b|\blent (?:no|a|an|the) (?:GPU|machine|device)\b"
             r"|\bcan_start_another\b",
    "the work itself": r"\bthis task\b|\bthe brief\b|\bsub-?agents?\b"
                       r"|\b(?:claude|chatgpt|llm|coding agent|ai agent)\b",
    "paths outside the repository": r"(?<![\w.])/work/|\.\./shared\b|\bmachine\.md\b"
                                    r"|\bBRIEF\.md\b|\bworktrees?\b",
}
RULES = {name: re.compile(p, re.IGNORECASE) for name, p in PATTERNS.items()}

#: (path relative to the repository, pattern name, the line's text it may contain):
#: legitimate uses, each allowed explicitly. Empty today.
ALLOWED: set[tuple[str, str, str]] = set()


def _files() -> list[Path]:
    out = []
    for entry in SCANNED:
        path = ROOT / entry
        paths = [path] if path.is_file() else sorted(path.rglob("*"))
        for p in paths:
            rel = p.relative_to(ROOT)
            if (p.is_file() and p.suffix in SUFFIXES and not SKIPPED_PARTS & set(rel.parts)
                    and not p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))):
                out.append(p)
    return out


def _hits(text: str, rel: str) -> list[str]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for name, rule in RULES.items():
            m = rule.search(line)
            if m and not any(a == (rel, name, a[2]) and a[2] in line for a in ALLOWED):
                hits.append(f"{rel}:{n}: {name} ({m.group(0)!r}): {line.strip()}")
    return hits


def test_docs_and_code_speak_of_the_product_only():
    files = _files()
    assert len(files) > 50 and any(f.name == "README.md" for f in files)
    hits = [h for f in files
            for h in _hits(f.read_text(encoding="utf-8", errors="replace"),
                           str(f.relative_to(ROOT)))]
    assert not hits, "words about how the project was made:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [
    "Issue 15's GPU figures", "(issue 14)", "issues 12 and 13", "issue #7",
    "while six other engineers ran test suites", "other sessions were running test suites",
    "the device tool lent no GPU to this task", "(`can_start_another: false`)",
    "as ../shared/docs/machine.md describes", "see /work/main/README.md",
    "a helper session measured it",
])
def test_each_kind_of_word_is_caught(line):
    assert _hits(line, "x.md"), line


@pytest.mark.parametrize("line", [
    "hands the request stream to a `Session` (`Session.run_one`)",
    "its session is freed", "a client session", "every session goes",
    "the engine's threads (sessions, futures, the drain)", "Shared helpers: `bench/common.py`",
    "tools you already run", "hookserve serve --model resnet50", "WORKDIR /app",
    "see docs/performance.md", "commit `007c49a`", "measured while other test suites ran",
])
def test_the_product_s_own_words_pass(line):
    assert not _hits(line, "x.md"), line
