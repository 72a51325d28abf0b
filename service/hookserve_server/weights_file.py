"""A weights file's contents, read without running code from it: ``.safetensors``
(by its name or its first bytes) with the ``safetensors`` package, anything else with
``torch.load(weights_only=True)``; a file that cannot be read so is refused in one line
that says what to do. A zip archive (what torch.save writes) is checked against its
own checksums first: torch.load does not, and a damaged file would be served."""

from __future__ import annotations

import argparse
import functools
import re
import warnings
import zipfile
from pathlib import Path

import torch

from .errors import ConfigError

#: How to write a file hookserve loads, ending every weights-file error.
SAVE_HINT = "save the weights alone with torch.save(model.state_dict(), PATH)"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Classes a checkpoint may hold beside its tensors that unpickle as plain data, no
#: code run: torchvision's reference training scripts save their argparse arguments.
SAFE_GLOBALS = [argparse.Namespace]
SAFETENSORS_SUFFIX = ".safetensors"
#: How a zip archive begins (torch.save's format): a file that does but is no readable
#: zip is one cut short.
ZIP_MAGIC = b"PK\x03\x04"


def read_file(path: Path) -> object:
    """What the weights file at `path` holds (a state_dict, or a checkpoint dict
    around one); ConfigError in one line."""
    if path.suffix.lower() == SAFETENSORS_SUFFIX and not _starts_as(path, ZIP_MAGIC) \
            or _looks_safetensors(path):
        return _read_safetensors(path)
    _check_archive(path)
    try:
        with warnings.catch_warnings():  # torch's notes on the pickle; errors are ours
            warnings.simplefilter("ignore")
            _allow_safe_globals()
            with path.open("rb") as fh:   # (torch.load reads a path by its suffix)
                return torch.load(fh, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(_load_error(path, exc)) from None


def _check_archive(path: Path) -> None:
    """Refuse a zip archive cut short or with a record that fails its checksum."""
    if not _starts_as(path, ZIP_MAGIC):
        return
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"weights file {path} is incomplete: it starts as a file "
                          "torch.save writes, but its end is missing (a copy or download "
                          "cut short?): copy it again")
    bad = None
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:   # saved without checksums (set_crc32_options(False))
                    continue
                with archive.open(info) as record:   # (its checksum is checked at the end)
                    while record.read(1 << 24):
                        pass
    except zipfile.BadZipFile as exc:
        bad = str(exc).rsplit(" ", 1)[-1] if "Bad CRC-32" in str(exc) else f"? ({exc})"
    except (OSError, EOFError, ValueError, RuntimeError) as exc:   # (a damaged header:
        bad = f"? ({type(exc).__name__})"                          # its name undecodable)
    if bad is not None:
        raise ConfigError(f"weights file {path} is damaged: its record {bad[:100]} does not "
                          "match its checksum (a copy cut or corrupted on the way?): copy "
                          "it again")


def _starts_as(path: Path, magic: bytes) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(len(magic)) == magic
    except OSError:
        return False


@functools.cache
def _allow_safe_globals() -> None:
    """Let torch.load(weights_only=True) rebuild SAFE_GLOBALS, once per process."""
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def _looks_safetensors(path: Path) -> bool:
    """Whether a file starts as safetensors do (an 8-byte header length, then a JSON
    object), whatever its name."""
    try:
        with path.open("rb") as fh:
            head = fh.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and \
        0 < int.from_bytes(head[:8], "little") < path.stat().st_size


def _load_error(path: Path, exc: Exception) -> str:
    """torch.load's refusal as one line that says what to do. torch's own message is
    many lines (with terminal colour codes) and suggests loading with weights_only=False,
    which hookserve never does: it would run code from the file."""
    text = _ANSI.sub("", str(exc))
    if not zipfile.is_zipfile(path) and not _starts_as_pickle(path):
        return (f"could not load weights file {path} as a state_dict (it is not a file "
                f"torch.save writes); {SAVE_HINT}")
    if found := re.search(r"GLOBAL ([\w.]+)", text):
        name = found.group(1)
        what = f"a pickled {name}"
        if ".nn." in name or ".models." in name:
            what += " (a whole model, saved with torch.save(model))"
        return (f"weights file {path} holds {what}, not a state_dict (a dict of tensors): "
                f"hookserve runs no code from a weights file; {SAVE_HINT}")
    if "TorchScript" in text:
        return (f"weights file {path} is a TorchScript archive (torch.jit.save: a "
                f"program), not a state_dict: hookserve runs no code from a weights "
                f"file; {SAVE_HINT}")
    if other := _other_archive(path):
        return (f"weights file {path} is {other}, not a state_dict: hookserve reads the "
                f"weights alone; {SAVE_HINT}")
    if not zipfile.is_zipfile(path):
        reason = "it is not a file torch.save writes"
    elif found := re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", text, re.S):
        reason = found.group(1)
    else:
        reason = f"{type(exc).__name__}: {text}"
    reason = " ".join(reason.split())[:200]
    return f"could not load weights file {path} as a state_dict ({reason}); {SAVE_HINT}"


def _other_archive(path: Path) -> str:
    """What a zip archive that torch.load cannot read is, by its records' names: a
    torch.export program or a numpy .npz; "" for anything else."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return ""
    if any(n.endswith(("serialized_exported_program.json", "/archive_format"))
           or n == "archive_format" for n in names):
        return "a torch.export program (torch.export.save: a .pt2 archive)"
    if names and all(n.endswith(".npy") for n in names):
        return "a numpy .npz archive"
    return ""


def _starts_as_pickle(path: Path) -> bool:
    """Whether a file begins as a pickle of protocol 2 or later does (torch.save's
    format before its zip archives); a text file read as a pickle gives nonsense."""
    return _starts_as(path, b"\x80")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError(f"weights file {path} is a .safetensors file and the safetensors "
                          "package is not installed: pip install 'hookserve[server]' "
                          "(or pip install safetensors)") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors' own error type differs between versions
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"could not load weights file {path} as safetensors ({reason}); "
                          "write it with safetensors.torch.save_file(model.state_dict(), "
                          "PATH)") from None
