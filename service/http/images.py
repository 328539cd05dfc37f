"""Images in requests, the HTTP edge's side: where an image's URL may point, reading its bytes
within the limits, and decoding them with Pillow. What the engine does with the decoded images
(placeholders, pixels, M-RoPE) is `model/multimodal/`.

Every API family turns its image parts into `ImageRef`s (the URL, its `detail`, and the request
field it came from, which a 400 names). `ImageLoader.load_all` checks how many a request has, then
reads and decodes each on a worker thread, never on the event loop:

- `data:image/...;base64,` URLs: decoded in place; any other data URL is a 400.
- `file://` paths: only under `allowed_local_media_path`, the path resolved first (symlinks, `..`)
  and the opened file checked again, so nothing outside that directory is read.
- `http://` / `https://`: only from a host named in `allowed_media_domains`; fetched with a time
  bound and a size bound, redirects not followed (one could lead to any host).

An image is at most `max_image_bytes` encoded and `max_image_pixels` decoded (width x height, read
from its header before the pixels are decoded: Pillow's `Image.open` is lazy). Only PNG, JPEG,
WebP and GIF are opened (Pillow's other plugins, EPS among them, are never reached), an animated
one is refused, and an image that does not decode is a 400, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import os
import stat
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from service.errors import APIError

logger = logging.getLogger(__name__)

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's plugins an image may be opened with
LOW_DETAIL_SIDE = 512  # `detail: "low"`: the image is scaled down to fit this square, as OpenAI does
DETAILS = ("auto", "low", "high")
_READ_CHUNK = 1 << 16
_ORIENTATION = 0x0112  # the EXIF tag


@dataclass(frozen=True)
class ImageLimits:
    """What the edge takes: the app arguments of the same names (service/app/engine_app.py)."""

    max_images: int = 8  # per request (vLLM's limit_mm_per_prompt {"image": N})
    max_image_bytes: int = 10 << 20  # one image, encoded (the file, not its base64)
    max_image_pixels: int = 4096 * 4096  # one image, decoded: width x height
    allowed_local_media_path: str | None = None  # file:// URLs are read only under this directory
    allowed_media_domains: tuple[str, ...] = ()  # http(s) URLs are fetched only from these hosts
    fetch_timeout_s: float = 5.0  # one remote image, start to end

    def __post_init__(self) -> None:
        for name, least in (("max_images", 0), ("max_image_bytes", 1), ("max_image_pixels", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"image_fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        object.__setattr__(self, "allowed_media_domains", tuple(d.lower() for d in self.allowed_media_domains))


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: its URL, its `detail`, and the field a 400 about it names."""

    url: str
    param: str
    detail: str = "auto"


def image_error(message: str, param: str | None, code: str = "invalid_image") -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


@dataclass
class ImageLoader:
    """Reads and decodes a request's images under `limits` (built once per replica)."""

    limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        path = self.limits.allowed_local_media_path
        self._root: str | None = None
        if path:
            if not os.path.isdir(path):
                raise ValueError(f"allowed_local_media_path must be an existing directory, got {path!r}")
            self._root = os.path.realpath(path)
        # Pillow's own bomb check must never refuse (or warn about) an image these limits allow;
        # one they do not allow is refused right after it by `decode_image`, with a 400.
        if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < self.limits.max_image_pixels:
            Image.MAX_IMAGE_PIXELS = self.limits.max_image_pixels
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

    def check_count(self, refs: Sequence[ImageRef], param: str = "messages") -> None:
        """A 400 when a request has more images than `max_images`."""
        if len(refs) > self.limits.max_images:
            raise image_error(f"{param}: the request has {len(refs)} images; this server takes at most "
                              f"{self.limits.max_images} per request (limit_mm_per_prompt)", param, "too_many_images")

    async def load_all(self, refs: Sequence[ImageRef], param: str = "messages") -> list[Image.Image]:
        """Each image decoded, in order, each on a worker thread; APIError (400) for the first
        that is refused or fails."""
        self.check_count(refs, param)
        return list(await asyncio.gather(*(asyncio.to_thread(self.load, ref) for ref in refs)))

    def load(self, ref: ImageRef) -> Image.Image:
        """One image, read and decoded (blocking: call it off the event loop)."""
        if ref.detail not in DETAILS:
            raise image_error(f"{ref.param}: detail must be one of {', '.join(DETAILS)}, got {ref.detail!r}", ref.param)
        image = decode_image(self.read(ref), ref.param, self.limits.max_image_pixels)
        if ref.detail == "low":
            image.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE))
        return image

    def read(self, ref: ImageRef) -> bytes:
        """The encoded image's bytes, from wherever its URL points (if it may point there)."""
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme == "data":
            return self._data_url(ref)
        if scheme == "file":
            return self._local_file(ref)
        if scheme in ("http", "https"):
            return self._remote(ref)
        raise image_error(f"{ref.param}: an image URL must be a data:image/...;base64 URL, an https:// or http:// "
                          f"URL, or a file:// path; got {_show_url(ref.url)}", ref.param, "invalid_image_url")

    def _too_large(self, ref: ImageRef, size: int | None) -> APIError:
        got = f"is {size} bytes" if size is not None else "is larger"
        return image_error(f"{ref.param}: the image {got}; this server takes at most {self.limits.max_image_bytes} "
                           "bytes per image, encoded (max_image_bytes)", ref.param, "image_too_large")

    def _data_url(self, ref: ImageRef) -> bytes:
        header, comma, payload = ref.url[5:].partition(",")
        media_type, *params = header.split(";")
        if not comma or not media_type.strip().lower().startswith("image/"):
            raise image_error(f"{ref.param}: a data URL must hold an image (data:image/png;base64,...), got one of "
                              f"type {media_type.strip() or 'text/plain'!r}", ref.param, "invalid_image_url")
        if "base64" not in (p.strip().lower() for p in params):
            raise image_error(f"{ref.param}: an image data URL must be base64-encoded (data:{media_type};base64,...)",
                              ref.param, "invalid_image_url")
        if (len(payload) // 4) * 3 - 2 > self.limits.max_image_bytes:  # refused before decoding it
            raise self._too_large(ref, None)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise image_error(f"{ref.param}: the data URL's payload is not valid base64", ref.param) from None
        if len(data) > self.limits.max_image_bytes:
            raise self._too_large(ref, len(data))
        return data

    def _local_file(self, ref: ImageRef) -> bytes:
        if self._root is None:
            raise image_error(f"{ref.param}: file:// image URLs are refused: this server reads no local files (it "
                              "would read them under allowed_local_media_path)", ref.param, "image_url_not_allowed")
        parts = urlsplit(ref.url)
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not os.path.isabs(path):
            raise image_error(f"{ref.param}: a file:// URL must name an absolute path on this server "
                              "(file:///dir/image.png)", ref.param, "invalid_image_url")
        outside = image_error(f"{ref.param}: {_show_url(ref.url)} is outside the directory this server reads "
                              "images from (allowed_local_media_path)", ref.param, "image_url_not_allowed")
        if not _under(os.path.realpath(path), self._root):  # symlinks and ".." resolved first
            raise outside
        try:
            fd = os.open(os.path.realpath(path), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise image_error(f"{ref.param}: cannot read {_show_url(ref.url)}: {exc.strerror}", ref.param) from None
        try:
            opened = f"/proc/self/fd/{fd}"  # what was opened, should a path component have changed since
            if os.path.exists(opened) and not _under(os.path.realpath(opened), self._root):
                raise outside
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise image_error(f"{ref.param}: {_show_url(ref.url)} is not a file", ref.param)
            if info.st_size > self.limits.max_image_bytes:
                raise self._too_large(ref, info.st_size)
            data = _read_at_most(fd, self.limits.max_image_bytes + 1)
        except OSError as exc:
            raise image_error(f"{ref.param}: cannot read {_show_url(ref.url)}: {exc.strerror}", ref.param) from None
        finally:
            os.close(fd)
        if len(data) > self.limits.max_image_bytes:
            raise self._too_large(ref, None)
        return data

    def _remote(self, ref: ImageRef) -> bytes:
        host = (urlsplit(ref.url).hostname or "").lower()
        if host not in self.limits.allowed_media_domains:
            why = (f"its host {host!r} is not among allowed_media_domains" if self.limits.allowed_media_domains
                   else "this server fetches none (allowed_media_domains names the hosts it may fetch from)")
            raise image_error(f"{ref.param}: image URLs on the web are refused: {why}; send the image as a "
                              "data:image/...;base64 URL", ref.param, "image_url_not_allowed")
        try:
            return self._fetch(ref)
        except httpx.TimeoutException:
            raise image_error(f"{ref.param}: fetching the image did not finish within {self.limits.fetch_timeout_s:g} s "
                              "(image_fetch_timeout_s)", ref.param, "image_fetch_failed") from None
        except httpx.HTTPError as exc:
            raise image_error(f"{ref.param}: fetching the image failed ({type(exc).__name__})", ref.param,
                              "image_fetch_failed") from None

    def _fetch(self, ref: ImageRef) -> bytes:
        limit, timeout = self.limits.max_image_bytes, self.limits.fetch_timeout_s
        deadline = time.monotonic() + timeout
        # identity: the size bound counts the bytes as sent, with no decompression bomb behind them
        with httpx.Client(timeout=timeout, follow_redirects=False, headers={"Accept-Encoding": "identity"}) as client, \
                client.stream("GET", ref.url) as r:
            if r.status_code != 200:
                where = f" to {_show_url(r.headers.get('location', ''))}" if r.is_redirect else ""
                hint = "; redirects are not followed, send the final URL" if r.is_redirect else ""
                raise image_error(f"{ref.param}: fetching the image answered HTTP {r.status_code}{where}{hint}",
                                  ref.param, "image_fetch_failed")
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise self._too_large(ref, int(declared))
            data = bytearray()
            for chunk in r.iter_raw(_READ_CHUNK):
                data += chunk
                if len(data) > limit:
                    raise self._too_large(ref, None)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the whole fetch took too long")
        return bytes(data)


def decode_image(data: bytes, param: str, max_pixels: int) -> Image.Image:
    """A PNG, JPEG, WebP or GIF (not animated) decoded, its EXIF orientation applied; a 400
    naming `param` when it is none of those, is larger than `max_pixels`, or fails to decode."""
    invalid = f"{param}: the image cannot be decoded (this server takes PNG, JPEG, WebP and GIF)"
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own bound, far past ours
        raise _too_many_pixels(param, None, max_pixels) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise image_error(invalid, param) from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_many_pixels(param, (width, height), max_pixels)
    if getattr(image, "is_animated", False):
        raise image_error(f"{param}: an animated image is not taken; send one frame", param)
    try:
        image.load()
        if image.getexif().get(_ORIENTATION, 1) != 1:  # a camera's rotation, applied as a viewer shows it
            image = ImageOps.exif_transpose(image)
        return image
    except Exception as exc:  # noqa: BLE001 (a truncated or corrupt file fails in many ways inside Pillow)
        logger.debug("image decode failed: %s: %s", type(exc).__name__, exc)
        raise image_error(f"{invalid}: {type(exc).__name__}", param) from None


def _too_many_pixels(param: str, size: tuple[int, int] | None, max_pixels: int) -> APIError:
    got = f"is {size[0]}x{size[1]} ({size[0] * size[1]} pixels)" if size else "has too many pixels"
    return image_error(f"{param}: the image {got}; this server takes at most {max_pixels} pixels per image "
                       "(max_image_pixels)", param, "image_too_large")


def _read_at_most(fd: int, limit: int) -> bytes:
    data = bytearray()
    while len(data) < limit and (chunk := os.read(fd, min(_READ_CHUNK << 4, limit - len(data)))):
        data += chunk
    return bytes(data)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _show_url(url: str) -> str:
    """A URL for an error message: a data URL's header only, anything capped."""
    if url.lower().startswith("data:"):
        return url.split(",", 1)[0] + ",..."
    return repr(url if len(url) <= 120 else url[:117] + "...")



def chat_image_refs(messages: Sequence[Any]) -> list[ImageRef]:
    """The image parts of chat messages (`service.openai.protocol.ChatMessage`), in prompt order."""
    return [ImageRef(part.image_url.url, f"messages[{i}].content[{j}].image_url", part.image_url.detail)
            for i, message in enumerate(messages) for j, part in message.image_parts()]
