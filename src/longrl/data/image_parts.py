"""Chat messages that hold images, in TRL's convention: ``{"type": "image"}`` placeholder parts.

A row with images is given as chat messages whose contents are lists of parts: text parts ``{"type": "text",
"text": ...}`` and one image part ``{"type": "image"}`` per image of the row, the k-th image part standing for the
row's k-th image:
  - a plain-text prompt becomes one user message: an image part per image, then the text;
  - messages without image parts get one image part per image at the start of the first user message;
  - messages that hold image parts must hold exactly as many as the row has images; image parts in a row without
    images are refused the same way (DataError naming the row and both counts).
A string content becomes one text part. Keys that ``datasets`` fills with None when another part has them (e.g.
``{"type": "image", "text": None}``) are dropped. An image part that carries its own image (``"image": "cat.png"``)
is refused: the images come from the row's ``image`` or ``images`` column.
"""

from __future__ import annotations

from ..models.vision.prompt import count_image_parts
from .errors import DataError


def content_type_error(content, where: str) -> DataError:
    """The error for a message content that is neither a string nor a list of parts. A number usually is a string
    the dataset reader converted: a JSON column whose contents mix strings and lists of parts is read as one type."""
    hint = ("; if it was a string in the file, write it as a text part ([{\"type\": \"text\", \"text\": ...}]): "
            "the dataset reader turns such strings into numbers when other messages' contents are lists of parts"
            if isinstance(content, (int, float)) else "")
    return DataError(f"{where}: content must be a string or a list of parts; got {type(content).__name__}{hint}")


def content_parts(content, where: str) -> list[dict] | None:
    """A message's content as a list of text and image parts (None stays None: an assistant turn of tool calls);
    DataError naming the part for anything else."""
    if content is None:
        return None
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise content_type_error(content, where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            inline = sorted(k for k, v in part.items() if k != "type" and v is not None)
            if inline:
                raise DataError(f"{where}: content part {j + 1} is an image part holding {', '.join(inline)}; give "
                                "{'type': 'image'} placeholders and the images in the row's 'image' or 'images' "
                                "column")
            parts.append({"type": "image"})
        else:
            raise DataError(f"{where}: content part {j + 1} is {part!r:.80}; expected a text part {{'type': 'text', "
                            "'text': ...}} or an image part {'type': 'image'}")
    return parts




def place_images(messages: list[dict], num_images: int, where: str, columns: str, images_column: str | None) -> None:
    """Give ``messages`` (contents already lists of parts) one image part per image of the row: inserted at the start
    of the first user message when they hold none, else checked to hold exactly ``num_images``. ``columns`` and
    ``images_column`` name where the messages and the images come from, for the errors."""
    found = count_image_parts(messages)
    if found == num_images:
        return
    if found == 0:
        user = next((m for m in messages if m.get("role") == "user"), None)
        if user is None:
            raise DataError(f"{where}: {columns} holds no user message to put the row's {num_images} image(s) in")
        user["content"] = [{"type": "image"} for _ in range(num_images)] + (user["content"] or [])
        return
    held = (f"{num_images} image(s) in its '{images_column}' column" if num_images else
            "no images (no 'image' or 'images' column holds any)")
    raise DataError(f"{where}: {columns} holds {found} {{'type': 'image'}} part(s) but the row has {held}; give one "
                    "image part per image")
