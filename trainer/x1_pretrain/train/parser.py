"""The trainer's command line: `python -m x1_pretrain.train --help`."""

from __future__ import annotations

import argparse
import logging

from x1_common.contracts import COST_URI_PASSWORD_ENV, COST_URI_USERNAME_ENV, move_uri_credentials_to_env
from x1_pretrain.config import CLI_FLAGS, ConfigError, RunConfig, flags, load_config

log = logging.getLogger("x1.train")

GROUPS = {"run": "the run's flags", "budget": "budget guard (on only with --budget-cap-usd)", "ops": "operations"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.train",
        description="Train the X1 decoder. Exit codes: 0 finished, 75 preempted, 76/77 budget, 78 launch refused, "
        "79 diverged, 80 forecast stop (asked for), 2 bad config/data. Run under torchrun for several GPUs.",
    )
    p.add_argument("--config", required=True, help="run config YAML (configs/x1-50m-a100.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set optim.lr=1e-3 (repeatable)")
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    # The flags that set a config field, made from the field (config.py, `flag`): the default shown
    # is the field's, which the config file may change.
    for f in flags():
        groups[f.group].add_argument(f.name, type=f.type, help=f"{f.help} ({f.path}; default {shown(f.default)})")
    seed = groups["run"]
    seed.add_argument("--resume-from-latest", action="store_true",
                      help="continue from the newest complete, verified checkpoint (no step folder: start fresh; "
                      "step folders of which none verifies: exit 2 naming each, nothing touched)")
    seed.add_argument("--inject-spike-at-step", type=int, metavar="N",
                      help="replace the batches of steps N..N+4 with rare-token sequences (skipped after a natural spike)")
    budget = groups["budget"]
    budget.add_argument("--dry-run-budget", action="store_true", help="walk simulated readings through every rule, print, exit 0")
    ops = groups["ops"]
    ops.add_argument("--allow-config-change", action="store_true",
                     help="resume even though the config hash (model, optimizer, schedule) changed")
    ops.add_argument("--allow-data-change", action="store_true",
                     help="resume on another corpus than the checkpoint trained on (recorded in it and on MLflow)")
    ops.add_argument("--allow-tracking-change", action="store_true",
                     help="resume against another MLflow server: a new MLflow run there, tagged with the old one")
    ops.add_argument("--measured-peak-tflops", type=float, help="this GPU's measured bf16 matmul peak, for a second MFU")
    ops.add_argument("--run-name", help="MLflow run name (default: config name and start time)")
    seed.add_argument("--ladder", metavar="FILE",
                      help="a scaling ladder's ladder.json made on this run's corpus, tokenizer, context and model "
                           "family (python -m x1_pretrain.ladder): its prediction +- its tolerance is the run's band")
    seed.add_argument("--forecast-earlier-runs", nargs="+", metavar="RUN_DIR",
                      help="the run folders (--run-dir) of earlier complete runs of this run's family (the same "
                           "model, tokens a step, peak lr and corpus; other lengths and warm-ups are fine), at least "
                           "two: the forecast's prior is their one law's prediction for this run (docs/FORECAST.md). "
                           "Instead of --ladder")
    seed.add_argument("--band", "--forecast-band", dest="forecast_band", type=float, nargs=2, metavar=("LO", "HI"),
                      help="the run's final val loss band when it has no ladder (default: the lab's 3.20 3.50). "
                           "Declared before the first step, kept by every resume; the definition of done, the "
                           "forecast's alert and the plots judge against it")
    ops.add_argument("--stop-when-forecast-misses-band", action="store_true",
                     help="stop (checkpoint, exit 80) when the forecast's interval lies wholly outside the run's band")
    ops.add_argument("--run-dir", metavar="DIR",
                     help="after a final exit (finished, budget stop, divergence) write the run folder here "
                          "(python -m x1_pretrain.finish: export_run, the spike post-mortem draft, dod)")
    return p


def shown(default: object) -> str:
    return "none" if default is None else f"{default:g}" if isinstance(default, float) else str(default)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {CLI_FLAGS[k]: v for k, v in vars(args).items() if k in CLI_FLAGS and v is not None}
    return load_config(args.config, args.set, overrides)


def credentials_out_of_config(cfg: RunConfig) -> RunConfig:
    """The config with no user:password left in its URIs: they go to the environment, where the
    clients read them, so no param, state file, log line or error of the run can carry them."""
    try:
        mlflow_uri = move_uri_credentials_to_env(cfg.tracking.mlflow_uri, "MLFLOW_TRACKING_USERNAME",
                                                 "MLFLOW_TRACKING_PASSWORD", "tracking.mlflow_uri (--mlflow-uri)")
        cost_uri = move_uri_credentials_to_env(cfg.budget.curr_cost_uri, COST_URI_USERNAME_ENV, COST_URI_PASSWORD_ENV,
                                               "budget.curr_cost_uri (--budget-curr-cost-uri)")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg.model_copy(update={
        "tracking": cfg.tracking.model_copy(update={"mlflow_uri": mlflow_uri}),
        "budget": cfg.budget.model_copy(update={"curr_cost_uri": cost_uri}),
    })
