"""Supervised examples with images, for the sft recipe: a vision dataset's rows encoded by the model's processor when
the dataset is read (token ids with the image placeholders expanded, the loss mask), and the image tensors of the
examples a step draws (:func:`example_prompts`), made again each time and dropped with the step, so a large
dataset's pixels are never all in memory.

Where the trained tokens are is read off the template, as for text (data/sft_rows.py), but measured in tokens: the
processor expands each image placeholder into a number of tokens the image's size decides, so character offsets
of the rendering do not name the tokens. A trained span runs from the conversation up to message i rendered with
the generation prompt (nothing for i = 0) to the conversation up to message j rendered without it; each of the two
is encoded with the images its parts hold, and its token ids must be a prefix of the whole conversation's (else the
row is refused, naming it). The span's tokens are trained; image placeholder tokens never are. A row of a vision
dataset without images is encoded the same way (the tokenizer's ids) and trained as text.
"""

from __future__ import annotations

from ..data.errors import DataError
from ..data.image_parts import count_image_parts
from ..data.images import open_images
from ..data.sft_rows import ExampleImages, SFTExample, build_examples
from ..models.vision import VisionPrompt, build_prompt, encode_text, image_token_id
from .vision_inputs import PromptImages


def _spans(row: dict, settings) -> tuple[list[dict], list[tuple[int, int]]]:
    """(the row's conversation, its trained spans (i, j) in messages: see the module's docstring)."""
    if "messages" in row:
        messages = row["messages"]
        if not settings.assistant_only_loss:
            return messages, [(0, len(messages))]
        return messages, [(i, i + 1) for i, m in enumerate(messages) if m["role"] == "assistant"]
    messages = row["prompt"] + row["completion"]
    return messages, [(len(row["prompt"]) if settings.completion_only_loss else 0, len(messages))]


class _Conversation:
    """One conversation's renderings encoded by the processor, each prefix once."""

    def __init__(self, encoder: PromptImages, messages: list[dict], images: list, tools, where: str):
        processor = encoder.processor
        if not getattr(processor, "chat_template", None):
            raise DataError(f"{where}: chat messages need a processor with a chat template")
        self.encoder, self.messages, self.images, self.tools, self.where = encoder, messages, images, tools, where
        self.text = self._render(len(messages), generation=False)
        self.ids, _ = encode_text(processor, encoder.config, self.text, images)  # [L]
        self.lengths: dict[tuple[int, bool], int] = {(len(messages), False): len(self.ids)}

    def _render(self, upto: int, generation: bool) -> str:
        return self.encoder.processor.apply_chat_template(self.messages[:upto], add_generation_prompt=generation,
                                                          tokenize=False, tools=self.tools)

    def length(self, upto: int, generation: bool) -> int:
        """Tokens of ``messages[:upto]`` rendered (with the generation prompt when asked): a prefix of the whole."""
        if upto == 0 and generation:
            return 0
        key = (upto, generation)
        if key not in self.lengths:
            part = self.messages[:upto]
            ids, _ = encode_text(self.encoder.processor, self.encoder.config, self._render(upto, generation),
                                 self.images[:count_image_parts(part)])
            if ids != self.ids[:len(ids)]:
                raise DataError(f"{self.where}: the chat template's rendering of messages 1-{upto} is not a prefix of "
                                "the whole conversation's tokens (the template rewrites earlier turns, or tokens merge "
                                "across the turn's boundary), so the trained tokens cannot be located exactly; set "
                                "sft.assistant_only_loss=false (sft.completion_only_loss=false) to train every token")
            self.lengths[key] = len(ids)
        return self.lengths[key]


def conversation_example(encoder: PromptImages, row: dict, settings, where: str) -> SFTExample:
    """The example of one row of :func:`longrl.data.sft_rows.image_rows` (``messages``, or ``prompt`` and
    ``completion``, with ``images``) under ``settings`` (the ``sft:`` section)."""
    messages, spans = _spans(row, settings)
    sources = row["images"]
    conversation = _Conversation(encoder, messages, open_images(sources), row.get("tools"), where)
    ids = conversation.ids
    mask = [False] * len(ids)
    for i, j in spans:
        start, stop = conversation.length(i, generation=True), conversation.length(j, generation=False)
        mask[start:stop] = [True] * (stop - start)
    token = image_token_id(encoder.config)
    placeholders = [t for t, x in enumerate(ids) if x == token]
    for t in placeholders:
        mask[t] = False  # image tokens are inputs, never predicted
    images = ExampleImages(conversation.text, sources, placeholders[-1] + 1) if sources else None
    return SFTExample(ids, mask, images)


def vision_examples(encoder: PromptImages, rows: list[dict], settings, source: str) -> list[SFTExample]:
    """Every row of :func:`longrl.data.sft_rows.image_rows` as an example, with the overlong policy applied."""
    return build_examples(None, rows, settings, source,
                          encode=lambda row, where: conversation_example(encoder, row, settings, where))


def example_prompts(encoder: PromptImages | None, examples: list[SFTExample]) -> list[VisionPrompt | None] | None:
    """Each example's :class:`VisionPrompt` over its whole (possibly cut) token ids, image tensors made now (None
    for an example without images); None when none has images. Raises when the processor now gives other token ids
    than when the dataset was read."""
    if all(e.images is None for e in examples):
        return None
    out = []
    for e in examples:
        if e.images is None:
            out.append(None)
            continue
        ids, image_inputs = encode_text(encoder.processor, encoder.config, e.images.text, open_images(e.images.sources))
        if ids[:len(e.input_ids)] != e.input_ids:
            raise RuntimeError("an example's images: the processor gave other token ids than when the dataset was read")
        out.append(build_prompt(encoder.config, e.input_ids, image_inputs))
    return out
