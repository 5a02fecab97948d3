"""Misbehaving reward functions for the fault catalogue (tests/test_faults.py, tests/fault_cases.yaml).

Each takes TRL's signature. The signal senders read LONGRL_TEST_SIGNAL (e.g. TERM) and LONGRL_TEST_SIGNAL_CALL (the
call on which to send it; INT2: two Ctrl-C in that call).
"""

import math
import os
import signal
import sys
import time

CALLS = {"n": 0}


def ok(prompts, completions, **kw):
    return [1.0 if "=" in str(p) else 0.0 for p in prompts]


def varied(prompts, completions, **kw):
    """A learning signal: rewards that differ within a group."""
    return [float(len(str(c)) % 3) for c in completions]


def hang(prompts, completions, **kw):
    time.sleep(60)
    return [0.0] * len(completions)


def busy(prompts, completions, **kw):
    while True:
        pass


def swallows_everything(prompts, completions, **kw):
    """Catches even BaseException: only a worker process can be stopped."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except BaseException:
            pass
    return [0.0] * len(completions)


def exits(prompts, completions, **kw):
    sys.exit(3)


def hard_exit(prompts, completions, **kw):
    os._exit(9)


def interrupts(prompts, completions, **kw):
    raise KeyboardInterrupt


def raises(prompts, completions, **kw):
    raise RuntimeError("reward exploded")


def returns_none(prompts, completions, **kw):
    return [None] * len(completions)


def wrong_length(prompts, completions, **kw):
    return [1.0]


def nan(prompts, completions, **kw):
    return [math.nan] * len(completions)


def inf(prompts, completions, **kw):
    return [math.inf] * len(completions)


def strings(prompts, completions, **kw):
    return ["high"] * len(completions)


def bools(prompts, completions, **kw):
    return [True] * len(completions)


def generator(prompts, completions, **kw):
    for _ in completions:
        yield 0.5


def returns_dict(prompts, completions, **kw):
    return {i: 1.0 for i in range(len(completions))}  # its keys are not rewards


def returns_string(prompts, completions, **kw):
    return "1" * len(completions)


def mutates_inputs(prompts, completions, **kw):
    """Rewrites every input it was given, in place."""
    completions[:] = ["MUTATED"] * len(completions)
    prompts.clear()
    for k in ("completion_ids", "truncated", "answer"):
        if k in kw and isinstance(kw[k], list):
            kw[k].clear()
    return [0.0] * len(completions)


def sees_original(prompts, completions, **kw):
    return [-1.0 if "MUTATED" in str(c) else 1.0 for c in completions]


def prints(prompts, completions, **kw):
    print("noise on stdout that is not the protocol")
    return [0.25] * len(completions)


def hogs_memory(prompts, completions, **kw):
    block = bytearray(4 << 30)
    return [float(len(block))] * len(completions)


def sends_signal(prompts, completions, **kw):
    CALLS["n"] += 1
    name = os.environ.get("LONGRL_TEST_SIGNAL", "TERM")
    at = int(os.environ.get("LONGRL_TEST_SIGNAL_CALL", "2"))
    if CALLS["n"] == at:
        os.kill(os.getpid(), getattr(signal, "SIGINT" if name == "INT2" else f"SIG{name}"))
        if name == "INT2":  # a second Ctrl-C before the step ends
            time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
    return [float(len(str(c)) % 3) for c in completions]
