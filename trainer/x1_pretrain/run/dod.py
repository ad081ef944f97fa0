"""`python -m x1_pretrain.dod RUN_DIR`: the six definition-of-done checks.

    1. manifest.json has seed, versions (torch, flash-attn, transformers, numpy), config hash,
       cluster spec and total spend as spent_usd
    2. the final val loss is within the band ([3.20, 3.50]; --band for short runs)
    3. final.safetensors matches the manifest's sha256 and reloads byte-equivalently
       (load, save, compare bytes and tensors)
    4. total spend <= cap
    5. spike-postmortem.md exists
    6. the instance is terminated: termination.json, checked: the instance read back from the
       provider after the terminate (`instance_after`) shows its terminated state, or the API's own
       not-found for its id (the terminate call's answer alone does not count); or a screenshot
       termination.png with a person's termination-note.txt beside it, accepted as NOT verified

Prints a table with a reason on every line and writes RUN_DIR/dod.json (atomically) for the demo
and CI. Exit 0 only when all six pass. A folder without manifest.json is not a run folder: exit 2,
nothing written into it. `--termination-pending` is for the instance itself, before its terminate
(python -m x1_pretrain.finish): a failing check 6 shows as PENDING, and exit 3 says that it is the
only one not passing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from x1_common.contracts import LAMBDA_NOT_FOUND_CODE, TERMINATED_RAW_STATUS, ExitCode, format_utc, utc_now
from x1_common.fsutil import sha256_file, write_json_atomic
from x1_common.scaling import BAND_SOURCES, LAB_BAND, DeclaredBand, declare_band
from x1_pretrain.run.record import ExportError
from x1_pretrain.train.forecast_rule import summary_text

DEFAULT_BAND = LAB_BAND  # the lab's, for a run that declared no band of its own
LAB_CAP_USD = 35.0
REQUIRED_VERSIONS = ("torch", "flash-attn", "transformers", "numpy")
EXIT_FAILED = 1
EXIT_PENDING = 3  # --termination-pending: checks 1-5 pass, the instance is not terminated yet
TERMINATION_CHECK = 6
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TERMINATION_NOTE = "termination-note.txt"  # a person's note beside a screenshot: which instance, when, what it shows


@dataclass(frozen=True)
class Check:
    number: int
    name: str
    ok: bool
    reason: str
    pending: bool = False  # not passing yet, and not expected to before the instance is terminated


def _load_manifest(run_dir: Path) -> tuple[dict[str, Any] | None, str]:
    path = run_dir / "manifest.json"
    if not path.is_file():
        return None, "no manifest.json in the run folder (run export_run first)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"manifest.json is not readable JSON ({e})"
    if not isinstance(manifest, dict):
        return None, "manifest.json is not a JSON object"
    return manifest, ""


def check_manifest(manifest: dict[str, Any] | None, problem: str) -> Check:
    name = "manifest complete"
    if manifest is None:
        return Check(1, name, False, problem)
    missing = []
    if manifest.get("seed") is None:
        missing.append("seed")
    versions = manifest.get("versions") if isinstance(manifest.get("versions"), dict) else {}
    for pkg in REQUIRED_VERSIONS:
        value = versions.get(pkg)
        if not isinstance(value, str) or not value or value.startswith("unknown"):
            missing.append(f"versions.{pkg}")
    if not manifest.get("config_sha256"):
        missing.append("config_sha256")
    cluster = manifest.get("cluster")
    if not isinstance(cluster, dict) or "gpu_name" not in cluster or "gpu_count" not in cluster:
        missing.append("cluster (gpu_name, gpu_count)")
    if "spent_usd" not in manifest:
        missing.append("spent_usd")
    if missing:
        return Check(1, name, False, f"manifest.json lacks {', '.join(missing)}")
    spent = manifest["spent_usd"]
    return Check(1, name, True, f"seed {manifest['seed']}, torch {versions['torch']}, flash-attn {versions['flash-attn']}, "
                 f"config {str(manifest['config_sha256'])[:12]}, {machine(cluster or {})}, "
                 f"spent_usd {'null (see check 4)' if spent is None else spent}")


def machine(cluster: dict[str, Any]) -> str:
    """The manifest's machine in words: `1x NVIDIA A100-SXM4-80GB on lambda`, `no GPU (CPU, 2 vCPUs)`."""
    count, name = cluster.get("gpu_count"), cluster.get("gpu_name")
    provider = cluster.get("provider")
    where = f" on {provider}" if provider and provider != "unknown" else ""
    if not isinstance(count, (int, float)) or count < 1 or name in (None, "", "none", "unknown"):
        cpu = cluster.get("cpu")
        return f"no GPU (CPU{f', {cpu}' if cpu and cpu != 'unknown' else ''}){where}"
    return f"{int(count)}x {name}{where}"


def judged_band(manifest: dict[str, Any] | None, flag: tuple[float, float] | None) -> tuple[DeclaredBand, str]:
    """The band check 2 judges against: the run's `declared_band` (fixed before its first step),
    else --band, else the lab's; and a note when --band was given but the run declared another."""
    declared = DeclaredBand.from_dict((manifest or {}).get("declared_band"))
    if declared is not None and declared.source == "lab" and flag is not None:
        # The run chose no band (the lab's applied by default): a band given here is the one asked for.
        return declare_band(None, flag), "; the run declared no band of its own: --band as given"
    if declared is not None:
        ignored = ""
        if flag is not None and (flag[0], flag[1]) != (declared.low, declared.high):
            ignored = f"; --band {flag[0]:g} {flag[1]:g} not used: the run declared its band before its first step"
        return declared, ignored
    return declare_band(None, flag), ""


def check_val_loss(manifest: dict[str, Any] | None, band: DeclaredBand, note: str = "") -> Check:
    name = "final val loss in band"
    lo, hi = band.low, band.high
    if manifest is None:
        return Check(2, name, False, "no manifest: no final val loss to check")
    val = manifest.get("final_val_loss")
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        return Check(2, name, False, "the manifest has no final_val_loss (the run never evaluated?)")
    where = f" (step {manifest['final_val_loss_step']})" if manifest.get("final_val_loss_step") is not None else ""
    # Did the run match the predictions? Its own forecast at 10/25/50%, and the Chinchilla figure.

    chinchilla = manifest.get("predicted_val_loss")
    lab = ""
    if band.source != "lab":
        a, b = LAB_BAND
        lab = f"; the lab's [{a:.2f}, {b:.2f}]: {'inside' if a <= val <= b else 'below' if val < a else 'above'} it"
    beside = f"{lab}; {summary_text(manifest.get('forecast'))}" + (
        f"; Chinchilla fit {chinchilla:.3f} (other corpus and tokenizer: a guide)" if isinstance(chinchilla, (int, float)) else "")
    verdict = "is within" if lo <= val <= hi else "is outside"
    if (wide := band.width_warning()) is not None:
        note = f"{note}; {wide}"
    return Check(2, name, lo <= val <= hi, f"final val loss {val:.4f}{where} {verdict} {band.describe()}{beside}{note}")


def check_weights(run_dir: Path, manifest: dict[str, Any] | None) -> Check:
    """sha256 against the manifest, then load -> save -> compare bytes and every tensor."""
    # torch, and the weights modules built on it, only here: the other checks run where torch is
    # not installed (the laptop's `x1 down` verify, the watchdog's image).
    import torch
    from safetensors.torch import load as load_bytes

    from x1_pretrain.checkpoint.load import load_weights
    from x1_pretrain.checkpoint.weights import weights_bytes

    name = "final.safetensors round trip"
    path = run_dir / "final.safetensors"
    if not path.is_file():
        return Check(3, name, False, "no final.safetensors in the run folder")
    expected = ((manifest or {}).get("final_weights") or {}).get("sha256")
    if not expected:
        return Check(3, name, False, "the manifest records no final_weights.sha256 to compare with")
    actual = sha256_file(path)
    if actual != expected:
        return Check(3, name, False, f"final.safetensors sha256 {actual[:12]} differs from the manifest's {expected[:12]}")
    try:
        state, model_cfg, metadata = load_weights(path)
    except Exception as e:  # noqa: BLE001 - ConfigError, SafetensorError, OSError...: any of them fails the check
        return Check(3, name, False, f"final.safetensors does not load: {e}")
    extra = {k: v for k, v in metadata.items() if k not in ("format", "model_config")}
    saved = weights_bytes(state, model_cfg, extra)
    original = path.read_bytes()
    if saved != original:
        return Check(3, name, False, f"load -> save gives {len(saved):,} bytes that differ from the file's {len(original):,}")
    reloaded = load_bytes(saved)
    if reloaded.keys() != state.keys():
        return Check(3, name, False, "the re-saved file holds other tensor names than the original")
    unequal = [k for k in state if reloaded[k].dtype != state[k].dtype or not torch.equal(reloaded[k], state[k])]
    if unequal:
        return Check(3, name, False, f"tensors differ after load -> save -> load: {', '.join(unequal[:5])}")
    return Check(3, name, True, f"sha256 {actual[:12]} matches the manifest; load -> save gives the same "
                 f"{len(original):,} bytes and {len(state)} equal tensors")


def _recorded_cap(run_dir: Path, manifest: dict[str, Any] | None) -> tuple[float | None, str]:
    cap = (manifest or {}).get("cap_usd")
    if isinstance(cap, (int, float)) and not isinstance(cap, bool):
        return float(cap), "the manifest's cap_usd"
    try:
        cap = json.loads((run_dir / "budget.json").read_text()).get("cap_usd")
        if isinstance(cap, (int, float)) and not isinstance(cap, bool):
            return float(cap), "budget.json's cap_usd"
    except (OSError, ValueError, AttributeError):
        pass
    return None, ""


def check_spend(run_dir: Path, manifest: dict[str, Any] | None, cap_flag: float | None) -> Check:
    name = "spend within cap"
    if cap_flag is not None:
        cap, source = cap_flag, "--cap-usd"
    else:
        cap, source = _recorded_cap(run_dir, manifest)
        if cap is None:
            cap, source = LAB_CAP_USD, "the lab's cap"
    if manifest is None:
        return Check(4, name, False, "no manifest: no total spend to check")
    spent = manifest.get("spent_usd")
    if isinstance(spent, bool) or not isinstance(spent, (int, float)):
        why = manifest.get("spent_usd_reason") or "spent_usd is missing or null"
        return Check(4, name, False, f"total spend unknown: {why}")
    stale = " (last reading marked stale: an estimate)" if manifest.get("spent_usd_note") else ""
    if spent <= cap:
        return Check(4, name, True, f"spent ${spent:.2f} <= cap ${cap:.2f} ({source}){stale}")
    return Check(4, name, False, f"spent ${spent:.2f} is over the cap ${cap:.2f} ({source}){stale}")


def check_postmortem(run_dir: Path) -> Check:
    name = "spike post-mortem"
    path = run_dir / "spike-postmortem.md"
    if not path.is_file() or path.stat().st_size == 0:
        return Check(5, name, False, "no spike-postmortem.md (write it with python -m x1_pretrain.postmortem)")
    text = path.read_text(encoding="utf-8", errors="replace")
    todo = sum(1 for line in text.splitlines() if line.lstrip("> ").startswith("TODO(person)"))
    draft = f"; {todo} prompt(s) still marked TODO(person)" if todo else ""
    return Check(5, name, True, f"spike-postmortem.md exists{draft}")


def termination_evidence(record: Any) -> str | None:
    """What in a termination record shows the instance terminated, or None.

    The record (the watchdog's --terminate-on-finish or `x1 down`) must hold what the provider
    showed when the instance was read back after the terminate, `instance_after`: its status is the
    provider's terminated state (Lambda "terminated", RunPod "TERMINATED") for that instance's id,
    or it is the API's own not-found answer for that id (Lambda's error code
    global/object-does-not-exist; RunPod's GraphQL "not found" error or a null pod). The answer to
    the terminate call alone never passes: a pod that answered podTerminate can go on running.
    """
    if not isinstance(record, dict):
        return None
    after = record.get("instance_after")
    instance_id = record.get("instance_id")
    if not isinstance(after, dict) or not isinstance(instance_id, str) or not instance_id:
        return None
    provider = record.get("provider")
    raw = after.get("raw") if isinstance(after.get("raw"), dict) else {}
    if after.get("status") == "terminated":
        word = TERMINATED_RAW_STATUS.get(provider) if isinstance(provider, str) else None
        shown_id = raw.get("id", after.get("instance_id", instance_id))
        if word is not None and after.get("raw_status") == word and shown_id == instance_id:
            return f"read back after the terminate, {provider} lists instance {instance_id} {word}"
        return None
    if after.get("status") == "not-found" and after.get("instance_id") == instance_id:
        api_error = after.get("api_error")
        if provider == "lambda" and isinstance(api_error, dict) and api_error.get("code") == LAMBDA_NOT_FOUND_CODE:
            return f"read back after the terminate, Lambda answers {LAMBDA_NOT_FOUND_CODE} for instance {instance_id}"
        if provider == "runpod" and (api_error == {"data": {"pod": None}} or (
                isinstance(api_error, list) and any(isinstance(e, dict) and "not found" in str(e.get("message", "")).lower()
                                                     for e in api_error))):
            return f"read back after the terminate, RunPod's API no longer knows pod {instance_id}"
    return None


def check_termination(run_dir: Path) -> Check:
    name = "instance terminated"
    problems = []
    record_path, shot = run_dir / "termination.json", run_dir / "termination.png"
    if record_path.is_file():
        try:
            evidence = termination_evidence(json.loads(record_path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            evidence, problems = None, [f"termination.json is not JSON ({e})"]
        if evidence:
            return Check(6, name, True, f"termination.json: {evidence}")
        problems = problems or ["termination.json shows no terminated instance (its instance_after, read back from "
                                "the provider after the terminate, is not the provider's terminated state nor its "
                                "own not-found for that id)"]
    if shot.is_file():
        # A picture proves nothing by itself (any PNG decodes): it passes only with a person's note
        # beside it saying what it shows, and the verdict says it was not verified.
        problem = _png_problem(shot)
        note = run_dir / TERMINATION_NOTE
        if problem is None and not (note.is_file() and note.read_text(encoding="utf-8", errors="replace").strip()):
            problem = (f"termination.png has no {TERMINATION_NOTE} beside it: write there when you terminated which "
                       "instance and what the screenshot shows (a picture alone is not checked)")
        if problem is None:
            return Check(6, name, True, f"termination.png with {TERMINATION_NOTE}: a screenshot, NOT verified by dod "
                                        "(look at it; termination.json from --terminate-on-finish is checked)")
        problems.append(problem)
    if not problems:
        problems = ["no termination.json and no termination.png (the watchdog's --terminate-on-finish writes the "
                    "record; or save the provider dashboard's screenshot as termination.png)"]
    return Check(6, name, False, "; ".join(problems))


def _png_problem(path: Path) -> str | None:
    from PIL import Image

    if path.read_bytes()[:8] != PNG_SIGNATURE:
        return "termination.png is not a PNG"
    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a broken image
        return f"termination.png does not decode ({e})"
    return None


def run_checks(run_dir: Path, flag_band: tuple[float, float] | None, cap_usd: float | None) -> list[Check]:
    manifest, problem = _load_manifest(run_dir)
    band, note = judged_band(manifest, flag_band)
    return [
        check_manifest(manifest, problem),
        check_val_loss(manifest, band, note),
        check_weights(run_dir, manifest),
        check_spend(run_dir, manifest, cap_usd),
        check_postmortem(run_dir),
        check_termination(run_dir),
    ]


def mark_pending(check: Check) -> Check:
    """Check 6 on the instance itself, before its terminate: it cannot pass yet."""
    if check.ok:
        return check
    return replace(check, pending=True, reason="the instance running this check is still up: --terminate-on-finish "
                   "adds the instance as the provider shows it after the terminate here as termination.json; otherwise terminate it "
                   "yourself, save the dashboard's screenshot here as termination.png with termination-note.txt (which "
                   "instance, when, what it shows) and run dod on this folder again")


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'#':>2}  {'check':<{width}}  result   reason"]
    lines += [f"{c.number:>2}  {c.name:<{width}}  {'PASS' if c.ok else 'PENDING' if c.pending else 'FAIL':<7}  {c.reason}"
              for c in checks]
    failed = [c for c in checks if not c.ok and not c.pending]
    pending = [c for c in checks if c.pending]
    if failed:
        lines.append(f"{len(failed)} of {len(checks)} checks FAIL: " + ", ".join(f"{c.number} ({c.name})" for c in failed))
    if pending:
        lines.append(", ".join(f"check {c.number} ({c.name})" for c in pending) + " pending")
    if not failed and not pending:
        lines.append(f"all {len(checks)} checks pass")
    elif not failed:
        lines.append(f"{len(checks) - len(pending)} of {len(checks)} checks pass")
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    if all(c.ok for c in checks):
        return 0
    return EXIT_PENDING if all(c.ok or c.pending for c in checks) else EXIT_FAILED


def report(run_dir: Path, checks: list[Check], band: DeclaredBand) -> dict[str, Any]:
    return {"run_dir": str(run_dir.resolve()), "passed": all(c.ok for c in checks), "checked_utc": format_utc(utc_now()),
            "band": [band.low, band.high], "band_source": band.source, "pending": [c.number for c in checks if c.pending],
            "checks": [asdict(c) for c in checks]}


def _find_instance_type(obj: Any) -> str | None:
    """The instance type anywhere in a provider record: Lambda's instance_type.name, RunPod's
    machine.gpuDisplayName or gpuTypeId."""
    if isinstance(obj, dict):
        it = obj.get("instance_type")
        if isinstance(it, dict) and isinstance(it.get("name"), str):
            return it["name"]
        for key in ("gpuDisplayName", "gpuTypeId"):
            if isinstance(obj.get(key), str):
                return obj[key]
        values = list(obj.values())
    elif isinstance(obj, list):
        values = obj
    else:
        return None
    for v in values:
        found = _find_instance_type(v)
        if found:
            return found
    return None


def termination_facts(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    if path.suffix.lower() == ".png":
        return {"file": "termination.png", "source": str(path), "kind": "screenshot"}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ExportError(f"termination record {path}: not JSON ({e})") from None
    evidence = termination_evidence(record)
    facts = {"file": "termination.json", "source": str(path), "kind": "provider record",
             "shows_terminated": evidence is not None, "evidence": evidence}
    if isinstance(record, dict):
        for key in ("provider", "instance_id", "time"):
            if isinstance(record.get(key), str):
                facts[key] = record[key]
    facts["instance_type"] = _find_instance_type(record)
    return facts


def recheck_termination(run_dir: Path) -> Check | None:
    """Check 6 again, after the watchdog wrote its termination record into the folder: dod.json's
    line for it is replaced (the other lines stand as checked). None when there is no dod.json."""
    path = run_dir / "dod.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        checks = [Check(**c) for c in saved["checks"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    check = check_termination(run_dir)
    checks = [check if c.number == TERMINATION_CHECK else c for c in checks]
    lo, hi = saved.get("band", LAB_BAND)
    band = DeclaredBand(float(lo), float(hi), saved.get("band_source") if saved.get("band_source") in BAND_SOURCES else "flag")
    write_json_atomic(path, {**report(run_dir, checks, band),
                             "checked_utc": saved.get("checked_utc"), "rechecked_utc": {str(TERMINATION_CHECK): format_utc(utc_now())}})
    return check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m x1_pretrain.dod",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check a run folder against the definition of done (docs/DESIGN.md §8):\n\n" + __doc__.split("\n\n", 1)[1],
        epilog="Exit codes: 0 all checks pass; 1 at least one fails (the table names it); 2 bad usage or not a run "
               "folder; 3 with --termination-pending: checks 1-5 pass and 6 is pending.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the folder export_run wrote")
    p.add_argument("--band", nargs=2, type=float, metavar=("LO", "HI"),
                   help="final val loss band for a run folder that records none (default: the run's declared_band, "
                        "else the lab's 3.20 3.50)")
    p.add_argument("--cap-usd", type=float, metavar="USD",
                   help="spend cap (default: the cap recorded in the manifest or budget.json, else the lab's $35)")
    p.add_argument("--termination-pending", action="store_true",
                   help="run on the instance before its terminate: a failing check 6 is PENDING (exit 3 when it is "
                        "the only one not passing)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    band = None if args.band is None else (float(args.band[0]), float(args.band[1]))
    if not run_dir.is_dir():
        print(f"dod: error: RUN_DIR {run_dir} is not a folder", file=sys.stderr)
        return int(ExitCode.USAGE)
    if band is not None and not (math.isfinite(band[0]) and math.isfinite(band[1]) and band[0] < band[1]):
        print(f"dod: error: --band {band[0]} {band[1]}: LO must be below HI, both finite", file=sys.stderr)
        return int(ExitCode.USAGE)
    if args.cap_usd is not None and args.cap_usd <= 0:
        print(f"dod: error: --cap-usd {args.cap_usd}: must be above 0", file=sys.stderr)
        return int(ExitCode.USAGE)
    if not (run_dir / "manifest.json").is_file():
        # Writing dod.json here would leave a stray file in a folder that is not ours.
        print(f"dod: error: RUN_DIR {run_dir} is not a run folder (no manifest.json): write one with "
              f"python -m x1_pretrain.export_run --output {run_dir} (or python -m x1_pretrain.finish)", file=sys.stderr)
        return int(ExitCode.USAGE)
    checks = run_checks(run_dir, band, args.cap_usd)
    if args.termination_pending:
        checks = [mark_pending(c) if c.number == TERMINATION_CHECK else c for c in checks]
    print(render(checks))
    try:
        write_json_atomic(run_dir / "dod.json", report(run_dir, checks, judged_band(_load_manifest(run_dir)[0], band)[0]))
    except OSError as e:
        print(f"dod: warning: cannot write {run_dir / 'dod.json'}: {e}", file=sys.stderr)
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
