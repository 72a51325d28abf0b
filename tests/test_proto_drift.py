"""The checked-in stubs in client/hookserve/v1 must be what `make proto` generates."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_gen():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stubs_match_proto(tmp_path):
    _load_gen().generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    checked_in = ROOT / "client"
    assert fresh, "protoc generated nothing"
    for rel in fresh:
        mine = checked_in / rel
        assert mine.exists(), f"{rel} is generated but not checked in: run `make proto`"
        assert mine.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} differs from proto/: run `make proto` and commit the result")


def test_every_message_and_field_is_commented():
    text = (ROOT / "proto" / "hookserve" / "v1" / "hookserve.proto").read_text().splitlines()
    for i, line in enumerate(text):
        s = line.strip()
        is_decl = (s.startswith(("message ", "enum ", "rpc ", "service "))
                   or (s.endswith(";") and "=" in s and not s.startswith(("option", "//"))))
        if is_decl and not s.startswith("syntax") and not s.startswith("package"):
            prev = text[i - 1].strip()
            assert prev.startswith("//"), f"line {i + 1} has no comment above it: {s}"
