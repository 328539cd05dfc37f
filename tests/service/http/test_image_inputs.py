"""Images in requests, the edge's side alone (service/http/images.py and the request models): where
an image URL may point, the limits, decoding, and each API family's image parts becoming the chat
request's `image_url` parts in order. No model here: tests/service/http/test_image_api.py sends images to a
vision model with the official clients."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from service.anthropic.protocol import MessagesRequest
from service.errors import APIError
from service.http.images import ImageLimits, ImageLoader, ImageRef, chat_image_refs, decode_image
from service.openai.protocol import ChatCompletionRequest
from service.openai.responses import chat_request
from service.openai.responses_protocol import ResponsesRequest

PARAM = "messages[0].content[1].image_url"


def png(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 30, 90), fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, fmt)
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """The signature, an IHDR chunk saying `width` x `height` (8-bit grey) and IEND: no pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def load(url: str, limits: ImageLimits | None = None, detail: str = "auto") -> Image.Image:
    return ImageLoader(limits or ImageLimits()).load(ImageRef(url, PARAM, detail))


def refused(url: str, limits: ImageLimits | None = None, code: str | None = None, says: str = "") -> APIError:
    with pytest.raises(APIError) as info:
        load(url, limits)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error" and err.param == PARAM, err.body()
    assert code is None or err.code == code, err.body()
    assert says in err.message, err.message
    return err


# ---- data URLs, decoding, limits ------------------------------------------------------------------

def test_a_data_url_decodes_to_its_pixels() -> None:
    image = load(data_url(png(8, 6)))
    assert image.size == (8, 6) and image.getpixel((3, 2)) == (200, 30, 90)
    jpeg = load(data_url(png(16, 16, fmt="JPEG"), "image/jpeg"))
    assert jpeg.size == (16, 16) and jpeg.format == "JPEG"


def test_detail_low_scales_a_large_image_to_fit_512() -> None:
    assert load(data_url(png(1024, 256)), detail="low").size == (512, 128)
    assert load(data_url(png(1024, 256)), detail="high").size == (1024, 256)
    assert load(data_url(png(100, 50)), detail="low").size == (100, 50)  # never scaled up


@pytest.mark.parametrize("url, code, says", [
    ("data:text/plain;base64,aGVsbG8=", "invalid_image_url", "'text/plain'"),
    ("data:image/png,rawbytes", "invalid_image_url", "base64"),
    ("data:image/png;base64,not*base64!", "invalid_image", "base64"),
    (data_url(b"GIF89a but not really an image"), "invalid_image", "cannot be decoded"),
    (data_url(b"hello, this is text"), "invalid_image", "cannot be decoded"),
    (data_url(png()[:40]), "invalid_image", "cannot be decoded"),  # a truncated PNG
    ("ftp://example.com/a.png", "invalid_image_url", "data:image"),
    ("a.png", "invalid_image_url", "data:image"),
])
def test_what_is_not_an_image_is_a_400(url: str, code: str, says: str) -> None:
    refused(url, code=code, says=says)


def test_formats_other_than_png_jpeg_webp_gif_are_not_opened() -> None:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, "TIFF")
    refused(data_url(out.getvalue(), "image/tiff"), code="invalid_image", says="PNG, JPEG, WebP and GIF")
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, "BMP")
    refused(data_url(out.getvalue(), "image/bmp"), code="invalid_image")


def test_an_animated_image_is_refused() -> None:
    out = io.BytesIO()
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    refused(data_url(out.getvalue(), "image/gif"), says="animated")
    still = io.BytesIO()
    frames[0].save(still, "GIF")
    assert load(data_url(still.getvalue(), "image/gif")).size == (4, 4)


def test_bytes_per_image_is_a_400_naming_the_limit() -> None:
    data = png(64, 64)
    limits = ImageLimits(max_image_bytes=len(data) - 1)
    err = refused(data_url(data), limits, "image_too_large", "max_image_bytes")
    assert f"is {len(data)} bytes" in err.message
    assert load(data_url(data), ImageLimits(max_image_bytes=len(data))).size == (64, 64)  # the bound itself is in
    huge = "data:image/png;base64," + "A" * (4 << 20)  # refused from its length, before it is decoded
    refused(huge, ImageLimits(max_image_bytes=1 << 20), "image_too_large", "at most 1048576 bytes")


def test_pixels_per_image_is_checked_from_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    data = png(300, 200)
    err = refused(data_url(data), ImageLimits(max_image_pixels=300 * 200 - 1), "image_too_large", "max_image_pixels")
    assert "300x200 (60000 pixels)" in err.message
    assert load(data_url(data), ImageLimits(max_image_pixels=300 * 200)).size == (300, 200)
    decoded = []  # refused before its pixels are decoded (Image.open read the header only)
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self) or None)
    with pytest.raises(APIError):
        decode_image(data, PARAM, 100)
    assert decoded == []


def test_a_decompression_bomb_is_a_400_not_a_warning_or_a_500(recwarn: pytest.WarningsRecorder) -> None:
    # A PNG whose header says 20000 x 20000 (400 M pixels, past Pillow's own bound of ~179 M) and that
    # holds almost nothing: refused from its header by either check.
    err = refused(data_url(png_header_only(20000, 20000)), ImageLimits(), "image_too_large", "max_image_pixels")
    assert "20000x20000" in err.message or "too many pixels" in err.message
    saved = Image.MAX_IMAGE_PIXELS
    try:  # Pillow's own check first (its bound lowered): its error is the same 400
        Image.MAX_IMAGE_PIXELS = 1000
        with pytest.raises(APIError) as info:
            decode_image(png(100, 100), PARAM, 1 << 30)
        assert info.value.status == 400 and "max_image_pixels" in info.value.message
    finally:
        Image.MAX_IMAGE_PIXELS = saved
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def test_a_larger_pixel_limit_raises_pillows_own_bound() -> None:
    saved = Image.MAX_IMAGE_PIXELS
    try:
        ImageLoader(ImageLimits(max_image_pixels=saved * 3))
        assert Image.MAX_IMAGE_PIXELS == saved * 3  # else Pillow would refuse images the limit allows
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def test_images_per_request_is_a_400_naming_the_limit() -> None:
    loader = ImageLoader(ImageLimits(max_images=2))
    refs = [ImageRef(data_url(png()), f"messages[0].content[{k}].image_url") for k in range(3)]
    with pytest.raises(APIError) as info:
        asyncio.run(loader.load_all(refs))
    err = info.value
    assert err.status == 400 and err.code == "too_many_images" and err.param == "messages"
    assert "3 images" in err.message and "at most 2" in err.message and "limit_mm_per_prompt" in err.message
    images = asyncio.run(loader.load_all(refs[:2]))
    assert [im.size for im in images] == [(8, 6), (8, 6)]


def test_load_all_keeps_the_order_and_runs_off_the_event_loop() -> None:
    loader = ImageLoader(ImageLimits())
    threads = []
    real = loader.load

    def spy(ref: ImageRef) -> Image.Image:
        threads.append(threading.current_thread())
        return real(ref)

    loader.load = spy  # type: ignore[method-assign]
    refs = [ImageRef(data_url(png(w, 5)), f"p{w}") for w in (3, 9, 4)]
    images = asyncio.run(loader.load_all(refs))
    assert [im.size[0] for im in images] == [3, 9, 4]
    assert threads and all(t is not threading.main_thread() for t in threads)


# ---- file:// ------------------------------------------------------------------------------------

@pytest.fixture()
def media(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(png(5, 7))
    (tmp_path / "secret.png").write_bytes(png(2, 2))
    (root / "link.png").symlink_to(tmp_path / "secret.png")  # a link out of the directory
    (root / "inner.png").symlink_to(root / "sub" / "cat.png")  # a link that stays inside
    (root / "outside").symlink_to(tmp_path)  # a directory link out
    return root


def test_file_urls_are_refused_without_an_allowed_directory(media: Path) -> None:
    refused(f"file://{media}/sub/cat.png", ImageLimits(), "image_url_not_allowed", "allowed_local_media_path")


def test_file_urls_read_only_under_the_allowed_directory(media: Path) -> None:
    limits = ImageLimits(allowed_local_media_path=str(media))
    assert load(f"file://{media}/sub/cat.png", limits).size == (5, 7)
    assert load(f"file://localhost{media}/inner.png", limits).size == (5, 7)
    assert load(f"file://{media}/sub/%63at.png", limits).size == (5, 7)  # percent-escapes decoded
    for url in (f"file://{media}/../secret.png", f"file://{media}/sub/../../secret.png", f"file://{media}/link.png",
                f"file://{media}/outside/secret.png", f"file://{media.parent}/secret.png", "file:///etc/passwd",
                f"file://{media}/%2e%2e/secret.png"):
        err = refused(url, limits, "image_url_not_allowed", "outside")
        assert str(media) not in err.message.replace(url, "")  # the allowed directory is not given away
    refused(f"file://{media}/sub/none.png", limits, "invalid_image", "cannot read")
    refused(f"file://{media}/sub", limits, "invalid_image")  # a directory
    refused(f"file://otherhost{media}/sub/cat.png", limits, "invalid_image_url", "absolute path")
    refused("file:relative/cat.png", limits, "invalid_image_url")


def test_a_local_file_over_the_byte_limit_is_refused_before_it_is_read(media: Path) -> None:
    limits = ImageLimits(allowed_local_media_path=str(media), max_image_bytes=10)
    refused(f"file://{media}/sub/cat.png", limits, "image_too_large", "max_image_bytes")


def test_the_allowed_directory_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        ImageLoader(ImageLimits(allowed_local_media_path=str(tmp_path / "nope")))


# ---- http(s):// ---------------------------------------------------------------------------------

class _Images(http.server.BaseHTTPRequestHandler):
    body = png(6, 4)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            self._send(200, self.body)
        elif self.path == "/big.png":
            self._send(200, b"\x89PNG" + b"\0" * 5000)
        elif self.path == "/chunked.png":  # no Content-Length: counted as it arrives
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"1000\r\n" + b"\0" * 4096 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.example/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow.png":
            threading.Event().wait(3)
            self._send(200, self.body)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_web_urls_are_refused_without_allowed_domains(web: str) -> None:
    refused(f"{web}/cat.png", ImageLimits(), "image_url_not_allowed", "allowed_media_domains")
    refused("https://example.com/cat.png", ImageLimits(), "image_url_not_allowed", "data:image/")
    refused(f"{web}/cat.png", ImageLimits(allowed_media_domains=("example.com",)), "image_url_not_allowed",
            "'127.0.0.1' is not among")
    # The host is the URL's real host, not a name put before an @
    refused(f"http://127.0.0.1@example.com:{web.rsplit(':', 1)[1]}/cat.png",
            ImageLimits(allowed_media_domains=("127.0.0.1",)), "image_url_not_allowed")


def test_web_urls_of_allowed_domains_are_fetched_within_bounds(web: str) -> None:
    limits = ImageLimits(allowed_media_domains=("127.0.0.1",), max_image_bytes=4096, fetch_timeout_s=1.0)
    assert load(f"{web}/cat.png", limits).size == (6, 4)
    refused(f"{web}/big.png", limits, "image_too_large", "max_image_bytes")
    refused(f"{web}/chunked.png", limits, "image_too_large", "max_image_bytes")
    refused(f"{web}/missing.png", limits, "image_fetch_failed", "HTTP 404")
    refused(f"{web}/moved", limits, "image_fetch_failed", "redirects are not followed")
    refused(f"{web}/slow.png", limits, "image_fetch_failed", "within 1 s (image_fetch_timeout_s)")
    refused("http://127.0.0.1:9/cat.png", limits, "image_fetch_failed", "failed")  # nothing listens there


# ---- each API's image parts --------------------------------------------------------------------

def _chat(content: Any, role: str = "user") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": role, "content": content}]})


def test_chat_image_parts_reach_the_template_as_image_parts_in_order() -> None:
    req = _chat([{"type": "text", "text": "A"}, {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
                 {"type": "text", "text": "B"}, {"type": "image_url", "image_url": {"url": "data:y"}}])
    assert req.messages[0].template_dict()["content"] == [
        {"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"}, {"type": "image"}]
    refs = chat_image_refs(req.messages)
    assert [(r.url, r.detail, r.param) for r in refs] == [
        ("data:x", "low", "messages[0].content[1].image_url"), ("data:y", "auto", "messages[0].content[3].image_url")]
    text_only = _chat([{"type": "text", "text": "A"}, {"type": "text", "text": "B"}])
    assert text_only.messages[0].template_dict()["content"] == "AB" and chat_image_refs(text_only.messages) == []


@pytest.mark.parametrize("content, role, says", [
    ([{"type": "image_url"}], "user", "image_url"),
    ([{"type": "image_url", "image_url": "data:x"}], "user", "image_url"),
    ([{"type": "image_url", "image_url": {"url": "data:x", "detail": "max"}}], "user", "image_url"),
    ([{"type": "input_audio", "input_audio": {}}], "user", "'input_audio'"),
    ([{"type": "image_url", "image_url": {"url": "data:x"}}], "system", "user and tool messages"),
    ([{"type": "image_url", "image_url": {"url": "data:x"}}], "assistant", "user and tool messages"),
])
def test_bad_chat_image_parts_are_refused(content: Any, role: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _chat(content, role)


def test_an_image_may_be_in_a_tool_message() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": "data:z"}}]}]})
    assert [r.param for r in chat_image_refs(req.messages)] == ["messages[2].content[0].image_url"]


def _anthropic(content: Any) -> ChatCompletionRequest:
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": content})
    return ChatCompletionRequest.model_validate(req.chat_fields())


def test_anthropic_image_blocks_become_image_parts() -> None:
    chat = _anthropic([{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                         "data": "iVBO"}},
        {"type": "text", "text": "and "}, {"type": "image", "source": {"type": "url", "url": "https://a/b.png"}}]}])
    assert [r.url for r in chat_image_refs(chat.messages)] == ["data:image/png;base64,iVBO", "https://a/b.png"]
    assert chat.messages[0].template_dict()["content"] == [
        {"type": "text", "text": "What is "}, {"type": "image"}, {"type": "text", "text": "and "}, {"type": "image"}]


def test_anthropic_images_in_a_tool_result_go_to_the_tool_message() -> None:
    chat = _anthropic([
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": [
                {"type": "text", "text": "partial"}, {"type": "text", "text": "view"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/webp", "data": "UklG"}}]},
            {"type": "text", "text": "Describe it."}]}])
    tool = chat.messages[2]
    assert tool.role == "tool" and tool.tool_call_id == "t1"
    assert tool.template_dict()["content"] == [{"type": "text", "text": "Error: "}, {"type": "text", "text": "partial"},
                                               {"type": "text", "text": "\nview"}, {"type": "image"}]
    assert [r.url for r in chat_image_refs(chat.messages)] == ["data:image/webp;base64,UklG"]
    assert chat.messages[3].template_dict()["content"] == "Describe it."
    text_result = _anthropic([
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}])
    assert text_result.messages[2].content == "a\nb"  # text only: as before


@pytest.mark.parametrize("block, says", [
    ({"type": "image", "source": {"type": "file", "file_id": "f1"}}, "Files API"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "x"}}, "image/jpeg"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, "data"),
    ({"type": "image", "source": {"type": "url"}}, "url"),
    ({"type": "image", "source": {}}, "source must be"),
    ({"type": "document", "source": {}}, "'document'"),
])
def test_bad_anthropic_image_blocks_are_refused(block: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5,
                                        "messages": [{"role": "user", "content": [block]}]})


def test_an_assistant_message_may_not_hold_an_image() -> None:
    with pytest.raises(ValueError, match="image block cannot be in a assistant message|cannot be in"):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "https://a"}}]},
            {"role": "user", "content": "y"}]})


def test_responses_input_images_become_image_parts() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Look: "},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBO", "detail": "low"}]}]})
    chat = chat_request(req, req.input)
    assert [(r.url, r.detail) for r in chat_image_refs(chat.messages)] == [("data:image/png;base64,iVBO", "low")]
    assert chat.messages[0].template_dict()["content"] == [{"type": "text", "text": "Look: "}, {"type": "image"}]
    output = ResponsesRequest.model_validate({"model": "m", "input": [
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    chat = chat_request(output, output.input)
    assert chat.messages[-1].role == "tool" and len(chat_image_refs(chat.messages)) == 1


@pytest.mark.parametrize("part, says", [
    ({"type": "input_image", "file_id": "file-1"}, "file_id is not supported"),
    ({"type": "input_image"}, "image_url is required"),
    ({"type": "input_image", "image_url": "data:x", "detail": "max"}, "detail"),
    ({"type": "input_file", "file_id": "x"}, "'input_file'"),
])
def test_bad_responses_image_parts_are_refused(part: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ResponsesRequest.model_validate({"model": "m", "input": [{"role": "user", "content": [part]}]})


def test_pillow_and_the_loader_leave_no_file_open(media: Path) -> None:
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    limits = ImageLimits(allowed_local_media_path=str(media))
    for _ in range(20):
        load(f"file://{media}/sub/cat.png", limits)
        with pytest.raises(APIError):
            load(f"file://{media}/link.png", limits)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) <= before + 1
