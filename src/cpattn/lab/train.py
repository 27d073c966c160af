"""``cpattn train-draft``: train a draft head by self-distillation on the target's own greedy continuations.

Usage::

    cpattn train-draft --method {mtp,eagle3,dspark} --model TARGET_DIR --out DIR --seconds S --seed N

TARGET_DIR is a checkpoint directory (config.json + safetensors; a tiny
one from ``cpattn train-target``, whose corpus.json gives the prompts --
else random prompts). The target continues ``--prompts`` prompts greedily
(its hidden states and argmax kept), the head -- MTP for a DeepSeek-V3
target, Eagle3 or DSpark for a Qwen3 target, DSpark for a DeepSeek-V4 one
(e.g. random-init, written by :func:`cpattn.lab.target.save`: V4 is
not trained by ``train-target``) -- trains on them with AdamW
for S seconds (seeded), and DIR receives the checkpoint its drafter's
``from_checkpoint`` loads, ``loss.png`` (the loss curve) and
``train.json`` (losses, per-position accuracy, settings). Exit status 2
with one line on stderr for a bad flag, a missing checkpoint or a method
the target does not take.

``cpattn train-target --model {qwen3,deepseek_v3} --out DIR --seconds S --seed N``
trains the tiny target itself on the synthetic corpus (:mod:`cpattn.lab.corpus`).
"""

from __future__ import annotations

import json
import os
import time

from cpattn.config.cli_args import (add_dtype, add_json, add_progress, bad_value, output_dir, parser, positive_float,
                               positive_int, usage_error)

# the targets each head can train for (None: any): MTP needs a DeepSeek-format target; Eagle3 fuses [T, H]
# residual rows, which DeepSeek-V4 (hyper-connection streams [T, n_hc, H]) does not have; DSpark reads either
# (the guide pairs Eagle3 / DSpark with GQA / DSA and DeepSeek-V4 targets under PCP; the engine's config enforces that)
METHODS = {"mtp": ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"),
           "eagle3": ("qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"),
           "dspark": None}
CHUNK = 32  # distillation prompts continued at a time (the budget is checked between chunks)
RULES = {"mtp": f"MTP is DeepSeek's module, for DeepSeek-format targets {METHODS['mtp']}",
         "eagle3": "Eagle3 fuses [T, H] residual rows; DeepSeek-V4's are [T, n_hc, H] hyper-connection streams"}


def init_drafter(method: str, model: str, cfg, params: dict, data: tg.GreedyData | None, *, seed: int,
                 block_size: int = 4, draft_vocab: int | None = None):
    """A fresh head for the target: MTP (embedding / head shared), Eagle3 (draft vocabulary: the
    ``draft_vocab`` most frequent greedy tokens of ``data``), DSpark (placeholder: the last vocabulary id).

    >>> from cpattn.lab import target as tg
    >>> cfg = tg.tiny_config("qwen3", vocab_size=32, hidden_size=16)
    >>> init_drafter("dspark", "qwen3", cfg, tg.init("qwen3", cfg, seed=0), None, seed=0).cfg.mask_token_id
    31
    """
    import torch
    from cpattn.drafters.dspark import DSparkDrafter
    from cpattn.drafters.eagle3 import Eagle3Drafter
    from cpattn.drafters.mtp import MTPDrafter

    if method == "mtp":
        return MTPDrafter.random(model, cfg, target_params=params, seed=seed, std=0.02)
    if method == "eagle3":
        vocab = None
        if data is not None and draft_vocab:
            counts = torch.bincount(data.greedy.reshape(-1), minlength=cfg.vocab_size)
            vocab = counts.topk(min(draft_vocab, cfg.vocab_size)).indices.tolist()
        return Eagle3Drafter.random(params, cfg, seed=seed, vocab=vocab, draft_vocab=draft_vocab)
    return DSparkDrafter.random(params, cfg, block_size=block_size, mask_token_id=cfg.vocab_size - 1, seed=seed)


def hidden_layers_of(method: str, cfg) -> tuple:
    """The target layers each method's default head reads (``()``: only the final-normed state).

    >>> from cpattn.lab import target as tg
    >>> hidden_layers_of("eagle3", tg.tiny_config("qwen3")), hidden_layers_of("mtp", tg.tiny_config("qwen3"))
    ((0, 1, 2), ())
    """
    if method == "mtp":
        return ()
    n = cfg.num_hidden_layers
    return tuple(sorted({0, max(n // 2 - 1, 0), max(n - 2, 0)}))


def prompts_for(path, cfg, n: int, length: int, seed: int) -> torch.Tensor:
    """Distillation prompts [n, length]: from the target's corpus.json if it has one, else random tokens.

    >>> import tempfile
    >>> from cpattn.lab import target as tg
    >>> prompts_for(tempfile.mkdtemp(), tg.tiny_config("qwen3"), 2, 5, seed=0).shape
    torch.Size([2, 5])
    """
    import torch
    from cpattn.lab.corpus import Corpus

    corpus = Corpus.load(path)
    if corpus is not None:
        return corpus.sample(n, length, seed=seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.vocab_size - 1, (n, length), generator=g)


def train_drafter(method: str, model: str, cfg, params: dict, data: tg.GreedyData, *, seconds: float, seed: int,
                  depth: int = 4, block_size: int = 4, draft_vocab: int | None = None, batch: int = 16,
                  lr: float = 3e-3, max_steps: int | None = None, on_step=None, deadline: float | None = None):
    """Train a fresh head on ``data`` for ``seconds`` (or exactly ``max_steps`` steps, for tests):
    (drafter, losses, final per-depth / per-slot accuracy). ``deadline`` (a ``time.perf_counter()`` value)
    ends the seconds-bounded training earlier when it comes first (the command's whole budget); at least
    one step runs.

    >>> import torch
    >>> from cpattn.lab import target as tg
    >>> cfg = tg.tiny_config("qwen3", vocab_size=32, hidden_size=16, num_layers=4)
    >>> p = tg.init("qwen3", cfg, seed=0)
    >>> data = tg.greedy_data("qwen3", p, cfg, torch.ones(2, 2, dtype=torch.int64), 6, (0, 1, 2))
    >>> d, losses, acc = train_drafter("eagle3", "qwen3", cfg, p, data, seconds=0, seed=0, depth=2, max_steps=2)
    >>> d.method, len(losses), len(acc)
    ('eagle3', 2, 2)
    """
    import torch
    from cpattn.lab import objectives as obj, target as tg

    torch.manual_seed(seed)
    drafter = init_drafter(method, model, cfg, params, data, seed=seed, block_size=block_size,
                           draft_vocab=draft_vocab)
    skip = obj.frozen(method)
    p = {n: (t.clone().requires_grad_(True) if t.is_floating_point() and not n.endswith(skip) else t)
         for n, t in drafter.params.items()}
    drafter = type(drafter)(**{**drafter.__dict__, "params": p})
    opt = torch.optim.AdamW([t for t in p.values() if t.requires_grad], lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    n = data.tokens.shape[0]
    losses, acc, step, t0 = [], [], 0, time.perf_counter()
    end = t0 + seconds if deadline is None else min(t0 + seconds, deadline)
    expected = None
    while (step < max_steps) if max_steps is not None else (step == 0 or time.perf_counter() < end):
        idx = torch.randperm(n, generator=g)[:batch]
        if method == "mtp":
            loss, acc = obj.mtp_loss(drafter, data, idx, depth)
        elif method == "eagle3":
            loss, acc = obj.eagle3_loss(drafter, data, idx, depth)
        else:
            loss, acc = obj.dspark_loss(drafter, data, idx, 24, g)
        if max_steps is not None:
            expected = max_steps
        elif expected is None and step == 2:  # pace the schedule by the measured step time
            expected = max(10, int((end - t0) / max((time.perf_counter() - t0) / 3, 1e-6)))
        factor = tg.warmup_cosine(step, expected or 10_000)
        for group in opt.param_groups:
            group["lr"] = lr * factor
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([t for t in p.values() if t.requires_grad], 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if on_step is not None:
            on_step(step, losses[-1])
    final = type(drafter)(**{**drafter.__dict__, "params": {k: t.detach() for k, t in p.items()}})
    return final, losses, acc


def plot_losses(path: str, curves: dict[str, list[float]], title: str) -> None:
    """A PNG of loss curves (one per name), loss against step.

    >>> import os, tempfile
    >>> f = os.path.join(tempfile.mkdtemp(), "loss.png")
    >>> plot_losses(f, {"toy": [3.0, 2.0, 1.5]}, "toy")
    >>> os.path.getsize(f) > 0
    True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_drafter(drafter, out: str, target_dir: str, dtype: torch.dtype | None = None) -> None:
    """Write the head where its ``from_checkpoint`` finds it (MTP: a DeepSeek-V3-format checkpoint with the
    target's config read from ``target_dir``).

    >>> import tempfile
    >>> from cpattn.lab import target as tg
    >>> from cpattn.drafters.dspark import DSparkDrafter
    >>> cfg = tg.tiny_config("qwen3", vocab_size=32, hidden_size=16)
    >>> d, out = init_drafter("dspark", "qwen3", cfg, tg.init("qwen3", cfg, seed=0), None, seed=0), tempfile.mkdtemp()
    >>> save_drafter(d, out, "unused for DSpark")
    >>> DSparkDrafter.from_checkpoint(out).cfg == d.cfg
    True
    """
    from cpattn.drafters.mtp import MTPDrafter

    if isinstance(drafter, MTPDrafter):
        from cpattn.drafters.checkpoint import read_config

        drafter.save(out, read_config(target_dir), dtype=dtype)
    else:
        drafter.save(out, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    """``cpattn train-draft`` (see module doc). Returns the exit status.

    >>> main(["--method", "eagle3", "--model", "runs/tiny-qwen3", "--out", "runs/eagle3", "--seconds", "60"])  # doctest: +SKIP
    eagle3: 212 steps, loss 4.401 -> 0.012, accuracy per depth [1.0, 0.998, 0.997, 0.996]; saved runs/eagle3
    0
    """
    p = parser("cpattn train-draft", __doc__)
    p.add_argument("--method", choices=sorted(METHODS), required=True,
                   help="the draft head to train (required; no default)")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="the target's checkpoint directory (required; no default)")
    p.add_argument("--out", required=True, metavar="DIR", type=output_dir,
                   help="where the head's checkpoint goes (made if missing; required; no default)")
    p.add_argument("--seconds", type=positive_float, default=120.0, metavar="S",
                   help="wall-clock budget of data generation and training together: no new chunk of prompts "
                        "is continued past half of it (the data may then hold fewer than --prompts sequences), "
                        "training stops at S; loading the target before and saving after come on top")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="train exactly N steps on all --prompts instead, ignoring --seconds (reproducible "
                        "whatever the machine's load; default: train for --seconds)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, initialisation and batches")
    p.add_argument("--prompts", type=positive_int, default=256, metavar="N", help="distillation prompts")
    p.add_argument("--prompt-len", type=positive_int, default=16, metavar="N", help="tokens per prompt")
    p.add_argument("--length", type=positive_int, default=64, metavar="N", help="prompt + continuation tokens")
    p.add_argument("--depth", type=positive_int, default=4, metavar="D",
                   help="chain depths trained (MTP / Eagle3): drafts per step the head is fit for")
    p.add_argument("--block-size", type=positive_int, default=4, metavar="B", help="DSpark block size")
    p.add_argument("--draft-vocab", type=positive_int, default=None, metavar="V",
                   help="Eagle3 draft vocabulary (most frequent target tokens); default: the whole vocabulary")
    add_dtype(p, default="float32", help="dtype the checkpoint is stored in (training runs in float32)")
    add_json(p)
    add_progress(p)
    args = p.parse_args(argv)
    prog = "cpattn train-draft"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        bad_value(prog, "--model", repr(args.model), "a checkpoint directory with config.json and *.safetensors",
                  "pass a target trained by cpattn train-target or a Hugging Face checkpoint directory")
    if args.length <= args.prompt_len:
        bad_value(prog, "--length", args.length, f"longer than --prompt-len ({args.prompt_len})",
                  "raise --length or lower --prompt-len")
    import torch
    from cpattn.bench.common import DTYPES
    from cpattn.lab import target as tg
    from cpattn.lab.progress import Budget, Phases

    torch.set_num_threads(max(1, torch.get_num_threads()))
    from cpattn.drafters.checkpoint import read_config
    from cpattn.models.family import get_family

    model = get_family(read_config(args.model)).name  # the family first: a usage error before any loading
    if METHODS[args.method] is not None and model not in METHODS[args.method]:
        fits = [m for m, targets in sorted(METHODS.items()) if targets is None or model in targets]
        usage_error(prog, f"argument --method: saw {args.method!r} for a {model} target; rule: {RULES[args.method]}; "
                          f"fix: --method {' or '.join(fits)} for this target")
    ph = Phases("train-draft", enabled=not args.no_progress)
    ph.phase("loading the target", args.model)
    model, cfg, params = tg.load(args.model)
    budget = Budget(None if args.steps else args.seconds)
    prompts = prompts_for(args.model, cfg, args.prompts, args.prompt_len, args.seed)
    ph.phase("generating data", f"the target continues {args.prompts} prompts greedily to {args.length} tokens"
             + ("" if args.steps else f" (new chunks until {args.seconds / 2:g} s of the {args.seconds:g} s budget)"),
             total=-(-args.prompts // CHUNK))
    half = None if budget.deadline is None else budget.t0 + args.seconds / 2
    data = tg.greedy_data(model, params, cfg, prompts, args.length, hidden_layers_of(args.method, cfg),
                          deadline=half, chunk=CHUNK,
                          on_chunk=lambda done, total: ph.step(-(-done // CHUNK), elapsed=budget.elapsed()))
    ph.done(f"{data.tokens.shape[0]} sequences in {budget.elapsed():.1f} s")
    t_train = time.perf_counter()
    ph.phase("training", f"{args.method} head, " + (f"{args.steps} steps" if args.steps else
                                                    f"until {args.seconds:g} s"), total=args.steps,
             budget=args.seconds if not args.steps else None)
    drafter, losses, acc = train_drafter(args.method, model, cfg, params, data, seconds=args.seconds, seed=args.seed,
                                         depth=args.depth, block_size=args.block_size, draft_vocab=args.draft_vocab,
                                         max_steps=args.steps, deadline=budget.deadline,
                                         on_step=lambda s, loss: ph.step(s, loss, elapsed=budget.elapsed()))
    ph.done(f"{len(losses)} steps in {time.perf_counter() - t_train:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    ph.phase("saving", args.out)
    save_drafter(drafter, args.out, args.model, DTYPES[args.dtype])
    plot_losses(os.path.join(args.out, "loss.png"), {args.method: losses},
                f"{args.method} on {model}: self-distillation loss")
    report = {"method": args.method, "target": model, "steps": len(losses), "seconds": args.seconds,
              "max_steps": args.steps, "sequences": int(data.tokens.shape[0]),
              "seed": args.seed, "final_loss": losses[-1] if losses else None, "accuracy": acc, "losses": losses}
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(report, f)
    print(f"{args.method}: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, accuracy per "
          f"{'slot' if args.method == 'dspark' else 'depth'} {[round(a, 3) for a in acc]}; saved {args.out}")
    if args.json:
        from cpattn.bench.common import write_json

        write_json(args.json, {k: v for k, v in report.items() if k != "losses"})
    return 0


def target_main(argv: list[str] | None = None) -> int:
    """``cpattn train-target``: a tiny target trained on the synthetic corpus, saved as a checkpoint.

    >>> target_main(["--model", "qwen3", "--out", "runs/tiny-qwen3", "--steps", "600"])  # doctest: +SKIP
    qwen3: 600 steps, loss 4.177 -> 0.273; saved runs/tiny-qwen3
    0
    """
    p = parser("cpattn train-target", "Train a tiny target on the synthetic corpus and save it as a checkpoint.")
    p.add_argument("--model", choices=["qwen3", "deepseek_v3"], required=True,
                   help="the target family (required; no default)")
    p.add_argument("--out", required=True, metavar="DIR", type=output_dir,
                   help="where the checkpoint goes (made if missing; required; no default)")
    p.add_argument("--seconds", type=positive_float, default=180.0, metavar="S",
                   help="wall-clock budget of the training steps (saving the checkpoint and loss.png come on top)")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="train exactly N steps instead (reproducible whatever the machine's load; default: "
                        "train for --seconds)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus, initialisation and batches")
    p.add_argument("--vocab", type=positive_int, default=64, metavar="V", help="vocabulary size")
    p.add_argument("--hidden", type=positive_int, default=64, metavar="H", help="hidden size")
    p.add_argument("--layers", type=positive_int, default=4, metavar="N", help="decoder layers")
    p.add_argument("--near-ties", action="store_true",
                   help="successor phrases with near-equal probabilities (0.36 / 0.33 / 0.31): the target's choice "
                        "at a phrase boundary is hard to predict, as in real text")
    add_dtype(p, default="float32", help="dtype the checkpoint is stored in (training runs in float32)")
    add_progress(p)
    args = p.parse_args(argv)
    if args.hidden % 4:
        bad_value("cpattn train-target", "--hidden", args.hidden, "a multiple of 4 (four heads)", "use e.g. 64")
    from cpattn.bench.common import DTYPES
    from cpattn.lab import target as tg
    from cpattn.lab.corpus import Corpus, PROBS
    from cpattn.lab.progress import Phases

    cfg = tg.tiny_config(args.model, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers)
    corpus = Corpus.make(args.vocab, seed=args.seed, probs=(0.36, 0.33, 0.31) if args.near_ties else PROBS)
    ph = Phases("train-target", enabled=not args.no_progress)
    t0 = time.perf_counter()
    ph.phase("training", f"tiny {args.model} on the corpus, " + (f"{args.steps} steps" if args.steps else
                                                                 f"for {args.seconds:g} s"),
             total=args.steps, budget=None if args.steps else args.seconds)
    params, losses = tg.train(args.model, cfg, corpus, seconds=args.seconds, seed=args.seed, max_steps=args.steps,
                              on_step=lambda s, loss: ph.step(s, loss, elapsed=time.perf_counter() - t0))
    ph.done(f"{len(losses)} steps in {time.perf_counter() - t0:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    ph.phase("saving", args.out)
    tg.save(args.out, args.model, cfg, params, corpus, dtype=DTYPES[args.dtype])
    plot_losses(os.path.join(args.out, "loss.png"), {args.model: losses}, f"tiny {args.model} on the corpus")
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump({"model": args.model, "steps": len(losses), "seconds": args.seconds, "seed": args.seed,
                   "losses": losses}, f)
    print(f"{args.model}: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved {args.out}")
    return 0
