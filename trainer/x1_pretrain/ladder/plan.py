"""`ladder plan`: which rungs, at what cost, before any of them runs.

The money comes first. The main run's plan (x1_pretrain.run.plan) says how many GPU hours it will
train; the ladder gets a share of those (default 5%). Its rungs are the target's model at
`sizes` widths (family.py), each trained at `budgets` token budgets that grow by 2x, every size
at the same multiples of its own parameter count (a size's compute then grows with its square,
so leaving the largest size out checks an extrapolation in compute as the target's is one). The
multiple is the largest whose GPU time, at each size's tokens/s on this GPU, fits the share.
With the learning-rate check on the smallest size (x0.5 and x2 of the rule, at its middle
budget) the plan is written to DIR/plan.json and said in one sentence:

    This ladder will run 14 rungs on 1× A100 80GB at $1.10/h for ~1.1 h = $1.21; with the main
    run's $26.40 that is $27.61 of the $35 cap.

Refused, with exit 78 and nothing started, when the ladder and the main run together would
cost more than the cap; exit 2 when the largest rung needs more tokens than the corpus holds
(a rung must see unique tokens: the law is for data seen once).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from x1_pretrain.config import ModelConfig, RunConfig
from x1_pretrain.ladder.family import Recipe, model_family, recipe, scaled_model, size_facts, widths_for
from x1_pretrain.run.plan import PROVIDER_DISPLAY, make_plan
from x1_pretrain.train.accounting import GPU_DISPLAY, flops_per_token, fmt_count, param_counts, usd

DEFAULT_SHARE = 0.05  # of the main run's training hours
DEFAULT_SIZES = 4
DEFAULT_BUDGETS = 3
LR_SWEEP = (0.5, 2.0)  # the rule's lr times these, on the smallest size at its middle budget
MIN_RUNG_STEPS = 20  # fewer optimizer steps than this is not a training run's curve
EVALS_PER_RUNG = 16  # points on each rung's val curve (the forecast's priors are fitted to them)
START_SECONDS = 45.0  # a rung's start-up on a GPU (imports, compile, the first eval): counted in the cost
START_SECONDS_CPU = 5.0  # on a CPU nothing compiles
# A narrow rung uses the GPU far less than the 50M model does: its tokens/s is the main run's figure
# scaled by FLOPs/token (the same MFU) and then by this factor per halving of the width below the
# target's, an estimate until `ladder run` measures it (rungs.json records each rung's tokens/s).
MFU_PER_HALVING = 0.7


class LadderPlanError(ValueError):
    """Bad input to the plan (exit 2); the message names it."""


class LadderRefused(ValueError):
    """The money does not allow the ladder (exit 78); the message says why and what would."""


@dataclass(frozen=True)
class RungSpec:
    name: str
    role: str  # "fit" (a point of the law) or "lr-sweep" (the lr rule's check; not fitted)
    model: dict[str, int]  # n_layer, d_model, n_head, n_kv_head, d_ff
    n_params: int
    n_params_nonembedding: int
    flops_per_token: float
    tokens: int
    recipe: dict[str, Any]
    lr_scale: float
    tokens_per_sec: float  # what the plan expects alone on the GPU
    eval_every: int
    start_seconds: float = START_SECONDS

    @property
    def seconds(self) -> float:
        return self.tokens / self.tokens_per_sec + self.start_seconds

    def sets(self) -> list[str]:
        return [f"model.{k}={v}" for k, v in self.model.items()] + Recipe(**self.recipe).sets()


@dataclass
class LadderPlan:
    target: dict[str, Any]
    gpu: str
    provider: str
    price_usd_per_hr: float
    cap_usd: float
    share: float
    jobs: int
    rungs: list[RungSpec]
    hours: float
    cost_usd: float
    main_cost_usd: float
    main_total_steps: int
    corpus_train_tokens: int | None
    notes: list[str] = field(default_factory=list)
    sentence: str = ""
    verdict: str = "go"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rungs"] = [asdict(r) for r in self.rungs]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LadderPlan:
        d = dict(d)
        d["rungs"] = [RungSpec(**r) for r in d["rungs"]]
        return cls(**d)


def rung_tokens_per_sec(main_tokens_per_sec: float, model: ModelConfig, target: ModelConfig) -> float:
    """Tokens/s of one rung alone: the main run's figure scaled by FLOPs/token, then down for the
    narrower width (an estimate; rungs.json records what each rung measured)."""
    halvings = max(0.0, math.log2(target.d_model / model.d_model))
    return main_tokens_per_sec * flops_per_token(target) / flops_per_token(model) * MFU_PER_HALVING ** halvings


def _round_tokens(t: float, tps: int) -> int:
    return max(1, int(round(t / tps))) * tps


def make_ladder_plan(cfg: RunConfig, *, gpu: str, provider: str, price_usd_per_hr: float, cap_usd: float,
                     hours: float = 24.0, main_total_steps: int | None = None, share: float = DEFAULT_SHARE,
                     sizes: int = DEFAULT_SIZES, budgets: int = DEFAULT_BUDGETS, lr_sweep: bool = True,
                     jobs: int = 1, concurrency_gain: float = 1.0, corpus_train_tokens: int | None = None,
                     tokens_per_sec: float | None = None, smallest_width: int | None = None,
                     setup_hours: float = 0.75, tokens_per_param: float | None = None,
                     max_flops: float | None = None, widths: list[int] | None = None,
                     budgets_by: str = "params", budget_step: float = 2.0) -> LadderPlan:
    """The rungs. Their token budgets: each size's smallest is `r` x its parameters, r the largest
    that fits the share of the main run's hours; or r = `tokens_per_param` as given; or the r whose
    rungs add up to `max_flops` of training compute (a benchmark's "5% of the targets' compute").
    With `budgets_by="tokens"` every size trains on the same budgets (r tokens, then `budget_step`
    times the last): a full grid of sizes x budgets, whose small sizes see as many tokens as the
    large ones; with "flops" every size trains at the same compute budgets (iso-FLOP rungs, the
    smallest size longest). `widths` names the sizes instead of `sizes` of the default widths."""
    if not 0 < share < 1:
        raise LadderPlanError(f"--share {share}: a share of the main run's hours, between 0 and 1")
    if budgets_by not in ("params", "tokens", "flops"):
        raise LadderPlanError(f"--budgets-by {budgets_by}: params, tokens or flops")
    if budget_step <= 1:
        raise LadderPlanError(f"--budget-step {budget_step}: each budget must be larger than the last (> 1)")
    if widths is not None:
        sizes = len(widths)
    if sizes < 2 or budgets < 2:
        raise LadderPlanError(f"--sizes {sizes} --budgets {budgets}: the law needs at least 2 sizes and 2 budgets "
                              "(4 sizes x 3 budgets by default)")
    def plan_main(budget: float, hrs: float):
        return make_plan(cfg, gpu=gpu, provider=provider, price_usd_per_hr=price_usd_per_hr, hours=hrs,
                         budget_usd=budget, tokens_per_sec=tokens_per_sec, setup_hours=setup_hours)

    main = plan_main(cap_usd, hours)
    if main_total_steps is None:
        # The ladder comes first: the main run is re-planned on what its hours and dollars leave.
        first = share * main.proposed_total_steps * cfg.train.tokens_per_step / main.tokens_per_sec / 3600.0
        main = plan_main(cap_usd - price_usd_per_hr * first, hours - first)
    steps = main_total_steps or main.proposed_total_steps
    main_train_hours = steps * cfg.train.tokens_per_step / main.tokens_per_sec / 3600.0
    allowance_s = share * main_train_hours * 3600.0
    target_n = param_counts(cfg.model)["total"]
    if widths is not None:
        try:
            models = [scaled_model(cfg.model, w) for w in sorted(set(widths))]
        except ValueError as e:
            raise LadderPlanError(f"--widths: {e}") from None
        bigger = [m.d_model for m in models if param_counts(m)["total"] >= target_n]
        if bigger:
            raise LadderPlanError(f"--widths {bigger[0]}: not smaller than the target's {fmt_count(target_n)} parameters "
                                  f"(d_model {cfg.model.d_model})")
    else:
        models = [scaled_model(cfg.model, w) for w in widths_for(cfg.model, sizes, smallest_width)]
        models = [m for m in models if param_counts(m)["total"] < target_n]
    if len(models) < 2:
        raise LadderPlanError(f"{cfg.name}: the model is too small for a ladder below it (d_model {cfg.model.d_model})")
    tps = {m.d_model: rung_tokens_per_sec(main.tokens_per_sec, m, cfg.model) for m in models}
    multiples = [budget_step ** j for j in range(budgets)]

    def weight(m: ModelConfig) -> float:  # a size's tokens per unit of r
        if budgets_by == "flops":  # r is FLOPs: every size at the same compute, the small ones longest
            return 1.0 / size_facts(m).flops_per_token
        return float(size_facts(m).n_params) if budgets_by == "params" else 1.0

    # Every rung as (size, multiple of r, role, lr scale): the fit's grid, then the lr check on the
    # smallest size at its middle budget. Its cost, its compute and the rungs all come from this list.
    sweep_model, sweep_k = models[0], multiples[len(multiples) // 2]
    units = [(m, k, "fit", 1.0) for m in models for k in multiples]
    if lr_sweep:
        units += [(sweep_model, sweep_k, "lr-sweep", s) for s in LR_SWEEP]
    # GPU seconds per unit of r, concurrency counted, and the fixed start-ups.
    per_unit = sum(weight(m) * k / tps[m.d_model] for m, k, _, _ in units) / concurrency_gain
    n_rungs = len(units)
    start_s = START_SECONDS_CPU if cfg.train.device == "cpu" else START_SECONDS
    fixed = n_rungs * start_s / max(1, jobs)
    if tokens_per_param is None and max_flops is None and allowance_s <= fixed:
        raise LadderRefused(f"the ladder's share ({share:.0%} of the main run's {main_train_hours:.2f} h = "
                            f"{allowance_s / 60:.1f} min) does not cover the start-up of {n_rungs} rungs "
                            f"({fixed / 60:.1f} min): raise --share or train the main run longer")
    if tokens_per_param is not None:
        if budgets_by != "params":
            raise LadderPlanError(f"--tokens-per-param sizes budgets by parameters: not with --budgets-by {budgets_by}")
        r = tokens_per_param
    elif max_flops is not None:
        r = max_flops / sum(weight(m) * k * size_facts(m).flops_per_token for m, k, _, _ in units)
    else:
        r = (allowance_s - fixed) / per_unit  # the smallest budget: tokens per parameter, tokens or FLOPs
    rungs: list[RungSpec] = []

    def add(m: ModelConfig, tokens: float, role: str, lr_scale: float = 1.0) -> None:
        f = size_facts(m)
        rec = recipe(cfg, m, tokens, lr_scale, main_total_steps=steps)
        tokens = rec.total_steps * rec.tokens_per_step
        tag = f"d{m.d_model}-L{m.n_layer}-{fmt_count(tokens)}" + (f"-lr{lr_scale:g}x" if role == "lr-sweep" else "")
        rungs.append(RungSpec(
            name=tag, role=role,
            model={k: getattr(m, k) for k in ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")},
            n_params=f.n_params, n_params_nonembedding=f.n_params_nonembedding, flops_per_token=f.flops_per_token,
            tokens=int(tokens), recipe=asdict(rec), lr_scale=lr_scale, tokens_per_sec=tps[m.d_model],
            eval_every=max(1, rec.total_steps // EVALS_PER_RUNG), start_seconds=start_s))

    for m, k, role, lr_scale in units:
        add(m, r * k * weight(m), role, lr_scale)
    short = [x for x in rungs if x.recipe["total_steps"] < MIN_RUNG_STEPS]
    if short:
        raise LadderRefused(f"the ladder's share buys {short[0].name} only {short[0].recipe['total_steps']} steps "
                            f"(< {MIN_RUNG_STEPS}): raise --share, or fewer --sizes / --budgets")
    if corpus_train_tokens is not None:
        biggest = max(rungs, key=lambda x: x.tokens)
        if biggest.tokens > corpus_train_tokens:
            raise LadderPlanError(f"rung {biggest.name} needs {fmt_count(biggest.tokens)} tokens ({biggest.tokens:,}) "
                                  f"but the corpus holds {fmt_count(corpus_train_tokens)} ({corpus_train_tokens:,}): "
                                  "a rung must see unique tokens; prepare more data or lower --share")
    seconds = sum(x.seconds - start_s for x in rungs) / concurrency_gain + fixed
    hours_l = seconds / 3600.0
    cost = price_usd_per_hr * hours_l
    main_cost = main.cost_usd if main_total_steps is None else price_usd_per_hr * (setup_hours + main_train_hours)
    notes = []
    main_tokens = steps * cfg.train.tokens_per_step
    if corpus_train_tokens is not None and main_tokens > corpus_train_tokens:
        notes.append(f"the main run's {fmt_count(main_tokens)} tokens are {main_tokens / corpus_train_tokens:.1f} "
                     f"passes over the corpus's {fmt_count(corpus_train_tokens)}: the rungs see unique tokens and the "
                     "law is for data seen once, so a run that repeats its data may land above the prediction")
    what = f"1× {GPU_DISPLAY.get(gpu, gpu)}"
    total = cost + main_cost
    sentence = (f"This ladder will run {len(rungs)} rungs on {what} at {usd(price_usd_per_hr)}/h for ~{hours_l:.1f} h = "
                f"{usd(cost)}; with the main run's {usd(main_cost)} that is {usd(total)} of the {usd(cap_usd)} cap.")
    verdict = "go"
    if total > cap_usd:
        verdict = "refuse"
        sentence += (f" Refused: {usd(total)} is over the cap; lower --total-steps or --share "
                     f"({PROVIDER_DISPLAY.get(provider, provider)} at {usd(price_usd_per_hr)}/h).")
    target = {"config": cfg.name, "model": cfg.model.model_dump(), "family": model_family(cfg.model),
              "n_params": param_counts(cfg.model)["total"],
              "n_params_nonembedding": param_counts(cfg.model)["non_embedding"],
              "flops_per_token": size_facts(cfg.model).flops_per_token, "total_steps": steps,
              "tokens_per_step": cfg.train.tokens_per_step, "tokens": main_tokens}
    return LadderPlan(target=target, gpu=gpu, provider=provider, price_usd_per_hr=price_usd_per_hr, cap_usd=cap_usd,
                      share=share, jobs=jobs, rungs=rungs, hours=round(hours_l, 4), cost_usd=round(cost, 2),
                      main_cost_usd=round(main_cost, 2), main_total_steps=steps, corpus_train_tokens=corpus_train_tokens,
                      notes=notes, sentence=sentence, verdict=verdict)


def render(plan: LadderPlan) -> str:
    rows = [f"{'rung':<22} {'role':<8} {'params':>8} {'tokens':>8} {'steps':>6} {'tok/step':>8} {'lr':>9} "
            f"{'tok/s':>7} {'min':>5}"]
    for r in plan.rungs:
        rows.append(f"{r.name:<22} {r.role:<8} {fmt_count(r.n_params):>8} {fmt_count(r.tokens):>8} "
                    f"{r.recipe['total_steps']:>6} {r.recipe['tokens_per_step']:>8} {r.recipe['lr']:>9.2e} "
                    f"{fmt_count(r.tokens_per_sec):>7} {r.seconds / 60:>5.1f}")
    t = plan.target
    lines = [plan.sentence, "",
             f"target   {t['config']}: {fmt_count(t['n_params'])} parameters ({fmt_count(t['n_params_nonembedding'])} "
             f"without the embedding), {t['total_steps']:,} steps = {fmt_count(t['tokens'])} tokens",
             f"share    {plan.share:.0%} of the main run's training hours; {plan.jobs} rung(s) at once", "", *rows]
    lines += [f"note     {n}" for n in plan.notes]
    return "\n".join(lines)
