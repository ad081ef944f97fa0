"""`python -m x1_pretrain.finish --mlflow-uri U --output DIR`: the run folder, in one command.

    1. export_run    manifest, metrics, plots, final.safetensors (docs/DESIGN.md §3)
    2. postmortem    the spike post-mortem draft, DIR/spike-postmortem.md (kept if it exists)
    3. dod           the six checks, recorded in DIR/dod.json; check 6 (instance terminated) is
                     "pending" while the instance that runs this is still up

The trainer runs the same steps itself after a final exit (finished, budget stop, divergence)
when given `--run-dir DIR` (compose gives /workspace/run), so the folder is complete on the
workspace volume before a `--terminate-on-finish` watchdog ends the instance. The watchdog then
writes what it sent and the instance as the provider showed it afterwards into the folder as
termination.json, and `dod` on the folder, wherever it is read later, passes check 6 too. Without terminate-on-finish: terminate the
instance yourself, save the dashboard's screenshot as DIR/termination.png with a note beside it
(DIR/termination-note.txt: which instance, when, what it shows), run `dod DIR`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from x1_common.contracts import ExitCode, move_uri_credentials_to_env
from x1_pretrain.run import dod, postmortem
from x1_pretrain.run import export as export_run

log = logging.getLogger("x1.finish")

TERMINATION_CHECK = 6


def write_run_folder(mlflow_uri: str, output: Path, *, run_id: str | None = None, ckpt_dir: Path | None = None,
                     extra_export: list[str] | None = None, band: tuple[float, float] | None = None,
                     cap_usd: float | None = None, force: bool = True) -> int:
    """export_run -> postmortem -> dod. Returns 0 when the folder is complete and checks 1-5 pass,
    1 when a check fails, 2 when the export or the post-mortem could not be written. Never raises:
    the trainer calls this after its final exit and must still exit with its own code."""
    which = ["--run-id", run_id] if run_id else []
    export = ["--mlflow-uri", mlflow_uri, "--output", str(output), *which, *(extra_export or [])]
    if ckpt_dir is not None:
        export += ["--ckpt-dir", str(ckpt_dir)]
    if band is not None:
        export += ["--band", f"{band[0]:g}", f"{band[1]:g}"]
    if force and (output / "manifest.json").is_file():  # replace an earlier export, never a folder of something else
        export.append("--force")
    try:
        log.info("run folder %s: 1/3 export_run", output)
        if export_run.main(export) != 0:
            log.error("run folder %s not written: export_run failed (its error is above); write it later with "
                      "python -m x1_pretrain.finish --mlflow-uri ... --output %s", output, output)
            return int(ExitCode.USAGE)
        target = output / "spike-postmortem.md"
        if target.exists():
            log.info("run folder %s: 2/3 %s exists (it may hold what a person wrote): kept", output, target.name)
        else:
            log.info("run folder %s: 2/3 the spike post-mortem draft", output)
            if postmortem.main(["--mlflow-uri", mlflow_uri, "--output", str(target), *which]) != 0:
                log.error("run folder %s: the post-mortem draft failed (its error is above)", output)
                return int(ExitCode.USAGE)
        log.info("run folder %s: 3/3 dod (check %d stays pending until the instance is terminated)", output,
                 TERMINATION_CHECK)
        checks = [str(output), "--termination-pending"]
        if band is not None:
            checks += ["--band", f"{band[0]:g}", f"{band[1]:g}"]
        if cap_usd is not None:
            checks += ["--cap-usd", f"{cap_usd:g}"]
        code = dod.main(checks)
    except Exception:  # noqa: BLE001 - whatever broke, the trainer's exit code must still reach the watchdog
        log.exception("run folder %s: writing it failed", output)
        return int(ExitCode.USAGE)
    return 0 if code in (0, dod.EXIT_PENDING) else code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.finish",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1],
        epilog="Exit codes: 0 the folder is complete and checks 1-5 pass (6 passes or is pending); 1 a check "
               "fails (the table names it); 2 the export or the post-mortem could not be written.",
    )
    p.add_argument("--mlflow-uri", required=True, help="tracking URI: sqlite:///..., http://host:5000 or file:///...")
    p.add_argument("--output", required=True, metavar="DIR", help="the run folder (created; replaced exports keep "
                   "the files export_run does not write, such as a filled-in post-mortem)")
    p.add_argument("--run-id", help="MLflow run id (default: the newest run the trainer logged)")
    p.add_argument("--ckpt-dir", metavar="K", help="checkpoint dir (default: the run's x1.ckpt_dir tag)")
    for flag, what in (("--budget-file", "the sidecar's budget.json"), ("--termination-file", "the watchdog's "
                       "termination.json or a screenshot .png"), ("--events-file", "the watchdog's events")):
        p.add_argument(flag, metavar="F", help=f"{what} (default: beside the checkpoint dir, as export_run)")
    p.add_argument("--band", nargs=2, type=float, metavar=("LO", "HI"),
                   help="final val loss band (default 3.20 3.50; a short or tiny run uses its own)")
    p.add_argument("--cap-usd", type=float, metavar="USD", help="spend cap for check 4 (default: the recorded one)")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:  # user:password in the URI go to MLflow's own variables: never into a message or a file
        args.mlflow_uri = move_uri_credentials_to_env(args.mlflow_uri, "MLFLOW_TRACKING_USERNAME",
                                                      "MLFLOW_TRACKING_PASSWORD", "--mlflow-uri")
    except ValueError as e:
        print(f"finish: error: {e}", file=sys.stderr)
        return int(ExitCode.USAGE)
    extra = []
    for name in ("budget_file", "termination_file", "events_file"):
        if getattr(args, name):
            extra += [f"--{name.replace('_', '-')}", getattr(args, name)]
    band = None if args.band is None else (float(args.band[0]), float(args.band[1]))
    return write_run_folder(args.mlflow_uri, Path(args.output), run_id=args.run_id,
                            ckpt_dir=Path(args.ckpt_dir) if args.ckpt_dir else None, extra_export=extra, band=band,
                            cap_usd=args.cap_usd)


if __name__ == "__main__":
    sys.exit(main())
