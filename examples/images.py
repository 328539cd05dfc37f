"""An image in a chat request, sent inline as a base64 data URL.

Works only against a vision-language model (Qwen2-VL, Qwen2.5-VL, LLaVA); a text-only model
answers a request with an image with a 400, and this script then says so and exits with status 1.
Serve a vision model, raising the body limit for larger images (see docs/features/images.md):

    .venv/bin/python -m service.launch serve run --address local service.app:build_app model=Qwen/Qwen2-VL-2B-Instruct max_model_len=8192 max_body_bytes=20971520
    .venv/bin/python examples/images.py --model Qwen/Qwen2-VL-2B-Instruct --image cat.png

Without `--image`, the script draws a small picture (three coloured shapes) and sends that.
Without `--model`, it uses the first model the server lists.
"""

from __future__ import annotations

import argparse
import base64
import io
import mimetypes
import os
import sys
from pathlib import Path

import openai


def drawn_png() -> bytes:
    """A 112 x 84 PNG with a red square, a green circle and a blue bar on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (112, 84), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((8, 8, 40, 40), fill="red")
    draw.ellipse((60, 10, 100, 50), fill="green")
    draw.rectangle((8, 60, 104, 74), fill="blue")
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def data_url(path: str | None) -> str:
    """The image as a `data:` URL: the file at `path`, or the drawn picture."""
    if path is None:
        return "data:image/png;base64," + base64.b64encode(drawn_png()).decode()
    mime = mimetypes.guess_type(path)[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", help="the served model name; default: the first one the server lists")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--image", help="a PNG, JPEG, GIF or WebP file; default: a drawn picture")
    parser.add_argument("--prompt", default="What is in this picture?")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model or client.models.list().data[0].id
    content = [{"type": "text", "text": args.prompt},
               {"type": "image_url", "image_url": {"url": data_url(args.image)}}]
    try:
        response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                  max_tokens=args.max_tokens, temperature=0)
    except openai.BadRequestError as e:
        message = e.body.get("message", str(e)) if isinstance(e.body, dict) else str(e)
        sys.exit(f"error: the server refused the request: {message}\n"
                 f"This example needs a vision-language model (Qwen2-VL, Qwen2.5-VL, LLaVA): "
                 f"a text-only model answers an image with a 400. See docs/features/images.md.")
    print(f"answer: {response.choices[0].message.content!r}")
    # The image's tokens count in the prompt: one per merged patch of the resized picture.
    print(f"usage: prompt_tokens={response.usage.prompt_tokens} completion_tokens={response.usage.completion_tokens}")


if __name__ == "__main__":
    try:
        main()
    except openai.APIError as e:  # the server's error message, or why it could not be reached
        sys.exit(f"error: {e} ({e.request.method} {e.request.url})")
