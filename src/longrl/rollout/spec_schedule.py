"""When queued speculative steps pay: a chunk of steps speculates only while its acceptance beats the break-even
of a byte model of the step; otherwise plain chunks run, and speculation is tried again after a back-off.

Byte model of one decode step over the live sequences (bandwidth-bound: bytes read ≈ time): a plain step reads
the weights W, the prompts' keys/values K_p (each prompt once, for its group) and each sequence's own keys/values
K_o; a verify step of k drafts runs k + 1 queries a sequence, each reading the sequence's own store, so it reads
W + K_p + (k + 1)·K_o. It emits 1 + a tokens a sequence (a: the accepted drafts a verify row) where a plain step
emits 1, so speculation pays when 1 + a > r = (W + K_p + (k + 1)·K_o) / (W + K_p + K_o). The check asks for
``margin`` more (the verify step's sampling and drafting work, which the model leaves out). Every input is a count
of tokens, so the choice, and with it the sampled tokens, is the same on every run with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass


def verify_cost_ratio(weight_bytes: float, prompt_kv_bytes: float, own_kv_bytes: float, k: int) -> float:
    """r: a verify step of k drafts over a plain step, in bytes read (module docstring)."""
    plain = weight_bytes + prompt_kv_bytes + own_kv_bytes
    return (plain + k * own_kv_bytes) / max(plain, 1.0)


@dataclass
class SpeculationSchedule:
    """The mode of each chunk of decode steps: speculate (k drafts at most) or plain. A speculating chunk whose
    acceptance misses the break-even sends the next ``backoff`` chunks to plain decoding, the back-off doubling
    (up to ``max_backoff``) each time that repeats and back to 1 after a chunk that pays. ``enabled`` False: every
    chunk speculates."""

    enabled: bool = True
    margin: float = 1.1
    max_backoff: int = 16
    backoff: int = 1
    wait: int = 0  # plain chunks left before speculating again
    fallbacks: int = 0  # speculating chunks that missed the break-even

    def speculate_next(self) -> bool:
        """Whether the next chunk speculates (a plain chunk counts down the back-off)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, accepted_per_row: float, cost_ratio: float) -> None:
        """A speculating chunk's acceptance and its cost ratio r (verify_cost_ratio)."""
        if not self.enabled:
            return
        if 1.0 + accepted_per_row >= self.margin * cost_ratio:
            self.backoff = 1
            return
        self.fallbacks += 1
        self.wait = self.backoff
        self.backoff = min(self.max_backoff, 2 * self.backoff)


__all__ = ["SpeculationSchedule", "verify_cost_ratio"]
