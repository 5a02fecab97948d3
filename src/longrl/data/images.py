"""Images of vision-language rows, in TRL's formats: found without reading them, read as RGB Pillow images.

A row holds its images in an ``image`` column (one) or an ``images`` column (a list); both in one row is refused.
Each image is one of:
  a file path       relative paths resolve against the dataset file's folder (``hf:``, ``task:`` and rows given in
                    memory: the current directory), absolute paths stand as they are; URLs are refused (runs are
                    offline: download the files and give their paths)
  datasets.Image    a dict with ``bytes`` (used when present) and/or ``path``, or a Pillow image
  raw bytes         an encoded image (PNG, JPEG, ...)

:func:`row_image_sources` turns a row's cells into :class:`ImageSource` values without reading them.
:meth:`ImageSource.open` reads one: the header first, so an image of more than ``data.max_image_pixels`` pixels
(width × height) is refused before its pixels are decoded (a decompression bomb), then every pixel (a truncated or
corrupt file fails here), EXIF orientation applied as transformers' ``load_image`` does, then RGB. Each failure is a
DataError naming the row, the column, the image and the file. Pillow is imported only when a row has images (the
``vision`` extra).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..config.schema import DataConfig
from .errors import DataError

IMAGE_COLUMNS = ("image", "images")
MAX_IMAGE_PIXELS = DataConfig.max_image_pixels  # the default limit: a 50-megapixel photo, 150 MB as RGB
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def pillow():
    """``PIL.Image``, or a DataError naming the extra that installs Pillow."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("this dataset has images, which need Pillow: pip install 'longrl[vision]'") from None
    return Image


def is_pil_image(value) -> bool:
    image_module = sys.modules.get("PIL.Image")  # no Pillow image exists before Pillow is imported
    return image_module is not None and isinstance(value, image_module.Image)


@dataclass(frozen=True, eq=False)
class ImageSource:
    """One image of a row, not read yet: a file, encoded bytes, or a Pillow image given in memory."""

    where: str  # row, column and image for errors: "dataset 'd.jsonl' row 3, column 'images' image 2"
    max_pixels: int  # data.max_image_pixels
    path: Path | None = None  # the file to read (absolute)
    data: bytes | None = None  # encoded bytes to read
    image: object = None  # a PIL.Image.Image given in memory
    label: str | None = None  # the path a datasets.Image value names beside its bytes (shown in errors)

    def describe(self) -> str:
        if self.path is not None:
            return f"file {self.path}"
        if self.data is not None:
            return f"{len(self.data)} bytes" + (f" of {self.label}" if self.label else "")
        return "a Pillow image given in memory"

    def error(self, problem: str) -> DataError:
        return DataError(f"{self.where} ({self.describe()}): {problem}")

    def open(self):
        """The image as an RGB ``PIL.Image.Image``, read and checked as the module's docstring says."""
        image_module = pillow()
        if self.image is not None:
            return self._decoded(self.image)
        if self.path is not None:
            if not self.path.is_file():
                raise self.error("file not found" + ("" if not self.path.exists() else " (not a file)"))
            try:
                stream = open(self.path, "rb")
            except OSError as e:
                raise self.error(f"cannot be read ({e.strerror})") from None
        else:
            stream = io.BytesIO(self.data)
        with stream:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", image_module.DecompressionBombWarning)  # our limit decides
                    image = image_module.open(stream)
            except image_module.DecompressionBombError as e:  # past twice Pillow's own limit
                raise self.error(f"more pixels than data.max_image_pixels={self.max_pixels:,} (Pillow: {e})"
                                 if self.max_pixels <= 2 * image_module.MAX_IMAGE_PIXELS else
                                 f"more pixels than Pillow opens ({e})") from None
            except Exception as e:  # noqa: BLE001 - any reader failure is the file's fault: name it
                raise self.error(f"not an image Pillow can read ({type(e).__name__}: {e})") from None
            with image:
                return self._decoded(image)

    def _decoded(self, image):
        pixels = image.width * image.height
        if pixels > self.max_pixels:
            raise self.error(f"{image.width}×{image.height} = {pixels:,} pixels, more than data.max_image_pixels="
                             f"{self.max_pixels:,} (the guard against decompression bombs); raise it for such images")
        try:
            from PIL import ImageOps

            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
        except Exception as e:  # noqa: BLE001 - a decoder failure: truncated or corrupt data
            raise self.error(f"truncated or corrupt image ({type(e).__name__}: {e})") from None

    def digest(self) -> str:
        """SHA-256 of the image's content: the file's or the bytes' encoding, a Pillow image's mode, size and pixels.
        A file that cannot be read stands as its path (the checks refuse it)."""
        if self.image is not None:
            return pixels_digest(self.image)
        if self.data is not None:
            return hashlib.sha256(self.data).hexdigest()
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return f"unreadable:{self.path}"


def pixels_digest(image) -> str:
    """SHA-256 of a Pillow image's mode, size and pixels (not of the object)."""
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def image_source(value, where: str, base_dir: Path | None, max_pixels: int) -> ImageSource:
    """The source of one image cell (see the module's docstring); DataError naming ``where`` for a URL or a value
    that is no image."""
    if is_pil_image(value):
        return ImageSource(where, max_pixels, image=value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageSource(where, max_pixels, data=bytes(value))
    if isinstance(value, dict):  # a datasets.Image value not decoded: {"bytes": ..., "path": ...}
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray, memoryview)):
            return ImageSource(where, max_pixels, data=bytes(data), label=path if isinstance(path, str) else None)
        if data is not None or path is None:
            raise DataError(f"{where}: a datasets.Image value needs 'bytes' (bytes) or 'path'; got {value!r:.80}")
        value = path
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if _URL.match(text):
            raise DataError(f"{where}: {text!r:.120} is a URL; runs read images offline: download the file and give "
                            "its path")
        if not text.strip():
            raise DataError(f"{where}: an empty file path")
        path = Path(text).expanduser()
        return ImageSource(where, max_pixels, path=(base_dir or Path.cwd()) / path)  # an absolute path stays
    raise DataError(f"{where}: expected an image (a file path, bytes, a datasets.Image value or a Pillow image); got "
                    f"{type(value).__name__}")


def row_image_sources(row: dict, where: str, base_dir: Path | None,
                      max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[str | None, list[ImageSource]]:
    """(the column holding ``row``'s images, their sources in order); (None, []) for a row without images. An empty
    or None cell holds none."""
    held = [c for c in IMAGE_COLUMNS if _holds(row.get(c))]
    if len(held) == 2:
        raise DataError(f"{where}: both the 'image' and the 'images' column hold images; use one ('images' for "
                        "several)")
    if not held:
        return None, []
    column, value = held[0], row[held[0]]
    if column == "image":
        if isinstance(value, (list, tuple)):
            raise DataError(f"{where}, column 'image': holds a list of {len(value)}; the 'image' column holds one "
                            "image (put several in an 'images' column)")
        return column, [image_source(value, f"{where}, column 'image'", base_dir, max_pixels)]
    if not isinstance(value, (list, tuple)):
        raise DataError(f"{where}, column 'images': must be a list of images; got {type(value).__name__} (one image "
                        "may go in an 'image' column)")
    return column, [image_source(v, f"{where}, column 'images' image {k + 1}", base_dir, max_pixels)
                    for k, v in enumerate(value)]


def _holds(cell) -> bool:
    return cell is not None and not (isinstance(cell, (list, tuple)) and not cell)


def has_image_cells(row: dict) -> bool:
    """Whether ``row`` has a non-empty ``image`` or ``images`` cell (without checking it)."""
    return any(_holds(row.get(c)) for c in IMAGE_COLUMNS)


def dataset_folder(source: str) -> Path | None:
    """The folder relative image paths of ``source`` resolve against: a dataset file's own; None (the current
    directory) for ``hf:``, ``task:`` and ``memory:`` sources."""
    if source.startswith(("hf:", "task:", "memory:")):
        return None
    return Path(source).expanduser().absolute().parent


def open_images(sources: list[ImageSource]) -> list:
    """Each source read (:meth:`ImageSource.open`): RGB Pillow images, in order."""
    return [s.open() for s in sources]


def rows_images_digest(rows: list[dict], base_dir: Path | None) -> str | None:
    """SHA-256 over the content of every image ``rows`` hold, in order (files read, not named); None when no row
    holds an image. Never raises: a cell that is no image counts as its text, and the row checks refuse it, naming
    the dataset."""
    h, found = hashlib.sha256(), False
    for i, row in enumerate(rows):
        if not (isinstance(row, dict) and has_image_cells(row)):
            continue
        found = True
        try:
            digests = [source.digest() for source in row_image_sources(row, f"row {i + 1}", base_dir)[1]]
        except DataError as e:
            digests = [f"refused:{e}"]
        h.update(f"{i}:{','.join(digests)};".encode())
    return h.hexdigest() if found else None
