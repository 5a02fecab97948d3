"""Sequence-tiled MLPs: the untiled computation, one tile's intermediates at a time, the same parameter names."""

import copy
import random

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from longrl.config import ConfigError, LoraConfig, load_config
from longrl.memory import TiledMLP, disable_mlp_tiling, enable_mlp_tiling, enable_offloaded_checkpointing
from longrl.memory.tiling import mlp_tile_tokens
from longrl.models import apply_lora
from longrl.models.policy import reference_mode, sequence_logprobs


def _base(seed=0, layers=2, hidden=32, intermediate=48, act="silu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, hidden_act=act)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _lora(model, r=4, alpha=8, dropout=0.0):
    torch.manual_seed(3)
    model = apply_lora(model, LoraConfig(r=r, alpha=alpha, dropout=dropout))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return model


def _mlp_grads(mlp, x, g, seed=5):
    """(out, x.grad, {param: grad}) of (mlp(x) · g).sum()."""
    x = x.detach().clone().requires_grad_()
    for p in mlp.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = mlp(x)
    (out * g).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("shape, tile", [((2, 37), 5), ((1, 101), 16), ((3, 20), 59), ((1, 64), 64), ((1, 64), 63)])
def test_tiled_equals_untiled_bitwise_when_arithmetic_is_exact(shape, tile):
    """Integer weights and inputs, ReLU, LoRA scale 1: every sum is exact in float32, so any difference in what
    is computed (tile boundaries, a lost or doubled tile, gradient routing) shows, independent of summation order."""
    model = _lora(_base(hidden=8, intermediate=16, act="relu"), r=2, alpha=2)
    gen = torch.Generator().manual_seed(sum(shape) + tile)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, generator=gen).float())
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randint(-1, 2, (*shape, 8), generator=gen).float()  # [b, N, H]
    g = torch.randint(-1, 2, (*shape, 8), generator=gen).float()
    out, gx, gp = _mlp_grads(mlp, x, g)
    tiled = TiledMLP(mlp, tile)
    out_t, gx_t, gp_t = _mlp_grads(tiled, x, g)
    assert out.abs().max() > 0 and len(gp) == 6
    assert torch.equal(out_t, out) and torch.equal(gx_t, gx)
    assert gp_t.keys() == gp.keys()
    for k in gp:
        assert torch.equal(gp_t[k], gp[k]), k
    with torch.no_grad():
        assert torch.equal(tiled(x), out)


def test_short_input_runs_the_mlp_untouched():
    mlp = _base().model.layers[0].mlp
    calls = []
    mlp.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape))
    x = torch.randn(2, 7, 32)
    assert torch.equal(TiledMLP(mlp, 14)(x), mlp(x))
    assert calls == [(2, 7, 32), (2, 7, 32)]  # one call on the whole input, no tiles
    TiledMLP(mlp, 5)(x)
    assert calls[2:] == [(5, 32), (5, 32), (4, 32)]  # 14 tokens flattened into tiles of 5


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_checkpointed_tiles_equal_stored_tiles_with_dropout(dropout):
    """The tile recompute in backward draws the forward's dropout masks (random inputs, float32, bitwise)."""
    model = _lora(_base(1), dropout=dropout)
    mlp = model.get_base_model().model.layers[1].mlp
    x, g = torch.randn(1, 45, 32), torch.randn(1, 45, 32)
    tiled = TiledMLP(mlp, 8)
    out_c, gx_c, gp_c = _mlp_grads(tiled, x, g)
    tiled.checkpoint_tiles = False
    out_s, gx_s, gp_s = _mlp_grads(tiled, x, g)
    assert torch.equal(out_c, out_s) and torch.equal(gx_c, gx_s)
    for k in gp_s:
        assert torch.equal(gp_c[k], gp_s[k]), k
    if dropout:  # the masks really are random: another seed gives other gradients
        _, gx_other, _ = _mlp_grads(tiled, x, g, seed=6)
        assert not torch.equal(gx_other, gx_s)


# ---------------------------------------------------------------------------------------------- whole model
def _batch(seed, n=4):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 61) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    completions = [[rng.randrange(1, 61) for _ in range(rng.randint(1, 13))] for _ in range(n)]
    return prompts, completions


def _policy_grads(model, batch, *, tile, checkpointing, packed=True, checkpoint_tiles=True, layers=2):
    model = copy.deepcopy(model)
    model.train()
    if checkpointing == "offload":
        enable_offloaded_checkpointing(model)
    elif checkpointing == "plain":
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tile:
        assert enable_mlp_tiling(model, tile) == layers
        for m in model.modules():
            if isinstance(m, TiledMLP):
                m.checkpoint_tiles = checkpoint_tiles
    torch.manual_seed(11)
    lp, ent = sequence_logprobs(model, *batch, 13, pad_id=0, with_entropy=True, packed=packed)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=lp.dtype)
    ((lp * w).sum() + ent.sum()).backward()
    return lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tile", [3, 7, 16])
@pytest.mark.parametrize("packed", [True, False])
def test_tiled_model_matches_untiled_in_float64(tile, packed):
    """Packed rows (positions restart per sequence, tiles cross sequence boundaries) and padded rows, offloaded
    checkpointing, LoRA: log-probs and every gradient equal the untiled ones up to float64 rounding."""
    model, batch = _lora(_base(2).double()), _batch(tile)
    lp, g = _policy_grads(model, batch, tile=None, checkpointing="offload", packed=packed)
    lp_t, g_t = _policy_grads(model, batch, tile=tile, checkpointing="offload", packed=packed)
    assert torch.allclose(lp_t, lp, rtol=0, atol=1e-12)
    assert g_t.keys() == g.keys() and len(g) > 0
    for k in g:
        assert (g_t[k] - g[k]).norm() <= 1e-12 * g[k].norm(), k


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_tiled_checkpointing_is_lossless_exactly(dropout):
    """With the MLP tiled, offloaded and plain checkpointing (layer recompute + tile recompute, RNG restored at
    both levels) give bit-identical log-probs and gradients to tiles kept in memory without checkpointing."""
    model, batch = _lora(_base(3), dropout=dropout), _batch(99)
    lp_ref, g_ref = _policy_grads(model, batch, tile=6, checkpointing="none", checkpoint_tiles=False)
    for mode in ("offload", "plain"):
        lp, g = _policy_grads(model, batch, tile=6, checkpointing=mode)
        assert torch.equal(lp, lp_ref), mode
        assert g.keys() == g_ref.keys()
        for k in g_ref:
            assert torch.equal(g[k], g_ref[k]), (mode, k)


@pytest.mark.parametrize("dropout, passes", [(0.0, 2), (0.2, 3)])
def test_offloaded_recompute_runs_each_tile_once_more_only(dropout, passes):
    """Inside an offloaded layer's recompute the tiled MLP's output is never read, so (without dropout) the tiles
    run in backward only: the MLP runs twice per token (forward, backward), as untiled; with dropout the per-tile
    checkpoints stay (three times: their RNG states follow the forward's tile order). Exactness: the test above."""
    model, batch = _lora(_base(3), dropout=dropout), _batch(98)
    model = copy.deepcopy(model).train()
    enable_offloaded_checkpointing(model)
    enable_mlp_tiling(model, 5)
    tokens = []
    for m in model.modules():
        if isinstance(m, TiledMLP):
            m.inner.register_forward_pre_hook(lambda mod, args: tokens.append(args[0].shape[:-1].numel()))
    lp, _ = sequence_logprobs(model, *batch, 13, pad_id=0, packed=True)
    forward = sum(t for t in tokens if t > 1)
    lp.sum().backward()
    total = sum(t for t in tokens if t > 1)
    assert forward > 0 and total == passes * forward


@pytest.mark.parametrize("tile", [None, 3])
def test_offloaded_layers_with_nothing_to_train_backpropagate(tile):
    """Adapters on one projection of the last layer only: the first layer (input from the frozen embedding) has
    no parameter or input that wants a gradient; its recompute (and its MLP's tiles) must skip the backward that
    has nothing to reach, and the adapters' gradients equal plain checkpointing's."""
    base, batch = _base(), _batch(7)
    grads = {}
    for mode in ("plain", "offload"):
        torch.manual_seed(3)
        model = apply_lora(copy.deepcopy(base), LoraConfig(r=4, target_modules=["1.self_attn.q_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_()
        grads[mode] = _policy_grads(model, batch, tile=tile, checkpointing=mode, layers=2)[1]
    assert grads["offload"].keys() == grads["plain"].keys() and len(grads["plain"]) == 2
    for k in grads["plain"]:
        assert torch.equal(grads["offload"][k], grads["plain"][k]), k


# ---------------------------------------------------------------------------------------------- names, PEFT
def test_state_dict_keys_and_peft_adapters_are_unchanged(tmp_path):
    base = _base(4)
    keys = list(base.state_dict())
    tiled_first = copy.deepcopy(base)
    assert enable_mlp_tiling(tiled_first, 4) == 2
    assert list(tiled_first.state_dict()) == keys
    plain = _lora(copy.deepcopy(base))
    tiled = _lora(tiled_first)  # LoRA injected into the tiled model's MLPs
    assert list(tiled.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in tiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for name, p in plain.state_dict().items():
        assert torch.equal(tiled.state_dict()[name], p), name
    plain.save_pretrained(tmp_path / "plain")
    tiled.save_pretrained(tmp_path / "tiled")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "plain" / "adapter_model.safetensors"), load_file(tmp_path / "tiled" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any(".mlp." in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # an adapter saved untiled loads into a tiled model, and the reference (adapters off) still works
    import peft

    fresh = copy.deepcopy(base)
    enable_mlp_tiling(fresh, 4)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "plain")
    for name, p in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    batch = _batch(5)
    with torch.no_grad():
        lp_lora, _ = sequence_logprobs(loaded, *batch, 13, pad_id=0)
        with reference_mode(loaded):
            lp_ref, _ = sequence_logprobs(loaded, *batch, 13, pad_id=0)
        base_tiled = copy.deepcopy(base)
        enable_mlp_tiling(base_tiled, 4)
        lp_base, _ = sequence_logprobs(base_tiled, *batch, 13, pad_id=0)
    assert torch.equal(lp_ref, lp_base) and not torch.equal(lp_lora, lp_base)


def test_enable_disable_round_trip():
    model = _lora(_base(6))
    layers = model.get_base_model().model.layers
    originals = [layer.mlp for layer in layers]
    batch = _batch(7)
    with torch.no_grad():
        before, _ = sequence_logprobs(model, *batch, 13, pad_id=0)
    assert mlp_tile_tokens(model) is None
    assert enable_mlp_tiling(model, 8) == 2 and mlp_tile_tokens(model) == 8
    assert enable_mlp_tiling(model, 5) == 2 and mlp_tile_tokens(model) == 5  # re-enable: new size, no nesting
    assert all(type(layer.mlp) is TiledMLP and layer.mlp.inner is m for layer, m in zip(layers, originals))
    model.eval()
    assert not any(m.training for m in originals)
    model.train()
    assert disable_mlp_tiling(model) == 2 and disable_mlp_tiling(model) == 0
    assert [layer.mlp for layer in layers] == originals and all(m.training for m in originals)
    with torch.no_grad():
        after, _ = sequence_logprobs(model, *batch, 13, pad_id=0)
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="tile_tokens"):
        enable_mlp_tiling(model, 0)


# ---------------------------------------------------------------------------------------------- memory
class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of storages created by ops (forward, recompute and backward) that are alive at once."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _peak_live_bytes(n, width, tile):
    model = _lora(_base(8, hidden=16, intermediate=width))
    enable_offloaded_checkpointing(model)
    if tile:
        enable_mlp_tiling(model, tile)
    prompt = [[(7 * i) % 60 + 1 for i in range(n - 8)]]
    completion = [[(5 * i) % 60 + 1 for i in range(8)]]
    with PeakLiveBytes() as mode:
        lp, _ = sequence_logprobs(model, prompt, completion, 8, pad_id=0, chunk_size=64)
        lp.sum().backward()
    return mode.peak


def test_tiling_bounds_the_mlp_transient():
    """One sequence of N = 1024 tokens through the offloaded model, MLP width I = 1024, hidden 16: untiled, the
    peak holds several [N, I] intermediates at once; in tiles of 64 tokens, less than one [N, I] tensor's worth of
    op outputs is ever alive (the rest is one tile's intermediates and [N, H] tensors)."""
    n, width = 1024, 1024
    one_intermediate = n * width * 4  # [N, I] float32
    untiled, tiled = _peak_live_bytes(n, width, None), _peak_live_bytes(n, width, 64)
    assert untiled > 4 * one_intermediate
    assert tiled < one_intermediate and tiled * 5 < untiled


# ---------------------------------------------------------------------------------------------- config, trainer
def test_config_key_and_trainer_applies_it(tmp_path):
    from longrl.config.demo import demo_config
    from longrl.compat.trl import GRPOTrainer

    assert load_config(None, [], base=demo_config()).train.mlp_tile_tokens is None
    with pytest.raises(ConfigError, match="train.mlp_tile_tokens"):
        load_config(None, ["train.mlp_tile_tokens=-1"], base=demo_config())
    common = ["train.max_steps=1", "train.prompts_per_step=2", "grpo.num_generations=2", "output.progress_bar=false",
              "output.tensorboard=false"]
    on = GRPOTrainer(load_config(None, common + ["train.mlp_tile_tokens=4", f"output.output_dir={tmp_path / 'on'}"],
                                 base=demo_config()))
    assert mlp_tile_tokens(on.model) == 4
    m_on = on.train()[0]
    off = GRPOTrainer(load_config(None, common + ["train.mlp_tile_tokens=0", f"output.output_dir={tmp_path / 'off'}"],
                                  base=demo_config()))  # same seed
    assert mlp_tile_tokens(off.model) is None
    m_off = off.train()[0]
    for k in ("reward", "loss", "grad_norm", "entropy"):
        assert m_on[k] == pytest.approx(m_off[k], rel=1e-5, abs=1e-7), k
