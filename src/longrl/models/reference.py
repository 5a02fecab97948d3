"""The KL reference of a full-weight run: a frozen copy of the initial weights.

With LoRA the reference policy is the base with the adapters disabled (``policy.reference_mode``: no copy).
Training every weight (lora.enabled=false) moves the base itself, so grpo.beta > 0 needs the initial weights kept
apart: copied once, before the first step. Where the copy lives (grpo.reference_placement; the planner chooses under
auto, memory/planner.py ``ReferenceMemory``):

    gpu   every weight on the training device: base params × b bytes there
    host  the decoder layers' weights in pinned host memory; the rest (embeddings, final norm, LM head, buffers) on
          the device. Layer l's weights are copied into device buffer l mod S (S = PREFETCH_LAYERS + 1 buffers of
          one layer each) on a side stream while layer l − PREFETCH_LAYERS computes; layer l's forward waits for its
          copy through an event (no host sync). One host → device transfer of every layer per reference forward.
    int8  the decoder layers' matrices W [out, in] as int8 codes q = round(W / s), s = max_j |W_ij| / 127 per output
          row (float32), dequantized to q · s in the weights' dtype into the same S buffers on the side stream;
          their vectors (norms, biases) and the rest on the device. Approximate: |W − q s| ≤ s / 2 per weight
          (gpu and host are exact)

The copy's module tree is a deep copy of the policy's as set up for training (layout wrappers, fused layers,
attention implementation), in eval mode, so the reference computes as the initial policy does: at step 0 its
log-probs equal the policy's bit for bit. A streamed layer's parameters are views into its buffer (layer l's into
buffer l mod S, so layers l and l + S alias): a forward pre-hook makes sure the buffer holds layer l's weights before
it runs and a forward hook marks the buffer free after; the layers run in order, each once a forward, as a decoder
stack does. On the CPU the transfer is a copy into the buffer, so the same path runs and is tested.

The reference is rebuilt, not saved: a resumed run loads its model as the run did at its start and copies it again.
:attr:`ReferenceModel.fingerprint` (SHA-256 over the initial state dict) goes into every checkpoint, and
:meth:`ReferenceModel.check_resumed` refuses a resume whose model now loads other initial weights.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from ..config.errors import ConfigError
from .policy import sequence_logprobs
from .structure import base_model, decoder_layers

PLACEMENTS = ("gpu", "host", "int8")
PREFETCH_LAYERS = 2  # layers copied ahead of the one computing (S = PREFETCH_LAYERS + 1 buffers)
_ALIGN = 256  # bytes: where each tensor starts inside a layer buffer (aligned for vectorised kernels)
_HASH_CHUNK = 64 << 20  # bytes hashed per host copy of a tensor


def weights_fingerprint(model) -> str:
    """``sha256:HEX`` over ``model``'s state dict: each tensor's name, dtype, shape and bytes (tensors hashed in
    parallel, in chunks copied to the host)."""
    state = base_model(model).state_dict()

    def digest(t: torch.Tensor) -> str:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [numel × element size]
        h = hashlib.sha256()
        for start in range(0, flat.numel(), _HASH_CHUNK):
            h.update(flat[start:start + _HASH_CHUNK].cpu().numpy())
        return h.hexdigest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        digests = list(pool.map(digest, state.values()))
    total = hashlib.sha256()
    for (name, t), d in zip(state.items(), digests):
        total.update(f"{name}\t{str(t.dtype).removeprefix('torch.')}\t{tuple(t.shape)}\t{d}\n".encode())
    return "sha256:" + total.hexdigest()


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in] int8, scales [out] float32) of a matrix W [out, in]: s = max_j |W_ij| / 127 (1 for a zero
    row), q = round(W / s) in [−127, 127]."""
    w32 = w.detach().float()
    absmax = w32.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    codes = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def int8_dequantized(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · s [out, in] in ``dtype`` (the product in float32, rounded once): the plain twin of the streamed
    dequantization."""
    return (codes.float() * scale[:, None]).to(dtype)


class ReferenceModel:
    """A frozen copy of ``model``'s current weights (a transformers causal LM, not a PEFT model) kept as
    ``placement`` says (module docstring), with its log-probs through :meth:`logprobs`."""

    def __init__(self, model, placement: str, prefetch: int = PREFETCH_LAYERS):
        if placement not in PLACEMENTS:
            raise ValueError(f"reference placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
        if hasattr(model, "peft_config"):
            raise ValueError("a LoRA policy's reference is its base with the adapters disabled (policy.reference_mode)")
        base = base_model(model)
        self.placement = placement
        self.dtype = str(base.get_input_embeddings().weight.dtype).removeprefix("torch.")
        self.fingerprint = weights_fingerprint(base)
        self.device = base.get_output_embeddings().weight.device
        layers = decoder_layers(base) if placement != "gpu" else []
        streamed = [[(n, p) for n, p in layer.named_parameters() if placement == "host" or p.dim() == 2]
                    for layer in layers]  # [L] per layer: the parameters that go through the buffers
        _check_not_shared(base, streamed)
        self.slots = min(prefetch + 1, len(layers))  # S buffers
        self.prefetch = self.slots - 1
        offsets, slot_bytes = _buffer_layout(streamed)
        self._buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.slots)]
        pin = self.device.type == "cuda"  # page-locked host memory: asynchronous copies
        memo, self._sources = {}, []  # memo: source tensor id → its copy; _sources[l]: (copy, what fills it)
        for l, params in enumerate(streamed):
            sources = []
            for (name, p), offset in zip(params, offsets[l]):
                view = self._buffers[l % self.slots][offset:offset + p.numel() * p.element_size()]
                memo[id(p)] = torch.nn.Parameter(view.view(p.dtype).view(p.shape), requires_grad=False)
                if placement == "host":
                    src = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
                    src.copy_(p.detach())
                else:
                    src = int8_rows(p)
                sources.append((memo[id(p)], src))
            self._sources.append(sources)
        for p in base.parameters():
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
        for b in base.buffers():
            memo[id(b)] = b.detach().clone()
        self.model = copy.deepcopy(base, memo).eval()  # the module tree as the policy's, holding the copies
        self.model.requires_grad_(False)
        self._stream = torch.cuda.Stream(self.device) if pin and self._sources else None
        self._ready: list = [None] * len(self._sources)  # [L] events: layer l's weights in its buffer
        self._freed: list = [None] * self.slots  # [S] events: the buffer's last layer has computed
        for l, layer in enumerate(decoder_layers(self.model) if self._sources else []):
            layer.register_forward_pre_hook(partial(self._before_layer, l))
            layer.register_forward_hook(partial(self._after_layer, l))

    # ----------------------------------------------------------------------------------------- streaming
    def _side(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    @torch.no_grad()
    def _fetch(self, l: int) -> None:
        """Fill layer l's buffer with its weights (side stream, after the buffer's previous layer has computed)."""
        with self._side():
            if self._stream is not None and self._freed[l % self.slots] is not None:
                self._stream.wait_event(self._freed[l % self.slots])
            for param, src in self._sources[l]:
                if isinstance(src, torch.Tensor):  # host: a copy from pinned memory
                    param.copy_(src, non_blocking=True)
                else:  # int8: q · s, the product in float32 rounded once to the weights' dtype
                    torch.mul(src[0], src[1][:, None], out=param)
            if self._stream is not None:
                self._ready[l] = torch.cuda.Event()
                self._ready[l].record(self._stream)

    def _before_layer(self, l: int, module, args) -> None:
        if l == 0:  # a new forward: the buffers are free once the compute stream's queued work is done
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            self._freed = [None] * self.slots
            for k in range(min(self.slots, len(self._sources))):
                self._fetch(k)
        elif l + self.prefetch < len(self._sources):
            self._fetch(l + self.prefetch)  # into the buffer layer l − 1 has just finished with
        if self._ready[l] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready[l])

    def _after_layer(self, l: int, module, args, output) -> None:
        if self._stream is not None:
            self._freed[l % self.slots] = torch.cuda.Event()
            self._freed[l % self.slots].record(torch.cuda.current_stream(self.device))

    # ----------------------------------------------------------------------------------------- log-probs
    @torch.no_grad()
    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], width: int,
                 micro_batches: list[list[int]], vision: list | None = None, **kwargs) -> torch.Tensor:
        """[N, width] float32 (on the CPU) log-probs of the completions under the reference, one forward per
        micro-batch (lists of row indices); ``vision``: per sequence its VisionPrompt or None; ``kwargs``:
        :func:`longrl.models.policy.sequence_logprobs`'s."""
        out = torch.zeros(len(prompt_ids), width)
        for idx in micro_batches:
            lp, _ = sequence_logprobs(self.model, [prompt_ids[i] for i in idx], [completion_ids[i] for i in idx],
                                      width, vision=None if vision is None else [vision[i] for i in idx], **kwargs)
            out[idx] = lp.cpu().to(out.dtype)
        return out

    # ----------------------------------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        """What a checkpoint records of the reference (its trainer state's ``kl_reference``)."""
        return {"fingerprint": self.fingerprint, "dtype": self.dtype, "placement": self.placement}

    def check_resumed(self, saved: dict | None, source: str) -> None:
        """ConfigError when a checkpoint's reference (``saved``: its :meth:`state`; None when it recorded none) came
        from other initial weights than the ones loaded now from ``source`` (the words naming the model)."""
        if not saved or saved.get("fingerprint") == self.fingerprint:
            return
        dtypes = (f" (it started in {saved.get('dtype')}, this process loads {self.dtype}: set model.dtype="
                  f"{saved.get('dtype')})" if saved.get("dtype") != self.dtype else "")
        raise ConfigError(f"{source} now loads other initial weights than the run started from{dtypes}: the KL "
                          f"reference of a full-weight run is its initial model, rebuilt at resume "
                          f"({self.fingerprint[:19]}…, the checkpoint's {str(saved.get('fingerprint'))[:19]}…); "
                          "resume with the model the run started from (a hub model: pin model.revision)")


def _buffer_layout(streamed: list[list]) -> tuple[list[list[int]], int]:
    """(byte offsets of each streamed parameter in its layer's buffer, bytes of one buffer: the largest layer's)."""
    offsets, size = [], 0
    for params in streamed:
        at, mine = 0, []
        for _, p in params:
            mine.append(at)
            at += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        offsets.append(mine)
        size = max(size, at)
    return offsets, size


def _check_not_shared(base, streamed: list[list]) -> None:
    """ValueError when a streamed parameter is also reachable elsewhere (tied weights): a buffer holds one layer's
    weights at a time."""
    layer_params = {id(p) for params in streamed for _, p in params}
    seen: dict[int, int] = {}
    for _, p in base.named_parameters(remove_duplicate=False):
        if id(p) in layer_params:
            seen[id(p)] = seen.get(id(p), 0) + 1
    if any(n > 1 for n in seen.values()):
        raise ValueError("a decoder layer's weight is shared with another module: keep the reference whole "
                         "(grpo.reference_placement=gpu)")
