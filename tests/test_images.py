"""Images in chat messages (server/images.py): data URLs decoded to RGB, EXIF orientation, transparency on white,
and every limit and malformed part refused with a 400 naming the part."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from server.errors import APIError
from server.images import ImageLimits, decode_image, message_images

LIMITS = ImageLimits()


def _encode(img: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _pattern(w: int, h: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1).astype(np.uint8)


def _chat(*parts, role="user"):
    return [{"role": "system", "content": "be brief"}, {"role": role, "content": list(parts)}]


def _image_part(url, **kw):
    return {"type": "image_url", "image_url": {"url": url, **kw}}


def _refused(messages, match, limits=LIMITS, param=None):
    with pytest.raises(APIError) as e:
        message_images(messages, limits)
    assert e.value.status == 400 and match in e.value.message, e.value.message
    if param is not None:
        assert e.value.param == param
    return e.value


def test_png_webp_and_jpeg_decode_in_message_order():
    a, b = _pattern(40, 24), _pattern(17, 33)
    msgs = _chat({"type": "text", "text": "compare"}, _image_part(_url(_encode(Image.fromarray(a)))),
                 {"type": "image_url", "image_url": _url(_encode(Image.fromarray(b), "WEBP", lossless=True),
                                                         "image/webp")})
    msgs.append({"role": "user", "content": [_image_part(_url(_encode(Image.fromarray(a), "JPEG", quality=95),
                                                              "image/jpeg"))]})
    got = message_images(msgs, LIMITS)
    assert [g.param for g in got] == ["messages[1].content[1]", "messages[1].content[2]", "messages[2].content[0]"]
    np.testing.assert_array_equal(got[0].pixels, a)
    np.testing.assert_array_equal(got[1].pixels, b)
    assert got[2].pixels.shape == a.shape and np.abs(got[2].pixels.astype(int) - a).mean() < 4  # lossy
    assert message_images(_chat({"type": "text", "text": "no images"}), LIMITS) == []


def test_transparency_on_white_and_exif_orientation():
    rgba = np.zeros((6, 8, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:, :4, 3] = 255  # left half opaque red, right half transparent
    px = decode_image(_encode(Image.fromarray(rgba, "RGBA")), LIMITS, "p")
    np.testing.assert_array_equal(px[:, :4], np.broadcast_to([200, 0, 0], (6, 4, 3)))
    np.testing.assert_array_equal(px[:, 4:], np.full((6, 4, 3), 255))
    img = Image.fromarray(_pattern(30, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    px = decode_image(_encode(img, "JPEG", exif=exif, quality=95), LIMITS, "p")
    assert px.shape == (30, 10, 3)


def test_malformed_parts_are_refused_by_name():
    png = _url(_encode(Image.fromarray(_pattern(4, 4))))
    _refused(_chat(_image_part("https://example.com/cat.png")), "send the image inline",
             param="messages[1].content[0]")
    _refused(_chat(_image_part("file:///etc/passwd")), "only data: URLs")
    _refused(_chat(_image_part("data:image/png;base64,@@@")), "base64 is not valid")
    _refused(_chat(_image_part("data:text/plain;base64,aGk=")), "is not an image")
    _refused(_chat(_image_part(_url(b"GIF89a not really"))), "not a JPEG, PNG or WebP")
    _refused(_chat(_image_part(_url(_encode(Image.fromarray(_pattern(4, 4)), "GIF"), "image/gif"))),
             "not a JPEG, PNG or WebP")
    _refused(_chat(_image_part(_url(_encode(Image.fromarray(_pattern(40, 40)))[:60]))), "could not be decoded")
    _refused(_chat(_image_part(png, detail="ultra")), "detail must be auto, low or high")
    _refused(_chat(_image_part(png, size=3)), "unknown field 'size'")
    _refused(_chat({"type": "image_url"}), "needs a url string")
    _refused(_chat(_image_part(png), role="assistant"), "user and tool messages only")
    _refused(_chat(_image_part(png), role="system"), "user and tool messages only")
    assert len(message_images(_chat(_image_part(png), role="tool"), LIMITS)) == 1


def test_limits():
    small = _url(_encode(Image.fromarray(_pattern(8, 8))))
    _refused(_chat(*[_image_part(small)] * 5), "5 images; at most 4", param="messages")
    _refused(_chat(_image_part(_url(_encode(Image.new("L", (8193, 2)))))), "at most 8192 px a side")
    tight = ImageLimits(max_pixels=1000, max_request_pixels=1500, max_image_bytes=4000, max_request_bytes=6000)
    _refused(_chat(_image_part(_url(_encode(Image.new("RGB", (40, 30)))))), "at most 1000", limits=tight)
    ok = _url(_encode(Image.new("RGB", (30, 30))))
    _refused(_chat(_image_part(ok), _image_part(ok)), "add up to more than 1500 pixels", limits=tight)
    noise = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)  # incompressible
    _refused(_chat(_image_part(_url(_encode(Image.fromarray(noise))))), "larger than", limits=tight)
    assert len(message_images(_chat(_image_part(ok)), tight)) == 1
    pair = ImageLimits(max_image_bytes=4000, max_request_bytes=5000)
    each = _url(_encode(Image.fromarray(noise[:30, :30])))  # ~2.8 KB each
    assert len(message_images(_chat(_image_part(each)), pair)) == 1
    _refused(_chat(_image_part(each), _image_part(each)), "add up to more than 5000 bytes", limits=pair)
