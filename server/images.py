"""Images in chat messages: `image_url` content parts turned into RGB arrays, within limits, or a 400 that names
the part.

Accepted: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": ...}}` (the string
form `"image_url": "data:..."` too) in `user` and `tool` messages. Data URLs only: this server fetches nothing, so
an `http(s)://` URL is refused with a message saying to send the bytes inline.

Decoding (Pillow): JPEG, PNG and WebP only; a file whose pixel count is past the limit is refused from its header,
before its pixels are decoded (Pillow's decompression-bomb warning is an error here); animated or multi-frame
images are refused; EXIF orientation is applied; transparency is composited on white; the result is RGB uint8.

Limits (`ImageLimits`, the seed server's defaults): 4 images a request across the whole conversation, 10 MiB
encoded each and 20 MiB a request, 8192 px a side, 16 Mi pixels an image and 32 Mi a request.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import urllib.parse
import warnings
from typing import Any

import numpy as np

from server.errors import bad_request

MIB = 1024 * 1024
FORMATS = ("JPEG", "PNG", "WEBP")
IMAGE_ROLES = ("user", "tool")


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    max_images: int = 4
    max_image_bytes: int = 10 * MIB
    max_request_bytes: int = 20 * MIB
    max_side: int = 8192
    max_pixels: int = 16 * MIB
    max_request_pixels: int = 32 * MIB


@dataclasses.dataclass(frozen=True)
class ImagePart:
    """Where an image sits (`messages[i].content[j]`) and its decoded pixels [H, W, 3] uint8."""
    param: str
    pixels: np.ndarray


def _size(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n} bytes"


def image_url_of(part: dict[str, Any], param: str) -> str:
    """The URL of an `image_url` part, checked for shape. -> the URL string."""
    value = part.get("image_url")
    if isinstance(value, dict):
        extra = sorted(set(value) - {"url", "detail"})
        if extra:
            raise bad_request(f"{param}.image_url: unknown field {extra[0]!r} (url and detail are accepted)",
                              param=f"{param}.image_url")
        if value.get("detail", "auto") not in ("auto", "low", "high"):
            raise bad_request(f"{param}.image_url.detail must be auto, low or high", param=f"{param}.image_url")
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.image_url: needs a url string", param=f"{param}.image_url")
    extra = sorted(set(part) - {"type", "image_url"})
    if extra:
        raise bad_request(f"{param}: unknown field {extra[0]!r} in an image_url part", param=param)
    return value


def data_url_bytes(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes of a `data:` URL (base64 or percent-encoded). Other schemes are refused."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise bad_request(f"{param}: image URLs are not fetched by this server; send the image inline as a "
                          "data: URL (data:image/png;base64,...)", param=param)
    if scheme != "data":
        raise bad_request(f"{param}: only data: URLs are accepted for images, got a {scheme or 'schemeless'} URL",
                          param=param)
    head, sep, body = url[5:].partition(",")
    if not sep:
        raise bad_request(f"{param}: a data: URL needs a ',' before its data", param=param)
    media, *params = head.split(";")
    if media and not media.lower().startswith("image/"):
        raise bad_request(f"{param}: a data: URL of type {media!r} is not an image", param=param)
    # Encoded size before decoding: base64 grows by 4/3.
    if len(body) > limits.max_image_bytes * 4 // 3 + 4:
        raise bad_request(f"{param}: the image is larger than {_size(limits.max_image_bytes)}", param=param)
    try:
        if "base64" in (p.lower() for p in params):
            data = base64.b64decode(body, validate=True)
        else:
            data = urllib.parse.unquote_to_bytes(body)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{param}: the data: URL's base64 is not valid ({e})", param=param) from None
    if len(data) > limits.max_image_bytes:
        raise bad_request(f"{param}: the image is larger than {_size(limits.max_image_bytes)}", param=param)
    if not data:
        raise bad_request(f"{param}: the image is empty", param=param)
    return data


def decode_image(data: bytes, limits: ImageLimits, param: str) -> np.ndarray:
    """Encoded bytes -> RGB pixels [H, W, 3] uint8, or a 400 naming `param`."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            w, h = img.size
            if w > limits.max_side or h > limits.max_side:
                raise bad_request(f"{param}: the image is {w}x{h} px; at most {limits.max_side} px a side",
                                  param=param)
            if w * h > limits.max_pixels:
                raise bad_request(f"{param}: the image has {w * h} pixels; at most {limits.max_pixels}",
                                  param=param)
            if getattr(img, "n_frames", 1) > 1:
                raise bad_request(f"{param}: animated or multi-frame images are not accepted", param=param)
            img.load()
            img = ImageOps.exif_transpose(img)
            if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
                rgba = img.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                img = Image.alpha_composite(white, rgba)
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except UnidentifiedImageError:
        raise bad_request(f"{param}: not a JPEG, PNG or WebP image", param=param) from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise bad_request(f"{param}: the image has too many pixels", param=param) from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt files
        raise bad_request(f"{param}: the image could not be decoded ({e})", param=param) from None


def message_images(messages: list[dict[str, Any]], limits: ImageLimits) -> list[ImagePart]:
    """Every image of a conversation, in order (messages as the chat template gets them), decoded and checked
    against the limits."""
    found: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                continue
            param = f"messages[{i}].content[{j}]"
            if m.get("role") not in IMAGE_ROLES:
                raise bad_request(f"{param}: images are accepted in user and tool messages only, not in a "
                                  f"{m.get('role')} message", param=param)
            found.append((param, image_url_of(part, param)))
    if len(found) > limits.max_images:
        raise bad_request(f"messages: {len(found)} images; at most {limits.max_images} a request", param="messages")
    out, total_bytes, total_pixels = [], 0, 0
    for param, url in found:
        data = data_url_bytes(url, limits, param)
        total_bytes += len(data)
        if total_bytes > limits.max_request_bytes:
            raise bad_request(f"messages: the images add up to more than {_size(limits.max_request_bytes)}",
                              param="messages")
        pixels = decode_image(data, limits, param)
        total_pixels += pixels.shape[0] * pixels.shape[1]
        if total_pixels > limits.max_request_pixels:
            raise bad_request(f"messages: the images add up to more than {limits.max_request_pixels} pixels",
                              param="messages")
        out.append(ImagePart(param, pixels))
    return out
