"""docs/architecture.md is the map of the code: every source file of both packages is
named there (as its path inside the package, in backticks), and every file it names
exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = (ROOT / "service" / "hookserve_server", ROOT / "client" / "hookserve")
#: generated stubs, named in the doc by their folder or their generator
GENERATED = re.compile(r"^v1/|_pb2(_grpc)?\.py$")


def sources(package: Path) -> list[str]:
    return sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                  if not GENERATED.search(p.relative_to(package).as_posix()))


def test_every_source_file_is_named_in_the_map():
    doc = DOC.read_text()
    missing = [f"{pkg.name}/{rel}" for pkg in PACKAGES for rel in sources(pkg)
               if f"`{rel}`" not in doc]
    assert not missing, ("source files docs/architecture.md does not name (add a row or a "
                         f"line for each): {missing}")


def test_every_file_the_map_names_exists():
    doc = DOC.read_text()
    named = set(re.findall(r"`([A-Za-z_][\w/]*\.py)`", doc))
    known = {rel for pkg in PACKAGES for rel in sources(pkg)}
    known |= {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
              if ".venv" not in p.parts}
    known |= {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    stale = sorted(n for n in named if n not in known
                   and not any(k.endswith("/" + n) for k in known))
    assert not stale, f"docs/architecture.md names files that do not exist: {stale}"
