"""Write a merged Llama-family model (Llama, Mistral, Qwen2, Qwen3) as one GGUF file with llama.cpp's ``gguf``
package: hyperparameters, tensors under their GGUF names (``gguf.TensorNameMap``) in f16 or q8_0, the
tokenizer and the chat template.

Conventions follow llama.cpp's ``convert_hf_to_gguf.py``: for the ``llama`` architecture the q/k projection
rows are permuted from Hugging Face's rotary layout (rotate-half) to llama.cpp's interleaved one; 1-D tensors and
norms are float32; a tensor whose rows q8_0 cannot split into 32-blocks falls back to f16; Llama 3 rope scaling
becomes a ``rope_freqs`` tensor; a tied LM head is left out (llama.cpp reuses the token embedding).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

QUANTS = ("f16", "q8_0")
# Hugging Face model_type -> GGUF architecture name (gguf.MODEL_ARCH_NAMES)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class UnsupportedArchitecture(ValueError):
    """The model's architecture has no GGUF mapping here; the message names it."""


def gguf_arch(config) -> str:
    """The GGUF architecture of a transformers config, or :class:`UnsupportedArchitecture` naming it."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "?"
        raise UnsupportedArchitecture(
            f"GGUF export does not support architecture {model_type!r} ({archs}); supported model types: "
            f"{', '.join(ARCHITECTURES)}")
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        raise UnsupportedArchitecture(f"GGUF export does not support rope type {rope['rope_type']!r} of "
                                      f"{model_type!r} (supported: default, linear, llama3)")
    if rope.get("rope_type") == "llama3" and ARCHITECTURES[model_type] != "llama":
        raise UnsupportedArchitecture(f"rope type 'llama3' on a {model_type!r} model has no GGUF equivalent here")
    return ARCHITECTURES[model_type]


def _rope_parameters(config) -> dict:
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    rope.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return rope


def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias) from HF's rotate-half order to llama.cpp's interleaved rotary order."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of :func:`permute_qk`."""
    return weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _llama3_rope_factors(config, rope: dict) -> torch.Tensor:
    dim = _head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def gguf_tensors(model, arch: str):
    """(GGUF name, float32 tensor) for every weight of a merged causal LM, q/k permuted for ``llama``."""
    import gguf

    config = model.config
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    rope = _rope_parameters(config)
    if rope.get("rope_type") == "llama3":
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", _llama3_rope_factors(config, rope)
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedArchitecture(f"tensor {hf_name!r} of a {config.model_type!r} model has no GGUF name")
        data = tensor.detach().to("cpu", torch.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute_qk(data, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute_qk(data, config.num_key_value_heads or config.num_attention_heads)
        yield name, data


def _quantize(name: str, data: np.ndarray, quant: str):
    import gguf

    if data.ndim <= 1 or name.endswith("_norm.weight"):
        qtype = gguf.GGMLQuantizationType.F32
    else:
        qtype = gguf.GGMLQuantizationType.Q8_0 if quant == "q8_0" else gguf.GGMLQuantizationType.F16
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # rows not divisible into q8_0 blocks
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def write_gguf(path: Path, model, tokenizer, quant: str = "f16", name: str = "model", plan=None) -> None:
    """Write the merged ``model`` (a transformers causal LM) and ``tokenizer`` to ``path``; ``plan``: the
    tokenizer's :class:`~longrl.export.gguf_vocab.VocabPlan` (decided here when not given)."""
    import gguf

    from .gguf_vocab import add_tokenizer, vocab_plan

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}; got {quant!r}")
    config = model.config
    arch = gguf_arch(config)
    plan = plan or vocab_plan(tokenizer)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant == "q8_0" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = _rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    head_dim = _head_dim(config)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    n_vocab = model.get_input_embeddings().weight.shape[0]
    writer.add_vocab_size(n_vocab)
    add_tokenizer(writer, tokenizer, n_vocab, plan)
    for gguf_name, data in gguf_tensors(model, arch):
        array, qtype = _quantize(gguf_name, data.numpy(), quant)
        writer.add_tensor(gguf_name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
