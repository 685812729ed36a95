"""Images of a prompt's content parts, read into PIL images for the model's processor.

A part's image is OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (or `input_image`, or a bare
`{"type": "image", "image": ...}` of the Python API), where the url is a `data:` URL, a path (relative to the
input file's folder), or an fsspec URL (`s3://`, `hf://`, ...); a dataset column gives an HF `Image` value
({bytes, path}) or bytes; the Python API may pass a PIL image itself. A missing, unreadable or oversized image is
a ValueError naming it, which the caller makes that row's error.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

MAX_PIXELS = 64_000_000  # larger is an error row, not the process's memory (PIL's own bomb limit is ~89M)


def load_image(source: Any, base_dir: Path | None = None):
    """A PIL image (RGB) from a part's source; ValueError saying why it cannot be read."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _checked(source)
    if isinstance(source, dict):  # an HF datasets Image value
        if source.get("bytes"):
            return load_image(bytes(source["bytes"]))
        if source.get("path"):
            return load_image(str(source["path"]), base_dir)
        raise ValueError("an image value with neither bytes nor a path")
    if isinstance(source, bytes | bytearray | memoryview):
        return _decode(bytes(source), "the image bytes")
    if not isinstance(source, str) or not source:
        raise ValueError(f"an image must be a URL, a path or bytes (got {type(source).__name__})")
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise ValueError("a data: URL image must be base64 (data:image/...;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except ValueError:
            raise ValueError("a data: URL image whose base64 does not decode") from None
        return _decode(data, "the data: URL image")
    if "://" in source:
        import fsspec

        try:
            with fsspec.open(source, "rb") as f:
                return _decode(f.read(), source)
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(f"cannot read the image {source}: {e}") from None
    path = Path(source)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the image {source}: {e.strerror or e}") from None
    return _decode(data, source)


def _decode(data: bytes, name: str):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"{name} is {image.width}x{image.height}, over {MAX_PIXELS} pixels")
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name} is not an image PIL can read ({e})") from None
    return _checked(image)


def _checked(image):
    if image.width * image.height > MAX_PIXELS:
        raise ValueError(f"an image of {image.width}x{image.height} is over {MAX_PIXELS} pixels")
    return image.convert("RGB")
