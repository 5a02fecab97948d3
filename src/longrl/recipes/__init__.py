"""One module per training mode: GRPO (grpo.py) and supervised fine-tuning (sft.py). Each holds its loop; what
they share lives in longrl.training."""
