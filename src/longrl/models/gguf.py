"""GGUF files (llama.cpp's and Ollama's model format) as models: ``model.name_or_path: path/model.gguf``.

The file loads through transformers' GGUF support: ``from_pretrained(folder, gguf_file=name)`` with
``GgufConfig(dequantize=True)``, so every tensor is unpacked from its blocks (Q4_0, Q4_1, Q8_0, the K-quants, F16:
w = d·q (+ m) per block, the values llama.cpp computes with) and cast to the run's dtype. The result is a plain
transformers model that trains, samples, saves and exports like one loaded from safetensors; its config comes from
the file's ``general.architecture`` and ``<arch>.*`` metadata, its tokenizer and chat template from
``tokenizer.ggml.*`` and ``tokenizer.chat_template``.

Reading needs the ``gguf`` package (``pip install -e ".[export]"`` in a checkout, ``longrl[export]`` from the
registry). A checkpoint of a run on a GGUF base records the file (absolute path, size, SHA-256:
:func:`gguf_record`), so export and ``longrl generate`` reload that same file, or refuse one that changed.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch

from .files import file_sha256

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = 'pip install -e ".[export]" in a longrl checkout, or pip install "longrl[export]"'


class GgufError(ValueError):
    """A GGUF file that cannot be a model; the message names the file."""


def is_gguf(name_or_path: str) -> bool:
    """Whether a model reference names a GGUF file (by its suffix: a hub id or a directory never ends in .gguf)."""
    return isinstance(name_or_path, str) and name_or_path.lower().endswith(".gguf")


def check_gguf_file(path: str | Path) -> Path:
    """The file's resolved path, after the checks that need no parsing: it exists, is a file, starts with the GGUF
    magic bytes, and the ``gguf`` package that reads it is installed. Raises :class:`GgufError` naming the file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise GgufError(f"GGUF file not found: {path}")
    if not p.is_file():
        raise GgufError(f"{path} is not a file (a GGUF model is one .gguf file)")
    with open(p, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise GgufError(f"{path} is not a GGUF file: it starts with {head[:4]!r}, not {GGUF_MAGIC!r}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GgufError(f"reading {path} needs the gguf package: {INSTALL_HINT}") from None
    return p.resolve()


def _folder_and_name(path: Path) -> tuple[str, str]:
    return str(path.parent), path.name


def gguf_model_config(path: str | Path):
    """The transformers config the file describes (its metadata only, no tensors)."""
    from transformers import AutoConfig

    p = check_gguf_file(path)
    folder, name = _folder_and_name(p)
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # ValueError (an architecture transformers cannot convert), a truncated file's errors
        raise GgufError(f"{path}: transformers cannot read it as a model: {type(e).__name__}: {str(e)[:300]}") from e


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer (with its chat template) stored in the file's metadata."""
    from transformers import AutoTokenizer

    p = check_gguf_file(path)
    folder, name = _folder_and_name(p)
    try:
        import gguf

        fields = gguf.GGUFReader(str(p)).fields  # the metadata, parsed once (token lists included)
        ids = _special_token_ids(fields)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except AttributeError as e:
            # transformers 5.17 reads a Llama-family vocabulary's BOS id even where the file names none: read a
            # copy of the metadata that names one (the EOS), then take it away again
            if "bos_token_id" not in str(e) or "bos" in ids:
                raise
            with tempfile.TemporaryDirectory() as tmp:
                _metadata_copy(p, Path(tmp) / name, {SPECIAL_TOKEN_KEYS["bos"]: ids.get("eos", 0)})
                tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=name)
            tokenizer.bos_token = None
    except Exception as e:
        raise GgufError(f"{path}: its tokenizer cannot be read: {type(e).__name__}: {str(e)[:300]}") from e
    _set_special_tokens(tokenizer, ids)
    check_pre_tokenizer(str(path), _string_field(fields, "tokenizer.ggml.model"),
                        _string_field(fields, "tokenizer.ggml.pre"), tokenizer)
    return tokenizer


def _string_field(fields: dict, key: str) -> str | None:
    field = fields.get(key)
    return None if field is None else str(field.contents())


def check_pre_tokenizer(name: str, model: str | None, pre: str | None, tokenizer) -> None:
    """Raise GgufError when a byte-level ("gpt2") vocabulary whose file names a known llama.cpp pre-tokenizer
    (gpt-2, llama-bpe, qwen2) was read with another split or merge rule: transformers 5.17 reads a qwen2 vocabulary
    with GPT-2's split and its texts tokenize differently from llama.cpp's and the model's training."""
    from .byte_level_splits import PRE_TOKENIZER_RULES, UnsupportedTokenizer, byte_level_pre, tokenizer_json

    if model != "gpt2" or pre not in PRE_TOKENIZER_RULES:
        return
    tj = tokenizer_json(tokenizer)
    try:
        got = byte_level_pre(tj)
    except UnsupportedTokenizer as e:
        got = (f"none of llama.cpp's ({e})", None)
    got = (got[0], bool(tj.get("model", {}).get("ignore_merges")))
    want = PRE_TOKENIZER_RULES[pre]
    if got != want:
        import transformers

        raise GgufError(f"{name}: its vocabulary tokenizes with llama.cpp's {pre!r} pre-tokenizer (ignore_merges="
                        f"{want[1]}), but transformers {transformers.__version__} read it as {got[0]!r} "
                        f"(ignore_merges={got[1]}): texts would tokenize differently from the model's training. "
                        "transformers 5.25 reads it exactly (pip install -U transformers)")


def _metadata_copy(path: Path, out: Path, set_ints: dict[str, int]) -> None:
    """A GGUF at ``out`` with ``path``'s metadata (no tensors), the uint32 keys ``set_ints`` set."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in set_ints:
            continue  # the header's own fields, written by the writer
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for key, value in set_ints.items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


SPECIAL_TOKEN_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                      "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


def _special_token_ids(fields: dict) -> dict[str, int]:
    """The special token ids a file's metadata ``fields`` (GGUFReader.fields) name (bos, eos, unk, pad; those
    present)."""
    found = {}
    for role, key in SPECIAL_TOKEN_KEYS.items():
        field = fields.get(key)
        if field is not None and field.data:
            found[role] = int(field.parts[field.data[0]][0])
    return found


def _set_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    """Make the tokenizer's special tokens the ones the file names (transformers before 5.2x took the EOS of some
    files from the wrong id: SmolLM2's <|im_start|> instead of <|im_end|>, so completions would never stop)."""
    vocab = len(tokenizer)
    for role, token_id in ids.items():
        if 0 <= token_id < vocab and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


def load_gguf_model(path: str | Path, dtype: torch.dtype, attn_implementation: str | None = None):
    """The file's model, every tensor dequantized and cast to ``dtype`` (a plain transformers model, no GGUF
    quantizer attached: it saves, merges and exports as any other), with ``longrl_gguf`` = :func:`gguf_record`."""
    from transformers import AutoModelForCausalLM

    p = check_gguf_file(path)
    folder, name = _folder_and_name(p)
    try:
        from transformers import GgufConfig

        unpack = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # transformers without GgufConfig dequantizes every GGUF file anyway
        unpack = {}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                     attn_implementation=attn_implementation, **unpack)
    except Exception as e:
        raise GgufError(f"{path}: transformers cannot load it as a causal LM: {type(e).__name__}: "
                        f"{str(e)[:300]}") from e
    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        raise GgufError(f"{path}: transformers kept its weights packed in GGUF blocks; this version of "
                        "transformers cannot dequantize it (GgufConfig(dequantize=True))")
    model.longrl_gguf = gguf_record(p)
    return model


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) → SHA-256: each file version hashed once


def gguf_record(path: str | Path) -> dict:
    """What a checkpoint records of a GGUF base so that the same file is found and recognised again: its absolute
    path, size in bytes and SHA-256 (hashed once per file version in a process: an export checks the recorded file,
    then loads it)."""
    p = Path(path).resolve()
    stat = p.stat()
    key = (str(p), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = file_sha256(p)
    return {"path": str(p), "bytes": stat.st_size, "sha256": _DIGESTS[key]}


def recorded_gguf(name_or_path: str, record: dict | None) -> str:
    """The GGUF file a checkpoint's base is: the configured path when it exists (else the absolute path the
    checkpoint recorded, e.g. a relative path read from another working directory), checked against the record's
    size and SHA-256. Raises :class:`GgufError` when neither exists or the file is not the one trained on."""
    if not record:
        return name_or_path
    candidates = [name_or_path, record.get("path")]
    found = next((c for c in candidates if c and Path(c).expanduser().is_file()), None)
    if found is None:
        raise GgufError(f"the run's GGUF base {name_or_path} is not found (recorded at {record.get('path')}); "
                        "put the file back there")
    p = Path(found).expanduser()
    if os.path.getsize(p) != record.get("bytes") or gguf_record(p)["sha256"] != record.get("sha256"):
        raise GgufError(f"the run's GGUF base {found} is not the file it trained on (size or SHA-256 differ from "
                        f"the checkpoint's record: {record.get('bytes')} bytes, sha256 {record.get('sha256')})")
    return str(p)


__all__ = ["GgufError", "INSTALL_HINT", "check_gguf_file", "gguf_model_config", "gguf_record", "is_gguf",
           "load_gguf_model", "load_gguf_tokenizer", "recorded_gguf"]
