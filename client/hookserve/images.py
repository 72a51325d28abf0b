"""Turn what a user holds (a path, bytes, a PIL image, an array) into a wire Image."""

from __future__ import annotations

import errno
import os
import re
import select
import stat
import urllib.parse
import urllib.request
from typing import Any

import numpy as np

from .v1 import hookserve_pb2 as pb


def default_id(obj: Any, index: int) -> str:
    """A path's own string; otherwise the image's position in the input."""
    if isinstance(obj, (str, os.PathLike)):
        return os.fspath(obj)
    return str(index)


class TooLarge(ValueError):
    """An image file over the client's send limit, refused from its size (a regular
    file, unread) or once more than the limit was read (a pipe or a device)."""

    def __init__(self, size: int | str, limit: int) -> None:
        super().__init__(f"{size} bytes, over this client's limit of {limit} bytes")
        self.size, self.limit = size, limit


#: The most a pipe or a device is read when the client sets no send limit (protobuf's
#: largest message).
MAX_STREAM_BYTES = (2 << 30) - 1


def read_file(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """An image file's bytes, at most `limit` (the client's send limit: a larger
    request could not be sent). A regular file over it is refused from its size,
    unread; a pipe (``<(curl ...)``, a named pipe) or a character device
    (``/dev/stdin``) is read up to it, so one that never ends (``/dev/zero``) ends
    there. A named pipe waits up to :data:`PIPE_WAIT_S` for its writer. A folder, a
    socket or a block device is refused. A ``file://`` URL is its local path; another
    URL is refused with what to do instead."""
    path = _local_path(path)
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
    regular = stat.S_ISREG(st.st_mode)
    if not (regular or stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        raise ValueError("it is a socket or a block device, not a file: give an image file")
    limit = limit if limit is not None and limit >= 0 else None
    if regular and limit is not None and st.st_size > limit:
        raise TooLarge(st.st_size, limit)
    most = limit if limit is not None else MAX_STREAM_BYTES
    # Opened without waiting: a named pipe's open would block until a writer opened it,
    # for ever if none does. Its writer is then waited for, a bounded time.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as fh:
        if stat.S_ISFIFO(st.st_mode) and _named(path):
            _await_writer(fd)
        os.set_blocking(fd, True)
        data = fh.read(most + 1)
    if len(data) > most:   # (a regular file that grew since, or an endless stream)
        raise TooLarge(f"more than {most}", most)
    return data


#: A URL's scheme (two letters or more: ``C:\\x`` is a Windows path).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def _local_path(path: str | os.PathLike) -> str | os.PathLike:
    """`path`, or the local path a ``file:`` URL names; any other URL that is no
    existing file is refused, saying what to do."""
    if not isinstance(path, str) or not (m := _SCHEME.match(path)) or os.path.exists(path):
        return path
    url = urllib.parse.urlsplit(path)
    if m.group(1).lower() == "file":
        if url.netloc.lower() not in ("", "localhost"):
            raise ValueError(f"a file URL of another host ({url.netloc[:60]}) is not read "
                             "here: give a local path")
        if url.query or url.fragment:
            raise ValueError("a file URL with a query or a fragment: write a '#' or a '?' "
                             "of the file's name as %23 or %3F")
        return urllib.request.url2pathname(url.path)
    raise ValueError("a URL is not read here (images are local paths, bytes, PIL images "
                     "or arrays): fetch it and pass its bytes, or give it to `hookserve "
                     "batch`, which reads http(s), s3 and gs URLs")


#: How long a named pipe's reader waits for a writer to open it and write or close.
PIPE_WAIT_S = 30.0


def _named(path: str | os.PathLike) -> bool:
    """Whether a pipe is a named one on disk (``mkfifo``), not a pipe already open
    with its writer (``<(curl ...)`` is ``/dev/fd/63``, whose target is
    ``pipe:[...]``): only a named pipe's writer may not have come yet."""
    return "pipe:[" not in os.path.realpath(path)


def _await_writer(fd: int) -> None:
    """Wait until the pipe has data or its writer closed it. Linux reports neither for
    a pipe no writer has opened yet, so this is a wait for the writer (a
    ``mkfifo p; producer > p &`` whose producer has not started, which read as empty)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    if not poller.poll(PIPE_WAIT_S * 1000):
        raise ValueError(f"no one wrote to this named pipe within {PIPE_WAIT_S:g} s: "
                         "start its writer before the call, or give the image's file")


def to_image(obj: Any, image_id: str, limit: int | None = None) -> pb.Image:
    """Build a wire Image.

    - ``str`` / ``os.PathLike``: the file's bytes are sent encoded (the server decodes);
      `read_file` refuses one over `limit` bytes unread.
    - ``bytes`` / ``bytearray`` / ``memoryview``: sent as encoded image bytes.
    - ``numpy.ndarray``: HxWx3 uint8 RGB (HxW grayscale and HxWx4 RGBA are converted),
      sent as raw pixels.
    - ``PIL.Image.Image``: converted to RGB (16-bit: its high byte, as for a 16-bit
      PNG; floating point is refused) and sent as raw pixels.
    """
    if isinstance(obj, (str, os.PathLike)):
        return pb.Image(id=image_id, encoded=read_file(obj, limit))
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return pb.Image(id=image_id, encoded=bytes(obj))
    if type(obj).__module__.startswith("PIL."):
        obj = _pil_rgb(obj)
    if isinstance(obj, np.ndarray):
        return _array_image(obj, image_id)
    hint = ""
    if isinstance(obj, (list, tuple)):
        hint = " (several images go to extract_many / attribute_many, one at a time here)"
    elif type(obj).__module__.split(".")[0] == "torch":
        hint = (" (a CxHxW tensor: img.permute(1, 2, 0).cpu().numpy() as uint8 0..255, or "
                "the image file's path or bytes)")
    raise TypeError(
        f"unsupported image type {type(obj).__name__}: pass a path, encoded bytes, "
        f"a PIL image or an HxWx3 uint8 numpy array{hint}")


def _pil_rgb(img: Any) -> np.ndarray:
    """A PIL image as HxWx3 uint8 RGB, turned as its EXIF orientation says (as the
    server turns the same file's bytes). 16- and 32-bit integer images keep their high
    byte, as the server reduces a 16-bit PNG (PIL's own convert clips them at 255);
    floating-point images have no one scale and are refused."""
    img = _upright(img)
    if img.mode == "F":
        raise TypeError("a PIL image of mode F (floating point) has no one pixel scale: "
                        "convert it to 8-bit first, e.g. Image.fromarray((a * 255)"
                        ".round().astype('uint8')) for values in 0..1")
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        a = (np.clip(np.asarray(img).astype(np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(a[:, :, None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


def _upright(img: Any) -> Any:
    """`img` turned as its EXIF orientation says: itself when it says none (no copy), or
    when its EXIF cannot be read (as the server reads such a file's pixels)."""
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a damaged EXIF block: the pixels as they are
        return img
    if orientation in (None, 1):
        return img
    from PIL import ImageOps

    return ImageOps.exif_transpose(img)


def _array_image(a: np.ndarray, image_id: str) -> pb.Image:
    a = np.asarray(a)   # a subclass (np.matrix, a masked array) as the plain array
    if a.dtype != np.uint8:
        raise TypeError(f"array images must be uint8, got {a.dtype}: scale to 0..255 first")
    if a.ndim == 3 and a.shape[2] == 1:   # one channel, as HxW
        a = a[:, :, 0]
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    elif a.ndim == 3 and a.shape[2] == 4:
        a = a[:, :, :3]
    if a.ndim != 3 or a.shape[2] != 3:
        chw = a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[2] > 4
        raise TypeError(f"array images must be HxWx3 (RGB), HxWx4, HxWx1 or HxW (grey), "
                        f"got shape {a.shape}"
                        + (": channels first, a.transpose(1, 2, 0) makes it HxWxC"
                           if chw else ""))
    h, w = a.shape[:2]
    raw = pb.RawImage(pixels=np.ascontiguousarray(a).tobytes(), height=h, width=w)
    return pb.Image(id=image_id, raw=raw)
