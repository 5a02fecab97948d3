"""The KL reference's placements on CUDA, where the host placement's copies run on a side stream ordered by events:
bf16 log-probs bit for bit those of the in-place copy and of a deep copy of the initial model, and a full-weight GRPO
run on the GPU keeping its reference in host memory. Runs on a GPU machine; without CUDA there is nothing to run."""

import copy

import pytest
import torch

from test_kl_reference import COMPLETIONS, PROMPTS, QUICK, _logps, _train_steps, deep_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_placement_streams_bit_identically_on_cuda(dtype):
    from longrl.models.reference import ReferenceModel

    model, _ = deep_model(seed=11, dtype=dtype)
    model.to("cuda")
    initial = copy.deepcopy(model)
    refs = {p: ReferenceModel(model, p) for p in ("gpu", "host")}
    assert refs["host"]._stream is not None and all(s.is_pinned() for layer in refs["host"]._sources
                                                    for _, s in layer)
    _train_steps(model)
    for split in ([[0, 1, 2]], [[2], [0], [1]]):
        want = _logps(initial, split).cpu()  # (ReferenceModel.logprobs returns CPU tensors)
        for placement, ref in refs.items():
            for _ in range(2):  # a second pass over the same buffers
                assert torch.equal(ref.logprobs(PROMPTS, COMPLETIONS, 5, split, pad_id=0, packed=False), want), \
                    placement


def test_full_weight_run_on_cuda_keeps_its_reference_in_host_memory(tmp_path):
    from longrl.compat.trl import GRPOTrainer
    from longrl.config import load_config
    from longrl.config.demo import demo_config

    cfg = load_config(None, QUICK + [f"output.output_dir={tmp_path}", "model.device=cuda", "model.dtype=bfloat16",
                                     "grpo.reference_placement=host", "train.max_steps=3"], base=demo_config())
    trainer = GRPOTrainer(cfg)
    assert trainer.reference.placement == "host" and trainer.reference.device.type == "cuda"
    history = trainer.train()
    assert history[0]["kl"] == 0.0 and history[-1]["kl"] > 0
