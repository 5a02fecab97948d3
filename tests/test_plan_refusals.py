"""`longrl plan` refuses bad input clearly and quickly (issue 41, item 7): a GPU size that is not a positive number,
a model whose config cannot be read (a hub id while offline), a sequence length no machine could hold; and the
planner's MLP-tile search is a bisection with the linear search's answers."""

import os
import subprocess
import sys

import pytest

from longrl.memory.planner import (GIB, MLP_TILE_ALIGN, ModelShape, PlanError, choose_mlp_tile, make_plan,
                                   mlp_tile_of)

LLAMA_8B = ModelShape(layers=32, hidden=4096, intermediate=14336, kv_dim=1024, q_dim=4096, vocab=128256, tied=False)


def choose_mlp_tile_reference(tokens: int, fits) -> int | None:
    """The definition, plainly: tiles ⌈tokens / n⌉ aligned up, n = 2, 3, ... until one is MLP_TILE_ALIGN; the
    first that is smaller than ``tokens`` and fits."""
    n, tile = 2, tokens
    while tile > MLP_TILE_ALIGN:
        tile = mlp_tile_of(tokens, n)
        if tile < tokens and fits(tile):
            return tile
        n += 1
    return None


def test_tile_bisection_gives_the_linear_searchs_tile():
    for tokens in [1, MLP_TILE_ALIGN, MLP_TILE_ALIGN + 1, 2 * MLP_TILE_ALIGN, 3000, 10_000, 65_537, 409_600, 1_000_003]:
        for limit in [0, MLP_TILE_ALIGN - 1, MLP_TILE_ALIGN, 1500, 3000, 5000, 100_000, 204_800, 10**9]:
            def fits(tile, limit=limit):
                return tile <= limit

            assert choose_mlp_tile(tokens, fits) == choose_mlp_tile_reference(tokens, fits), (tokens, limit)


def test_tile_bisection_calls_fits_a_logarithmic_number_of_times():
    calls = []
    tile = choose_mlp_tile(10**12, lambda t: calls.append(t) or t <= 5000)
    assert tile == 4 * MLP_TILE_ALIGN  # the largest aligned tile <= 5,000
    assert len(calls) <= 2 + (10**12 // MLP_TILE_ALIGN).bit_length()


def test_tile_bisection_on_the_planner_matches_the_linear_search():
    """With the planner's own fits (an 8B model, 409,600 and 2,000,000 tokens on 24 to 120 GiB), both searches give
    the same tile."""
    from longrl.memory import planner

    for gib in (24, 60, 120):
        for tokens in (409_600, 2_000_000):
            found = {}
            for name, search in (("bisection", choose_mlp_tile), ("linear", choose_mlp_tile_reference)):
                original = planner.choose_mlp_tile
                planner.choose_mlp_tile = search
                try:
                    found[name] = make_plan(LLAMA_8B, sequence_lengths=[tokens], lora_r=32, weight_bytes=2,
                                            gpu_free_bytes=gib * GIB, host_free_bytes=2000 * GIB).mlp_tile_tokens
                except PlanError as e:
                    found[name] = str(e)
                finally:
                    planner.choose_mlp_tile = original
            assert found["bisection"] == found["linear"], (gib, tokens, found)


def test_a_sequence_whose_layer_inputs_exceed_the_machine_is_refused_before_any_search(monkeypatch):
    from longrl.memory import planner

    monkeypatch.setattr(planner, "predict", lambda *a, **k: pytest.fail("searched"))
    with pytest.raises(PlanError, match=r"single sequence of 1,000,000,000,000 tokens needs .* GiB for its layer "
                                        r"inputs alone .*shorten sft.max_length"):
        make_plan(LLAMA_8B, sequence_lengths=[10**12] * 8, lora_r=16, weight_bytes=2, gpu_free_bytes=80 * GIB,
                  host_free_bytes=500 * GIB, length_key="sft.max_length")


def _plan(tmp_path, *args, env=None):
    cfg = tmp_path / "sft.yaml"
    if not cfg.exists():
        cfg.write_text("model: {name_or_path: 'builtin:tiny-arith'}\ndata: {source: 'task:arithmetic_sft'}\n")
    return subprocess.run([sys.executable, "-m", "longrl", "plan", str(cfg), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})}, check=False)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_plan_refuses_a_gpu_size_that_is_not_a_positive_number(tmp_path, value):
    out = _plan(tmp_path, "--sft", "--gpu-memory-gib", value)
    assert out.returncode == 2 and "--gpu-memory-gib must be a positive number of GiB" in out.stderr
    assert "Traceback" not in out.stderr


def test_plan_with_a_hub_id_while_offline_names_the_key(tmp_path):
    (tmp_path / "sft.yaml").write_text("model: {name_or_path: 'longrl-test/no-such-model'}\n"
                                       "data: {source: 'task:arithmetic_sft'}\n")
    out = _plan(tmp_path, "--sft", "--gpu-memory-gib", "80", env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "model.name_or_path" in out.stderr and "longrl-test/no-such-model" in out.stderr


def test_plan_of_an_absurd_sft_length_ends_with_a_refusal(tmp_path):
    """The issue's case: `plan sft.yaml sft.max_length=1000000000000 --sft --gpu-memory-gib 80` looped for minutes in
    the MLP-tile search; with the bounds it ends at once, with the refusal naming the key."""
    out = _plan(tmp_path, "sft.max_length=1000000000000", "--sft", "--gpu-memory-gib", "80")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "1,000,000,000,000 tokens" in out.stderr and "shorten sft.max_length" in out.stderr
