"""Big models on small GPUs: per preset, with the GPU capped to 24 GiB (``torch.cuda.set_per_process_memory_fraction``,
so that a data-centre GPU stands for a home card) and uncapped: does it fit, the micro-batch, peak memory, tokens/s
and MFU, for two loops on the same GPU in the same process:

  * peer: the peer's own inner loop (``p2p_diloco.train.replica.build_inner`` and ``InnerTrainer.step``: flat
    parameters, AdamW, gradient clipping, one sync per step) with the options of train/memory.py and offload.py:
    torch.compile by regions, and where memory asks for them the AdamW moments in 8 bits (torchao, if it works
    here), the chunked loss (``--loss-chunk`` positions), gradient checkpointing, the optimizer on the host;
  * reference: the best plain loop a user could write with the same libraries: bf16 autocast, each decoder layer
    torch.compiled, the loss (head, fp32 upcast, cross-entropy) one compiled function (no fp32 logits kept), fused
    fp32 AdamW, gradient clipping; gradient checkpointing where it does not fit without.

Each loop searches its micro-batch: powers of two from 2 (1 if 2 does not fit), each measured with ``--warmup``
untimed and ``--steps`` timed steps on random tokens (the loss's cost does not depend on the text), until one runs
out of memory, gains under 3 %, or the search's time box ends; the best tokens/s is reported. The capped search runs
first; the uncapped one goes on from there with the same model where the loop's options stay the same. Each loop
tries its ways in order until one reaches ``--enough-batch`` sequences (the fastest tried is reported): the peer first
for speed (fused fp32 AdamW, the loss compiled in one piece), then, capped, with its memory options (8-bit moments and
the chunked loss, then gradient checkpointing, at last the optimizer offloaded to the host); the reference without,
then with gradient checkpointing. Ways whose parameters, gradients and AdamW moments alone exceed the cap are not
run (the row's notes say so; ``--measure-hopeless`` runs them). Compiled code is shape-generic
(``assume_static_by_default = False``), so a search compiles once. MFU: 6·N + 12·L·d·T FLOPs per token over the
device's bf16 peak (train/flops.py). Results go to ``--json`` after every loop, so a run cut short keeps what it
measured. No hivemind is imported: only torch and transformers (and torchao) are needed.

Run:

    python benchmarks/big_models.py --json benchmarks/results/gpu/big-models-h100.json   # on a GPU, ~6 min on an H100
    python benchmarks/big_models.py --smoke --json /tmp/big.json      # the tiny preset on the CPU: the code path only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project, when run from a bare checkout

GIB = 2 ** 30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="400m,3b,1b", help="comma-separated, in the order measured (default "
                        "400m,3b,1b: the two targets first)")
    parser.add_argument("--caps", default="24,0", help="GiB caps of the GPU, 0 for none, capped first (default 24,0)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary (default 50257, gpt2's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per micro-batch (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per micro-batch (default 3)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest micro-batch tried (default 64)")
    parser.add_argument("--first-batch", type=int, default=2, help="the micro-batch a search starts at (default 2)")
    parser.add_argument("--grad-accum", type=int, default=1, help="the peer's micro-batches per inner step "
                        "(inner.grad_accum; default 1): an offloaded step's host update is spread over them")
    parser.add_argument("--search-s", type=float, default=60.0, help="time box of one micro-batch search, s")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting new searches after this, s")
    parser.add_argument("--loss-chunk", type=int, default=2048, help="the capped peer's model.loss_chunk (default "
                        "2048; uncapped: --uncapped-loss-chunk)")
    parser.add_argument("--optimizer-state", default="auto", choices=("auto", "fp32", "8bit"),
                        help="the capped peer's inner.optimizer_state; auto: 8bit where torchao works (default)")
    parser.add_argument("--uncapped-loss-chunk", type=int, default=0, help="the uncapped peer's model.loss_chunk "
                        "(default 0: the whole loss compiled in one piece, fastest where memory allows)")
    parser.add_argument("--uncapped-optimizer-state", default="fp32", choices=("fp32", "8bit"),
                        help="the uncapped peer's inner.optimizer_state (default fp32: fused AdamW)")
    parser.add_argument("--no-offload", dest="offload", action="store_false",
                        help="never try the capped peer with inner.offload")
    parser.add_argument("--enough-batch", type=int, default=4, help="a way that reaches this micro-batch ends the "
                        "tries (default 4); below it the next way is tried too and the faster kept")
    parser.add_argument("--measure-hopeless", action="store_true", help="also run the ways whose parameters, "
                        "gradients and moments alone exceed the cap (by default they are skipped, with a note)")
    parser.add_argument("--offload-steps", type=int, default=3, help="timed steps of an offloaded peer (default 3)")
    parser.add_argument("--reference-loss", default="shifted", choices=("shifted", "padded"),
                        help="the reference's loss: logits of the first T-1 positions (shifted, default) or of all T "
                        "with the last target ignored (padded, as Hugging Face's loss and the peer's)")
    parser.add_argument("--no-compile", action="store_true", help="run both loops eagerly")
    parser.add_argument("--loops", default="peer,reference", help="comma-separated (default peer,reference)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--json", help="write the results here (JSON)")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, eager, 2 steps: the code path")
    args = parser.parse_args()
    if args.smoke:
        args.presets, args.caps, args.seq_len, args.vocab, args.device = "tiny", "24,0", 64, 512, "cpu"
        args.steps, args.warmup, args.max_batch, args.no_compile, args.loss_chunk = 2, 1, 2, True, 48
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here (use --smoke or --device cpu)")
    if args.optimizer_state == "auto":
        problem = torchao_problem(torch.device(args.device))
        args.optimizer_state = "fp32" if problem else "8bit"
        if problem:
            print(f"peer: fp32 AdamW moments, torchao's AdamW8bit is unusable here: {problem}", flush=True)
    return args


def torchao_problem(device: torch.device):
    """None if torchao's AdamW8bit takes a step on ``device`` here, else why not (one line)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed"
    try:
        from torchao.optim import AdamW8bit

        p = torch.nn.Parameter(torch.ones(4096, device=device))
        p.grad = torch.full_like(p, 0.5)
        AdamW8bit([p], lr=0.1).step()
        assert p.detach().max().item() < 1.0, "the step did not move the parameter"
    except Exception as e:  # an incompatible build: the peer then runs fp32 moments, and the rows say so
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def fresh_model(preset: str, args, device: torch.device) -> torch.nn.Module:
    """The preset's model, initialized on the device (seconds even for 3B; the values do not matter for speed)."""
    from transformers import AutoModelForCausalLM

    from p2p_diloco.train.model import preset_config

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(preset_config(preset, args.vocab, args.seq_len),
                                                attn_implementation="sdpa", dtype=torch.float32)


def offload_check(device: torch.device) -> dict:
    """The offloaded optimizer against fused AdamW on ``device``: the tiny preset, 3 inner steps of 2 micro-batches
    (so the staging path runs too), from the same weights; the largest differences of loss and of parameters."""
    from p2p_diloco.config import load_config
    from p2p_diloco.train.replica import build_inner

    torch.manual_seed(0)
    batches = [torch.randint(0, 512, (2, 128), device=device) for _ in range(2)]
    losses, params = {}, {}
    for offload in (False, True):
        cfg = load_config(overrides={"model.name": "tiny", "model.seq_len": "128", "inner.grad_accum": "2",
                                     "inner.offload": str(offload).lower(), "inner.warmup_steps": "1"})
        args = argparse.Namespace(vocab=512, seq_len=128)
        inner = build_inner(cfg, fresh_model("tiny", args, torch.device("cpu")), device, ranks=None)
        losses[offload] = []
        for _ in range(3):
            it = iter(batches)
            losses[offload].append(inner.step(lambda: next(it)).loss)
        params[offload] = torch.cat([p.detach().flatten().cpu() for p in inner.model.parameters()])
    return {"loss_max_abs_diff": max(abs(a - b) for a, b in zip(losses[False], losses[True])),
            "param_max_abs_diff": (params[False] - params[True]).abs().max().item(), "losses": losses[True]}


def attempts(loop: str, args, cap: float) -> list[dict]:
    """The ways a loop is tried, in order, until one reaches ``--enough-batch``: first for speed (fused fp32 AdamW,
    the loss compiled in one piece), then, on a capped card, for memory (8-bit moments and the chunked loss, then
    with gradient checkpointing, at last the optimizer offloaded to the host); uncapped, gradient checkpointing is
    the only fallback. The reference has only that one."""
    if loop == "reference":
        return [{"ckpt": False}, {"ckpt": True}]
    speed = {"ckpt": False, "state": args.uncapped_optimizer_state, "chunk": args.uncapped_loss_chunk,
             "offload": False}
    if not cap:
        return [speed, {**speed, "ckpt": True}]
    memory = {"ckpt": False, "state": args.optimizer_state, "chunk": args.loss_chunk, "offload": False}
    ways = [speed, memory, {**memory, "ckpt": True}]
    if args.offload:
        ways.append({"ckpt": True, "state": "fp32", "chunk": args.loss_chunk, "offload": True})
    return ways


def peer_loop(preset: str, args, device: torch.device, way: dict):
    """The peer's inner loop (build_inner + InnerTrainer.step) with the memory options: (model, step function)."""
    from p2p_diloco.config import load_config
    from p2p_diloco.train.replica import build_inner

    cfg = load_config(overrides={
        "model.name": preset, "model.seq_len": str(args.seq_len), "model.loss_chunk": str(way["chunk"]),
        "model.gradient_checkpointing": str(way["ckpt"]).lower(), "inner.optimizer_state": way["state"],
        "inner.offload": str(way["offload"]).lower(), "run.compile": str(not args.no_compile).lower(),
        "inner.warmup_steps": "10", "run.device": args.device, "inner.grad_accum": str(getattr(args, "grad_accum", 1))})
    model = fresh_model(preset, args, device).to("cpu")  # the peer builds on the host: build_inner moves it
    _free(device)
    inner = build_inner(cfg, model, device, ranks=None)

    def step(x: torch.Tensor) -> float:
        return inner.step(lambda: x).loss  # inner.grad_accum micro-batches, each the same x

    step.micro_batches = getattr(args, "grad_accum", 1)
    return model, step


def _fused_loss(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden[:, :-1], weight).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _padded_loss(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    targets = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]  # every position, the last one ignored
    logits = torch.nn.functional.linear(hidden, weight).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def reference_loop(preset: str, args, device: torch.device, way: dict):
    """The best plain loop a user could write: compiled layers, one compiled loss function, fused AdamW."""
    model = fresh_model(preset, args, device)
    if way["ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_fn = _padded_loss if args.reference_loss == "padded" else _fused_loss
    if not args.no_compile:
        for layer in model.model.layers:
            layer.compile()
        loss_fn = torch.compile(loss_fn)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda" or None)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step(x: torch.Tensor) -> float:
        with cast:
            hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
            loss = loss_fn(hidden, model.get_output_embeddings().weight, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(step, model, batch: int, args, device: torch.device):
    """tokens/s and peak memory of ``batch`` sequences per step; None when it runs out of memory."""
    x = torch.randint(0, args.vocab, (batch, args.seq_len), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out_of_memory = False
    try:
        for _ in range(args.warmup):
            step(x)
        _sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step(x)
        _sync(device)
        seconds = time.perf_counter() - start
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        out_of_memory = True  # freed below, once the exception (and the frames it holds) is gone
    if out_of_memory:
        del x
        model.zero_grad(set_to_none=True)
        _free(device)
        return None
    cuda = device.type == "cuda"
    tokens = batch * args.seq_len * args.steps * getattr(step, "micro_batches", 1)
    return {"micro_batch": batch, "tokens_per_s": tokens / seconds, "train_loss": loss,
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
            "reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if cuda else None}


def set_cap(cap_gib: float, device: torch.device) -> None:
    if device.type != "cuda":
        return
    _free(device)
    total = torch.cuda.get_device_properties(device).total_memory
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total) if cap_gib else 1.0, index)


class Search:
    """One loop's micro-batch search on one model; the uncapped search goes on where the capped one stopped."""

    def __init__(self, step, model, args, device, deadline: float):
        self.step, self.model, self.args, self.device, self.deadline = step, model, args, device, deadline
        self.results: list[dict] = []
        self.next_batch, self.oom_at, self.saturated = args.first_batch, None, False

    def run(self) -> None:
        box = min(time.perf_counter() + self.args.search_s, self.deadline)
        while not self.saturated and self.next_batch <= self.args.max_batch and time.perf_counter() < box:
            r = measure(self.step, self.model, self.next_batch, self.args, self.device)
            if r is None:
                self.oom_at = self.next_batch
                if self.next_batch == self.args.first_batch and not self.results:
                    r = measure(self.step, self.model, 1, self.args, self.device)
                    if r is not None:
                        self.results.append(r)
                return
            self.results.append(r)
            best_before = max((q["tokens_per_s"] for q in self.results[:-1]), default=0.0)
            self.next_batch *= 2
            if best_before and r["tokens_per_s"] < 1.03 * best_before:
                self.saturated = True  # larger micro-batches only take memory
                return

    def uncap(self) -> None:
        """Go on past the batch that ran out of memory under the cap (a saturated search stays done)."""
        if self.oom_at is not None:
            self.next_batch, self.oom_at = self.oom_at, None

    def best(self):
        return max(self.results, key=lambda r: r["tokens_per_s"], default=None)


def run_loop(loop: str, preset: str, args, device, caps: list[float], deadline: float, fpt_box: dict) -> list[dict]:
    """Rows of one loop on one preset, one per cap: the fastest of its :func:`attempts`, tried in order until one
    reaches ``--enough-batch`` sequences. A search whose way is the next cap's first goes on there with its model."""
    build = peer_loop if loop == "peer" else reference_loop
    rows, search, built = [], None, None
    for cap in caps:
        set_cap(cap, device)
        best, best_way, notes = None, None, []
        for way in attempts(loop, args, cap):
            if time.perf_counter() > deadline:
                break
            static = static_gib(preset, args, way)
            if cap and static > cap and not args.measure_hopeless:
                notes.append(f"{way}: parameters, gradients and moments alone take {static:.1f} GiB: not run")
                continue
            if search is None or built != way:
                search = None
                _free(device)
                search, built = start_search(build, preset, args, device, way, deadline, fpt_box), way
                if search is None:
                    continue
            else:
                search.uncap()
            search.run()
            result = search.best()
            if result is not None and (best is None or result["tokens_per_s"] > best["tokens_per_s"]):
                best, best_way = result, way
            if result is not None and result["micro_batch"] >= args.enough_batch:
                break
            notes.append(f"{way}: " + (f"micro-batch {result['micro_batch']} at most" if result else "does not fit"))
            search = None  # drop the model before the next way
            _free(device)
        rows.append(row(loop, preset, cap, best, best_way, args, device, fpt_box.get("flops"),
                        timed_out=time.perf_counter() > deadline))
        rows[-1]["notes"] = notes
        print(format_row(rows[-1]), flush=True)
    del search
    _free(device)
    return rows


def static_gib(preset: str, args, way: dict) -> float:
    """GiB that the fp32 parameters, their gradients and the AdamW moments take together at the optimizer step (the
    activations come on top): 16 bytes per parameter, 10 with 8-bit moments, 4 on the device when offloaded."""
    from transformers import AutoModelForCausalLM

    from p2p_diloco.train.model import preset_config

    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(preset_config(preset, args.vocab)).parameters())
    per_param = 4 if way.get("offload") else 10 if way.get("state") == "8bit" else 16
    return n * per_param / GIB


def start_search(build, preset, args, device, way, deadline, fpt_box):
    """A Search on a freshly built loop; None when the model and its optimizer alone do not fit. Offloaded steps
    wait for the host's update: fewer of them are timed."""
    from p2p_diloco.train.flops import flops_per_token

    try:
        model, step = build(preset, args, device, way)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        model = None
    if model is None:
        _free(device)
        return None
    fpt_box.setdefault("flops", flops_per_token(model, args.seq_len))
    if way.get("offload"):
        args = argparse.Namespace(**{**vars(args), "steps": args.offload_steps, "warmup": 1})
    return Search(step, model, args, device, deadline)


def row(loop, preset, cap, result, way, args, device, flops, timed_out) -> dict:
    from p2p_diloco.train.flops import mfu, peak_flops

    way = way or {}
    chunk = way.get("chunk")
    loss = f"chunks of {chunk} positions" if chunk else "one eager function" if args.no_compile and loop != "peer" \
        else "the model's own" if args.no_compile else "one compiled function"
    out = {"preset": preset, "loop": loop, "cap_gib": cap or None, "fits": result is not None,
           "grad_accum": args.grad_accum if loop == "peer" else 1,
           "gradient_checkpointing": way.get("ckpt") if result is not None else None,
           "optimizer_state": way.get("state", "fp32 (fused AdamW)"), "offload": bool(way.get("offload")),
           "loss_fn": loss, "compiled": not args.no_compile, "flops_per_token": flops,
           "unmeasured": timed_out and result is None}
    if result is not None:
        out.update(result)
        out["mfu"] = mfu(result["tokens_per_s"], flops, peak_flops(device))
    return out


def format_row(r: dict) -> str:
    cap = f"{r['cap_gib']:g} GiB" if r["cap_gib"] else "none"
    if not r["fits"]:
        why = f"failed ({r['error']})" if r.get("error") else "unmeasured (time)" if r["unmeasured"] else "does not fit"
        return f"{r['preset']} {r['loop']} cap {cap}: {why}"
    mfu = f", MFU {100 * r['mfu']:.1f} %" if r.get("mfu") is not None else ""
    peak = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
    return (f"{r['preset']} {r['loop']} cap {cap}: micro-batch {r['micro_batch']}"
            f"{' (checkpointing)' if r['gradient_checkpointing'] else ''}{' (offload)' if r['offload'] else ''}, "
            f"{r['tokens_per_s']:.0f} tokens/s{mfu}{peak}")


def table(rows: list[dict]) -> str:
    def cell(r, key, fmt):
        return fmt(r[key]) if r and r.get("fits") and r.get(key) is not None else "–"

    lines = ["| preset | cap | fits peer / ref | micro-batch peer / ref | peak GiB peer / ref | tokens/s peer / ref | "
             "MFU peer / ref | peer / reference |", "|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["preset"], r["cap_gib"] or 0) for r in rows))  # in the order measured
    for preset, cap in keys:
        by = {r["loop"]: r for r in rows if r["preset"] == preset and (r["cap_gib"] or 0) == cap}
        p, f = by.get("peer"), by.get("reference")

        def fits(r):
            return "–" if r is None else "unmeasured" if r["unmeasured"] else "yes" if r["fits"] else "no"

        def batch(r):  # with the options it took: checkpointing, 8-bit moments, chunked loss, offload
            if not r or not r.get("fits"):
                return "–"
            tags = [t for t, on in (("ckpt", r.get("gradient_checkpointing")), ("8-bit", r["optimizer_state"] == "8bit"),
                                    ("chunked", r["loss_fn"].startswith("chunks")), ("offload", r["offload"])) if on]
            return " ".join([str(r["micro_batch"])] + tags)

        ratio = (f"{p['tokens_per_s'] / f['tokens_per_s']:.3f}" if p and f and p["fits"] and f["fits"] else "–")
        lines.append(f"| {preset} | {f'{cap:g} GiB' if cap else 'none'} | {fits(p)} / {fits(f)} | {batch(p)} / "
                     f"{batch(f)} | {cell(p, 'peak_gib', '{:.1f}'.format)} / {cell(f, 'peak_gib', '{:.1f}'.format)} "
                     f"| {cell(p, 'tokens_per_s', '{:.0f}'.format)} / {cell(f, 'tokens_per_s', '{:.0f}'.format)} | "
                     f"{cell(p, 'mfu', lambda m: f'{100 * m:.1f} %')} / {cell(f, 'mfu', lambda m: f'{100 * m:.1f} %')}"
                     f" | {ratio} |")
    return "\n".join(lines)


def guarded_loop(loop, preset, args, device, caps, deadline, fpt_box, meta) -> list[dict]:
    """:func:`run_loop`; where it fails with shape-generic compiled code, once more with torch.compile's default
    (static shapes); a loop that still fails gives one row naming the error (the others are still measured)."""
    for attempt in range(2):
        try:
            return run_loop(loop, preset, args, device, caps, deadline, fpt_box)
        except Exception as e:
            traceback.print_exc()
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            _free(device)
            if attempt or args.no_compile or torch._dynamo.config.assume_static_by_default:
                break
            torch._dynamo.config.assume_static_by_default = True  # from here on, for every loop
            torch._dynamo.reset()
            meta["static_shapes_after"] = f"{preset} {loop}: {error}"
    return [{"preset": preset, "loop": loop, "cap_gib": None, "fits": False, "unmeasured": True, "error": error}]


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    start = time.perf_counter()
    deadline = start + args.budget_s
    if not args.no_compile:
        # both loops: compile once for every micro-batch of the search instead of once static, then again dynamic
        torch._dynamo.config.assume_static_by_default = False
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    caps = [float(c) for c in args.caps.split(",")]
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "seq_len": args.seq_len, "vocab": args.vocab, "steps": args.steps,
            "warmup": args.warmup, "command": " ".join(sys.argv), "peer_capped": attempts("peer", args, 24.0),
            "peer_uncapped": attempts("peer", args, 0.0), "reference_loss": args.reference_loss}
    if device.type == "cuda" and args.offload:
        try:
            meta["offload_check"] = offload_check(device)
        except Exception as e:  # reported, and the measurements still run
            traceback.print_exc()
            meta["offload_check"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"offload on {meta['device']} against fused AdamW, 3 steps of tiny: {meta['offload_check']}", flush=True)
    rows: list[dict] = []
    for preset in args.presets.split(","):
        fpt_box: dict = {}
        for loop in args.loops.split(","):
            rows += guarded_loop(loop, preset, args, device, caps, deadline, fpt_box, meta)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    meta["wall_s"] = time.perf_counter() - start
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"device: {meta['device']}; T = {args.seq_len}, V = {args.vocab}; {args.steps} timed steps; "
          f"peer capped: optimizer_state {args.optimizer_state}, loss_chunk {args.loss_chunk}; uncapped: "
          f"{args.uncapped_optimizer_state}, {args.uncapped_loss_chunk}; {meta['wall_s']:.0f} s")
    print(table(rows))


if __name__ == "__main__":
    main()
