"""The images of a chat request: OpenAI ``image_url`` parts, read as base64 data URLs only.

The server is offline (and must not be made to fetch what a stranger names: internal addresses,
huge files, local ``file://`` paths), so an http(s) URL is refused with a 400 that says to send
the picture inline. A data URL is decoded within limits, each checked before the work it bounds:
the base64 text's length before decoding, the decoded bytes, then the pixel count from the image
header before any pixel is decompressed (a small PNG can hold a 100,000 x 100,000 picture).
Every way an image can be wrong is an ``APIError`` 4xx, never a 500.
"""

from __future__ import annotations

import base64
import binascii
import io

from .protocol import APIError

# The formats a client sends photos and screenshots in; PIL's rarer decoders stay out of reach.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def decode_image_url(url: str, where: str, limits):
    """The PIL image (RGB or as decoded) an ``image_url`` part carries; ``where`` names the part
    in errors (``messages[0].content``)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise APIError(400, f"{where}: this server is offline and does not fetch image URLs; send the picture "
                            'inline as a base64 data URL ("data:image/png;base64,...").', param="messages",
                       code="image_url_not_supported")
    if scheme != "data":
        raise APIError(400, f"{where}: an image_url must be a base64 data URL (\"data:image/png;base64,...\"); "
                            f"got {url[:40]!r}.", param="messages", code="invalid_image")
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise APIError(400, f"{where}: the data URL is not base64 (it must read \"data:image/<type>;base64,<data>\").",
                       param="messages", code="invalid_image")
    limit = limits.max_image_bytes
    if len(payload) > 4 * ((limit + 2) // 3) + 4:  # base64 text longer than `limit` bytes can encode
        raise APIError(413, _too_big(where, limit), param="messages", code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the data URL's base64 text is broken (characters outside base64, or cut "
                            "short).", param="messages", code="invalid_image") from None
    if len(data) > limit:
        raise APIError(413, _too_big(where, limit), param="messages", code="image_too_large")
    return _open(data, where, limits.max_image_pixels)


def _open(data: bytes, where: str, max_pixels: int):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = image.size  # from the header: nothing decompressed yet
    except Exception:  # noqa: BLE001 (PIL raises many kinds; a decompression bomb too)
        raise APIError(400, f"{where}: the data is not a picture this server reads ({', '.join(FORMATS)}).",
                       param="messages", code="invalid_image") from None
    if width * height > max_pixels:
        raise APIError(413, f"{where}: the image is {width} x {height} pixels; this server takes at most {max_pixels} "
                            "pixels per image (serve_max_image_pixels). Send it smaller.",
                       param="messages", code="image_too_large")
    try:
        image.load()
    except Exception:  # noqa: BLE001 (a truncated or corrupt picture)
        raise APIError(400, f"{where}: the picture is truncated or corrupt and cannot be decoded.",
                       param="messages", code="invalid_image") from None
    return image


def _too_big(where: str, limit: int) -> str:
    return (f"{where}: the image is over this server's limit of {limit} bytes (serve_max_image_bytes); "
            "send it smaller.")
