"""When queued speculative steps pay: a chunk of steps speculates only while its acceptance beats the break-even
of the verify step's cost r (in plain steps); otherwise plain chunks run, and speculation is tried again after a
back-off. A verify step emits 1 + a tokens a sequence (a: the accepted drafts a verify row) where a plain step emits
1, so speculation pays when 1 + a ≥ margin · r (``margin`` covers what r leaves out). Two ways to know r:

- measured (the default): r = t_verify / t_plain, the seconds a step of the last speculating chunk over those of the
  last plain chunk of the same call (each chunk ends in a host synchronisation, so its wall time is its steps'
  whole cost: kernels, launches, the host's work). Until a plain chunk has been timed, r is the byte model's below
  and the chunk after a speculating one is plain; after ``refresh_every`` paying chunks in a row one plain chunk
  times plain steps again, as the contexts grow. The choices follow the machine's timings, so a seed's tokens can
  differ between runs; their distribution is plain sampling's either way (a choice never reads the random numbers
  of the step it picks). The sampler keeps a measured schedule from call to call (one per number of sequences,
  :meth:`SpeculationSchedule.next_call`): the back-off carries over, so where speculation does not pay, calls of a
  few chunks (short completions) settle at one speculating chunk in max_backoff + 1 instead of paying a probe and
  a timing chunk every call; each call times its own plain steps.
- bytes: a byte model of a bandwidth-bound step. A plain step reads the weights W, the prompts' keys/values K_p (each
  prompt once, for its group) and each sequence's own keys/values K_o; a verify step of k drafts runs k + 1 queries
  a sequence, each reading the sequence's own store: r = (W + K_p + (k + 1)·K_o) / (W + K_p + K_o). Every input is a
  count of tokens, so the choices, and with them the sampled tokens, are the same on every run with the same seed;
  but it leaves out launches and host work, which set a small model's step (on SmolLM2-135M a verify step took
  2–4.5× a plain one where the bytes say 1.0).
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
    chunk speculates. ``measured``: r from the call's step times (module docstring), else from bytes."""

    enabled: bool = True
    measured: bool = True
    margin: float = 1.1
    max_backoff: int = 16
    refresh_every: int = 16  # measured: paying chunks in a row before one plain chunk re-times plain steps
    backoff: int = 1
    wait: int = 0  # plain chunks left before speculating again
    fallbacks: int = 0  # speculating chunks that missed the break-even
    streak: int = 0  # speculating chunks in a row that paid
    plain_step_s: float | None = None  # measured: seconds a step of the last plain chunk
    last_ratio: float | None = None  # the r of the last speculating chunk

    def next_call(self) -> "SpeculationSchedule":
        """This schedule for a new call of the sampler: the back-off (wait, backoff) carries over; the plain step time,
        the streak, the last ratio and the fallback count are the new call's own."""
        self.plain_step_s = self.last_ratio = None
        self.streak = self.fallbacks = 0
        return self

    def speculate_next(self) -> bool:
        """Whether the next chunk speculates (a plain chunk counts down the back-off)."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record_plain(self, seconds_per_step: float) -> None:
        """A plain chunk's seconds a step (the measured r's denominator)."""
        self.plain_step_s = seconds_per_step

    def cost_ratio(self, byte_ratio: float, verify_step_s: float) -> float:
        """r for :meth:`record`: t_verify / t_plain when measured and a plain chunk has been timed, else the byte
        model's ``byte_ratio`` (verify_cost_ratio)."""
        if self.measured and self.plain_step_s:
            return verify_step_s / self.plain_step_s
        return byte_ratio

    def record(self, accepted_per_row: float, cost_ratio: float, max_drafts: int | None = None) -> None:
        """A speculating chunk's acceptance and its cost ratio r (:meth:`cost_ratio`); ``max_drafts``: the most drafts
        a row could have had accepted (k). A miss where even k accepted drafts a row would not pay (1 + k < margin ·
        r) backs off the longest at once: more acceptance cannot help there, only a cheaper verify step."""
        self.last_ratio = cost_ratio
        if not self.enabled:
            return
        if 1.0 + accepted_per_row >= self.margin * cost_ratio:
            self.backoff = 1
            self.streak += 1
            if self.measured and (self.plain_step_s is None or self.streak >= self.refresh_every):
                self.streak, self.wait = 0, 1  # one plain chunk (re)times plain steps
            return
        self.streak = 0
        self.fallbacks += 1
        if max_drafts is not None and 1.0 + max_drafts < self.margin * cost_ratio:
            self.backoff = self.max_backoff
        self.wait = self.backoff
        self.backoff = min(self.max_backoff, 2 * self.backoff)


__all__ = ["SpeculationSchedule", "verify_cost_ratio"]
