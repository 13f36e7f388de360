"""Training evidence: matched short training runs that differ only in the attention backward.

    python -m benchmarks.training                    # GPU: all arms, within --time-budget
    python -m benchmarks.training --cpu --small      # the same code path on a CPU, < 1 min
    python -m benchmarks.training.data [--list]      # this machine's corpus split, as JSON
    python -m benchmarks.training.probe SAVED.pt     # the logged statistics of saved attention inputs

Arms (same seed, same init, same data order, BF16 autocast over FP32 master weights, AdamW, clipping):
``unpatched`` (PyTorch's fused BF16 SDPA backward: cuDNN on the H200, the CPU flash kernel on a CPU), ``gproj``
(``gproj_patch.enable(mode="gproj")``: the GProj Triton kernel on CUDA; on a CPU there is no kernel and the
FP32 tier runs), ``auto`` (``mode="auto"``: the policy picks a tier per layer from the detector, told nothing
about the model), ``fp32`` (``mode="fp32"``: FP32 attention backward with the projection, the reference). The
forward is the fused BF16 SDPA forward in every arm; ``step0_forward_bitwise_equal`` checks the logits.
The arms run in lockstep blocks of ``--eval-every`` steps, so a wall-clock budget stops them all at one step.

Model: a Llama-style decoder from a ``LlamaConfig`` (no download), head dim 64, no QK-norm, no softcap, HF's
``"sdpa"`` attention, RoPE base ``--rope-theta`` (5e5, Llama 3's), byte vocabulary. Data:
``benchmarks/training/data.py`` (Python's standard library source, bytes).

The regime, induced: the paper's model reached it after 25B tokens; here ``--offset-layers`` get, at init, a
frozen bias on ``k_proj`` along the lowest-frequency RoPE pair of every KV head (coordinates D/2−1 and D−1,
which RoPE rotates by < 2e-3 rad over the sequence at base 5e5), sized so the keys' offset ratio
R_k = ‖mean key‖ / RMS‖k_j − mean key‖ is ``--offset-rk`` at init. Why this mechanism: a common key translation
is the softmax gauge — the exact forward and exact gradients are (up to that small rotation) unchanged, so an
exact-arithmetic run would not notice it — while a backward that rounds dS leaks α·ρ_i·(mean key) into dq
(docs/math.md §3). That is the regime's defining property (keys far from their spread), without changing what the
model can learn. Frozen, because its exact gradient is ~0 and Adam would turn rounding noise into unit-size
steps; the regime is held, not grown. Nothing tells an arm which layers carry it.

Logged per step and arm: training loss, pre-clip global gradient norm, per layer R_k, max |logit| and mean row
max of P (``probe.layer_statistics``), the tier ``auto`` holds per layer (``policy.stats()``);
held-out loss every ``--eval-every`` steps; at checkpoints (every ``--checkpoint-every`` steps and after the
last step) each layer's dq/dk/dv error against the fp64 oracle on that step's recorded attention inputs, and the
gap (cosine, relative difference, norm ratio) between the arm's full-model gradient and the FP32-tier gradient
of the same weights on the same batch. Writes ``training.json``, ``training.png`` and ``training.log`` under
``--out`` (default ``$OUT/training``); the table of final figures is printed last.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional, Tuple

import torch

import gproj_patch
from benchmarks import common
from benchmarks.training import data, probe, report
from benchmarks.training.model import ARM_MODES, SMALL, RunConfig, build_model, induce_key_offset, lm_loss
from gproj_patch import policy
from gproj_patch.layers.tracking import track_layers
from gproj_patch.runtime.config import TIERS

log = logging.getLogger("benchmarks.training")

REFERENCE_ARM = "fp32"
SDPA_ONLY = ("sdpa",)
LAYER_NAME = "model.layers.{}.self_attn"  # track_layers' names for a LlamaForCausalLM
DETECTOR_KEYS = ("r_k", "r_q", "leak_dq_eff", "leak_dk", "p_sink")  # policy.stats()[layer]["stats"], logged
#: Torch threads on a CPU: small ops on a shared 2-core machine otherwise time the OpenMP wake-ups (×3-10 slower)
CPU_THREADS = 1


@dataclass
class Arm:
    name: str
    mode: Optional[str]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    curves: Dict[str, list] = field(default_factory=lambda: {
        "step": [], "loss": [], "grad_norm": [], "lr": [], "r_k": [], "max_logit": [], "p_max": [],
        "auto_tier": [], "auto_ran": [], "detector": [], "heldout_step": [], "heldout_loss": [], "checkpoints": [],
        "backward_calls": {}, "fallback_reasons": {}, "seconds": 0.0})


class PatchSwitch:
    """The one place that turns the patch on/off between arms (public API only)."""

    def __init__(self, sample_every: int):
        self.sample_every = sample_every
        self.mode = "unset"

    def use(self, mode: Optional[str]) -> None:
        if mode == self.mode:
            return
        gproj_patch.disable()
        if mode is not None:
            options = {"sample_every": self.sample_every} if mode == "auto" else {}
            gproj_patch.enable(mode=mode, targets=SDPA_ONLY, **options)
        self.mode = mode


def learning_rate(cfg: RunConfig, step: int) -> float:
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup)


def flat_grads_of(model) -> List[Optional[torch.Tensor]]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.switch = PatchSwitch(cfg.sample_every)
        self.corpus = data.load_corpus(max_bytes=cfg.max_bytes)
        self.windows = data.train_windows(steps=cfg.max_steps + 1, batch=cfg.batch, seq=cfg.seq,
                                          n_tokens=len(self.corpus.train), seed=cfg.seed)
        held = data.heldout_windows(count=cfg.eval_batches * cfg.batch, seq=cfg.seq, n_tokens=len(self.corpus.heldout))
        self.heldout = data.gather(self.corpus.heldout, held, cfg.seq).view(cfg.eval_batches, cfg.batch,
                                                                            cfg.seq).to(self.device)
        self.train_text = self.corpus.train.to(self.device)
        base = build_model(cfg, self.device)
        self.offset = induce_key_offset(base, cfg, self.batch(0))
        self.params = sum(p.numel() for p in base.parameters())
        self.arms = []
        for name in cfg.arms:
            model = copy.deepcopy(base)
            track_layers(model)  # names the attention calls after their modules (for auto's records)
            trainable = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=cfg.weight_decay)
            self.arms.append(Arm(name, ARM_MODES[name], model, opt))
        self.step0_logits: Dict[str, torch.Tensor] = {}
        self.steps_done = 0

    def batch(self, step: int) -> torch.Tensor:
        return data.gather(self.train_text, self.windows[step], self.cfg.seq)

    # --- one arm, one step ---------------------------------------------------------------------------
    def train_step(self, arm: Arm, step: int, checkpoint: bool, update: bool = True) -> None:
        cfg, ids = self.cfg, self.batch(step)
        self.switch.use(arm.mode)
        if arm.mode == "auto":
            policy.set_step(step)
        before = gproj_patch.stats()  # counters are cumulative (reset_stats would also clear auto's layer records)
        arm.optimizer.zero_grad(set_to_none=True)
        with probe.AttentionRecorder(grads=checkpoint, keep_seqs=max(cfg.oracle_seqs, probe.STATS_SEQS)) as rec:
            loss, logits = lm_loss(arm.model, ids, self.device)
            if step == 0 and update:
                self.step0_logits[arm.name] = logits.detach()
            loss.backward()
        self._count_backward(arm, before)
        c = arm.curves
        if update:
            stats = probe.layer_statistics(rec.calls)
            for key in ("r_k", "max_logit", "p_max"):
                c[key].append(stats[key])
            self._record_auto(arm, step)
        if checkpoint:
            self._checkpoint(arm, step, ids, rec)
        if not update:
            return
        grad_norm = torch.nn.utils.clip_grad_norm_(arm.optimizer.param_groups[0]["params"], cfg.clip)
        lr = learning_rate(cfg, step)
        for group in arm.optimizer.param_groups:
            group["lr"] = lr
        arm.optimizer.step()
        c["step"].append(step)
        c["lr"].append(lr)
        values = torch.stack([loss.detach().float(), grad_norm.float()]).cpu().tolist()
        c["loss"].append(values[0])
        c["grad_norm"].append(values[1])

    def _count_backward(self, arm: Arm, before: dict) -> None:
        """Backward calls per tier that ran and fallback reasons during this step (differences of stats())."""
        after = gproj_patch.stats()
        calls, reasons = arm.curves["backward_calls"], arm.curves["fallback_reasons"]
        for tier in TIERS:
            calls[tier] = calls.get(tier, 0) + int(after.get(tier, 0)) - int(before.get(tier, 0))
        old = before.get("fallback_reasons", {})
        for reason, n in after.get("fallback_reasons", {}).items():
            if n != old.get(reason, 0):
                reasons[reason] = reasons.get(reason, 0) + n - old.get(reason, 0)

    def _record_auto(self, arm: Arm, step: int) -> None:
        """The tier the policy chose per layer (``policy_tier``; ``tier`` is the one that ran: on a CPU the
        choice "gproj" runs the FP32 tier) and, on steps where it sampled, the detector's statistics."""
        if arm.mode != "auto":
            return
        recs = policy.stats()
        layers = [recs.get(LAYER_NAME.format(i), {}) for i in range(self.cfg.layers)]
        arm.curves["auto_tier"].append([r.get("policy_tier", r.get("tier")) for r in layers])
        arm.curves["auto_ran"].append([r.get("tier") for r in layers])
        if step % self.cfg.sample_every == 0:
            arm.curves["detector"].append({"step": step, **{k: [r.get("stats", {}).get(k) for r in layers]
                                                            for k in DETECTOR_KEYS}})

    def _checkpoint(self, arm: Arm, step: int, ids: torch.Tensor, rec: probe.AttentionRecorder) -> None:
        entry = {"step": step, "oracle": probe.oracle_errors(rec.calls)}
        if arm.name != REFERENCE_ARM:
            own = flat_grads_of(arm.model)
            g = probe.flat_grad(arm.model)
            self.switch.use(ARM_MODES[REFERENCE_ARM])
            arm.model.zero_grad(set_to_none=True)
            ref_loss, _ = lm_loss(arm.model, ids, self.device)
            ref_loss.backward()
            entry["gap_vs_fp32_backward"] = probe.gradient_gap(g, probe.flat_grad(arm.model))
            for p, saved in zip(arm.model.parameters(), own):
                p.grad = saved
            self.switch.use(arm.mode)
        arm.curves["checkpoints"].append(entry)

    def evaluate(self, arm: Arm, step: int) -> None:
        with torch.no_grad():
            losses = [lm_loss(arm.model, ids, self.device)[0] for ids in self.heldout]
        arm.curves["heldout_step"].append(step)
        arm.curves["heldout_loss"].append(torch.stack(losses).mean().item())

    # --- the lockstep loop -----------------------------------------------------------------------------
    def run(self, progress) -> int:
        cfg, step, t0, last_block = self.cfg, 0, time.perf_counter(), 0.0
        while step < cfg.max_steps:
            end = min(step + cfg.eval_every, cfg.max_steps)
            tb = time.perf_counter()
            for arm in self.arms:
                ta = time.perf_counter()
                self.switch.use(arm.mode)
                self.evaluate(arm, step)
                for s in range(step, end):
                    self.train_step(arm, s, checkpoint=s % cfg.checkpoint_every == 0)
                self._sync()
                arm.curves["seconds"] += time.perf_counter() - ta
            progress(end, {a.name: a.curves["loss"][-1] for a in self.arms})
            step, last_block = end, time.perf_counter() - tb
            self.steps_done = step
            if time.perf_counter() - t0 + last_block > cfg.time_budget:
                log.info("time budget %.0f s reached after step %d", cfg.time_budget, step)
                break
        for arm in self.arms:  # final figures on the final weights; the checkpoint pass updates nothing
            self.switch.use(arm.mode)
            self.evaluate(arm, step)
            self.train_step(arm, step, checkpoint=True, update=False)
        self.switch.use(None)
        return step

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step0_equal(self) -> Dict[str, bool]:
        if not self.step0_logits:
            return {}
        first = next(iter(self.step0_logits.values()))
        return {name: bool(torch.equal(first, lg)) for name, lg in self.step0_logits.items()}


def parse_args(argv=None) -> Tuple[RunConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU")
    ap.add_argument("--small", action="store_true", help="tiny model and run (smoke test of the same code path)")
    ap.add_argument("--out", default=None, help="folder for training.json/.png/.log (default $OUT/training)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--threads", type=int, default=CPU_THREADS, help="torch threads on a CPU")
    for f in fields(RunConfig):
        if f.name in ("device", "arms", "offset_layers"):
            continue
        kind = float if f.type in ("float", "Optional[float]") else int
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None)
    ap.add_argument("--offset-layers", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=None)
    ap.add_argument("--arms", type=lambda s: tuple(s.split(",")), default=None)
    args = ap.parse_args(argv)
    values = dict(SMALL) if args.small else {}
    values.update({f.name: getattr(args, f.name) for f in fields(RunConfig)
                   if f.name != "device" and getattr(args, f.name, None) is not None})
    values["device"] = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    cfg = RunConfig(**values)
    unknown = [a for a in cfg.arms if a not in ARM_MODES]
    if unknown or REFERENCE_ARM not in cfg.arms:
        ap.error(f"--arms must name arms of {list(ARM_MODES)} and include {REFERENCE_ARM!r}; got {cfg.arms}")
    return cfg, args


def environment(device: torch.device) -> Dict[str, str]:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    return env


def main(argv=None) -> dict:
    cfg, args = parse_args(argv)
    args.out = common.out_dir("training", args.out)
    log_path = os.path.join(args.out, "training.log")
    handlers = [logging.FileHandler(log_path, mode="w"), logging.StreamHandler(sys.stderr)]
    for h in handlers:  # this script's logger only: the root logger (and a test runner's handlers) stay as they are
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    t0 = time.time()
    threads = torch.get_num_threads()
    if cfg.device == "cpu":
        torch.set_num_threads(args.threads)
    try:
        results = _run(cfg, args, log_path, t0)
    finally:
        torch.set_num_threads(threads)
        for h in handlers:
            log.removeHandler(h)
            h.close()
    return results


def _run(cfg: RunConfig, args: argparse.Namespace, log_path: str, t0: float) -> dict:
    gproj_patch.disable()
    policy.reset()
    trainer = Trainer(cfg)
    log.info("config %s", asdict(cfg))
    log.info("%d parameters; corpus %s: %d train files (%d bytes), %d held-out files (%d bytes); offset %s",
             trainer.params, trainer.corpus.root, trainer.corpus.files_train, len(trainer.corpus.train),
             trainer.corpus.files_heldout, len(trainer.corpus.heldout), trainer.offset)
    error = None
    with report.Progress(total=cfg.max_steps) as bar:
        try:
            trainer.run(bar.update)
        except Exception as exc:  # keep what was measured: the curves so far still go to the JSON
            log.exception("training stopped after step %d", trainer.steps_done)
            error = f"{type(exc).__name__}: {exc}"
    gproj_patch.disable()
    results = {"config": asdict(cfg), "environment": environment(trainer.device), "parameters": trainer.params,
               "corpus": {"root": trainer.corpus.root, "train_bytes": len(trainer.corpus.train),
                          "heldout_bytes": len(trainer.corpus.heldout), "train_files": trainer.corpus.files_train,
                          "heldout_files": trainer.corpus.files_heldout},
               "offset": trainer.offset, "steps": trainer.steps_done, "error": error,
               "probe": {"stats_seqs": probe.STATS_SEQS},  # sequences of a batch the per-step statistics read
               "step0_forward_bitwise_equal": trainer.step0_equal(),
               "arms": {a.name: a.curves for a in trainer.arms}, "seconds": time.time() - t0}
    if error is None:
        results["summary"] = report.summarize(results)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(report.compact(results), f)
    if error is not None:
        raise SystemExit(f"benchmarks.training: {error} (curves up to step {trainer.steps_done} in the JSON)")
    if not args.no_plot:
        report.plot(results, os.path.join(args.out, "training.png"))
    text = report.table(results)
    with open(log_path, "a") as f:
        f.write(text + "\n")
    print(text)
    return results

if __name__ == "__main__":
    main()
