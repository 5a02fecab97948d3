"""Reward worker process: ``python worker.py REF`` loads reward function REF and answers calls, one JSON line each.

Run as a script (it imports nothing of longrl, so it starts in milliseconds plus the reward module's own imports).
Protocol on the original stdout (the function's own prints go to stderr): first ``{"ready": true}`` or
``{"error": "..."}`` for the import; then for each request line ``{"prompts", "completions", "columns"}`` one line
``{"values": [...]}`` (each a number, None, or the repr of anything else) or ``{"error": "..."}``. Both directions
are JSON: nothing the worker sends can run code in the trainer. Limits (address space, CPU seconds) come from
``LONGRL_REWARD_MEMORY_BYTES`` and ``LONGRL_REWARD_CPU_S``.
"""

import importlib
import importlib.util
import json
import math
import os
import sys


def _limit() -> None:
    import resource

    memory = int(os.environ.get("LONGRL_REWARD_MEMORY_BYTES", "0"))
    if memory > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = int(float(os.environ.get("LONGRL_REWARD_CPU_S", "0")))
    if cpu > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def _load(ref: str):
    target, name = ref.rsplit(":", 1)
    if target.endswith(".py") or "/" in target or "\\" in target:
        spec = importlib.util.spec_from_file_location("longrl_reward_worker_module", os.path.expanduser(target))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if fn is None:
        import difflib

        close = difflib.get_close_matches(name, [k for k in vars(module) if not k.startswith("_")], n=1, cutoff=0.6)
        raise AttributeError(f"{target} has no attribute {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    if not callable(fn):
        raise TypeError(f"{name!r} is not callable")
    return fn


def _plain(value):
    """A number (float), None, or a repr string that the trainer reports as a bad value."""
    if value is None:
        return None
    if not isinstance(value, (bool, int, float)) and hasattr(value, "item"):  # NumPy / torch scalars
        try:
            value = value.item()
        except Exception:
            pass
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
        return float(value)
    return repr(value)[:200]


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the function's prints go to stderr, not into the protocol
    sys.stdout = sys.stderr
    sys.path.insert(0, os.getcwd())
    try:
        _limit()
        fn = _load(sys.argv[1])
    except BaseException as e:  # SystemExit at import too: reported, not obeyed
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            values = fn(prompts=request["prompts"], completions=request["completions"], **request["columns"])
            if isinstance(values, (dict, str, bytes, set, frozenset)) or not hasattr(values, "__iter__"):
                raise TypeError(f"returned {type(values).__name__} {repr(values)[:60]}; expected a list of numbers "
                                "or None, one per completion")
            answer = {"values": [_plain(v) for v in values]}
        except BaseException as e:  # SystemExit and KeyboardInterrupt of the function are its failures
            answer = {"error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
