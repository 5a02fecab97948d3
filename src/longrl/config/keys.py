"""The dotted keys of the config tree: listing them, suggesting one for a misspelt or TRL name, and comparing a
checkpoint's saved config with the current one (which keys a resumed run may change)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
import typing

from .schema import Config
from .trl_names import SFT_NAMES, TRL_NAMES


# ----------------------------------------------------------------------------- resuming

# keys a resumed run may change: how long it runs, where and how it reports, and how fast or in how much memory it
# computes the same steps; every other key decides the run's trajectory (data, model, adapters, optimizer, loss,
# sampling) and must stay what the checkpoint was trained with
RESUMABLE_CHANGES = ("train.max_steps", "sft.num_train_epochs", "output.", "generation.backend",
                     "generation.cuda_graphs", "generation.kv_cache_gib", "generation.kv_cache_dtype",
                     "generation.sync_every", "generation.min_decode_batch", "train.gpu_memory_gib",
                     "train.cpu_threads", "generation.fast_decode", "generation.fuse_lora", "generation.nf4_kernel", "generation.nf4_halves",
                     "generation.pack_projections",
                     "generation.speculative", "generation.max_draft_tokens", "generation.speculative_schedule",
                     "train.micro_batch_tokens", "train.micro_batch_size", "train.logprob_chunk_size",
                     "train.mlp_tile_tokens", "model.device", "model.offload_activations",
                     "model.gpu_resident_layers", "model.no_recompute_layers", "model.sdpa_backends",
                     "model.grouped_attention_backward", "model.reuse_attention", "model.attn_implementation",
                     "model.gradient_checkpointing", "model.fused_layers", "lora.fused_training",
                     "train.padding_free", "train.shared_prompt", "data.eval_source", "data.eval_split",
                     "data.eval_num_examples", "data.max_image_pixels", "train.max_nonfinite_steps",
                     "train.max_no_signal_steps", "environment.max_reset_failure_share", "rewards[].timeout_s",
                     "rewards[].isolation", "rewards[].memory_limit_gib", "rewards[].cpu_limit_s",
                     "grpo.reference_placement", "distributed.")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):  # rewards: rewards[i].key
            for i, x in enumerate(v):
                out.update(_flat(x, f"{prefix}{k}[{i}]."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_conflicts(saved: dict, cfg: Config) -> list[str]:
    """'key: saved → now' for each key outside RESUMABLE_CHANGES whose value differs between the config a
    checkpoint was trained with (``saved``, as stored in its JSON state) and ``cfg``. A key the saved config lacks
    (added to longrl after the checkpoint was written) counts as its default, the behaviour the run had."""
    defaults = _flat(json.loads(json.dumps(Config().to_dict())))
    before, now = _flat(saved), _flat(json.loads(json.dumps(cfg.to_dict())))
    before.update({k: defaults[k] for k in now if k not in before and k in defaults})
    return [f"{k}: {before.get(k)!r} → {now.get(k)!r}" for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k) and not any(
                re.sub(r"\[\d+\]", "[]", k) == a or (a.endswith(".") and k.startswith(a)) for a in RESUMABLE_CHANGES)]


# ----------------------------------------------------------------------------- key names and suggestions

@functools.lru_cache(maxsize=None)
def config_keys(cls=None, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of the tree below ``cls`` (``Config``): its leaves, with ``rewards`` as one key."""
    out = []
    for f in dataclasses.fields(cls or Config):
        tp = typing.get_type_hints(cls or Config)[f.name]
        if dataclasses.is_dataclass(tp):
            out += config_keys(tp, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return tuple(out)


def trl_key(name: str, names: dict | None = None) -> str | None:
    """The dotted key TRL's flat field ``name`` sets in this tree (``names``: ``longrl.config.trl_names.TRL_NAMES``, or
    ``TRL_SFT_NAMES``), or None: the name is not TRL's, or its longrl key is not in this version (then found by its
    leaf name if that is unique)."""
    entry = (TRL_NAMES if names is None else names).get(name)
    if entry is None or entry.key is None:
        return None
    keys = config_keys()
    if entry.key in keys:
        return entry.key
    leaf = entry.key.rsplit(".", 1)[-1]
    same = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    return same[0] if len(same) == 1 else None


def suggest_key(path: str) -> str:
    """'did you mean train.learning_rate?' for an unknown key: a TRL flat name, a key of another section, or a
    near miss; '' when nothing is close."""
    leaf = path.rsplit(".", 1)[-1]
    keys = config_keys()
    table = TRL_NAMES if leaf in TRL_NAMES else SFT_NAMES
    if leaf in table:
        entry, key = table[leaf], trl_key(leaf, table)
        note = f": {entry.note}" if entry.note else ""
        if key is None:
            return f"TRL's {leaf} has no longrl key{note or ': not in this version of longrl'}"
        shown = "rewards[i].weight" if key == "rewards" else key
        return f"did you mean {shown}? (TRL's {leaf}{note})"
    elsewhere = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != path]
    if elsewhere:
        return f"did you mean {' or '.join(elsewhere)}?"
    leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
    close = difflib.get_close_matches(path, keys, n=1, cutoff=0.8) or \
        [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.8)]
    return f"did you mean {close[0]}?" if close else ""
