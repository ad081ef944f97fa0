"""What a trainer launch was given, so that a corrected mistake can be told from the same one.

A trainer that exits 2 (a bad config or bad data) or fails twice at start-up with the same error
(81) is not launched again: the same launch would fail the same way. Once the person has fixed
what it was refused for, though (TOTAL_STEPS in .env, a flag, the data re-prepared), holding on to
that decision would leave a rented GPU idle with the stack looking healthy. So the watchdog keeps,
with such a decision, the launch's inputs, and launches the trainer again when they have changed:

    args              the trainer's command-line arguments (after its launcher: x1-train or
                      trainer/entrypoint.sh), URI credentials masked
    env               the trainer's own variables (TRAINER_ENV: its launcher's settings and the
                      alert channels; secrets left out)
    config_sha256     the --config file's bytes, where this process can read it
    data_meta_sha256  the --data-dir's meta.json bytes (written last by the tokenizer)

Two processes compute them: the watchdog, from its trainer command (process mode) or the trainer
container's command and environment (docker mode), and the trainer's own launcher before it
trains (x1_watchdog.gate, which compose's `up` runs in a recreated container). A field one of
them cannot see (the config inside the trainer image, from the watchdog's container) is None and
not compared, so both reach the same verdict from what both can see.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from x1_common.contracts import strip_uri_credentials

# The trainer's environment that changes what it does (compose.yaml's trainer `environment:`, the
# process stack's the same), secrets and cache paths left out.
TRAINER_ENV = ("NPROC", "NNODES", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_JOIN_TIMEOUT", "X1_TRAIN_EXTRA_ARGS",
               "SMTP_HOST", "SMTP_PORT", "SMTP_USER", "SMTP_FROM", "SMTP_TO", "SMTP_STARTTLS")

LAUNCHERS = ("x1-train", "entrypoint.sh")  # the image's launcher, and the same script in process mode
SHELLS = ("bash", "sh")


def launch_args(command: Sequence[str]) -> tuple[list[str], dict[str, str | None]]:
    """The trainer's arguments in a command line, and what an `env` prefix sets (a value) or unsets
    (None): `env -u K ... bash .../entrypoint.sh ARGS` (process mode) or `x1-train ARGS`
    (compose's command). Another command is taken whole, after its program."""
    words = list(command)
    changes: dict[str, str | None] = {}
    if words and Path(words[0]).name == "env":
        i = 1
        while i < len(words):
            if words[i] == "-u" and i + 1 < len(words):
                changes[words[i + 1]] = None
                i += 2
            elif "=" in words[i] and not words[i].startswith("-"):
                key, _, value = words[i].partition("=")
                changes[key] = value
                i += 1
            else:
                break
        words = words[i:]
    if len(words) >= 2 and Path(words[0]).name in SHELLS and Path(words[1]).name in LAUNCHERS:
        return words[2:], changes
    return words[1:], changes


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of `flag` (argparse keeps the last): `--flag=V` or `--flag V`."""
    value = None
    for i, word in enumerate(args):
        if word.startswith(flag + "="):
            value = word.split("=", 1)[1]
        elif word == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def file_sha256(path: str | None) -> str | None:
    """The file's sha256, None when it cannot be read here (then the field is not compared)."""
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def trainer_inputs(args: Sequence[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """The inputs of a launch with these arguments and this environment (see the module's doc)."""
    env = {k: environ.get(k, "") for k in TRAINER_ENV}
    # The launcher appends X1_TRAIN_EXTRA_ARGS, split on spaces: its flags count where given twice.
    effective = [*args, *env["X1_TRAIN_EXTRA_ARGS"].split()]
    data_dir = flag_value(effective, "--data-dir")
    return {
        "args": [strip_uri_credentials(a) for a in args],
        "env": env,
        "config_sha256": file_sha256(flag_value(effective, "--config")),
        "data_meta_sha256": file_sha256(os.path.join(data_dir, "meta.json")) if data_dir else None,
    }


def command_inputs(command: Sequence[str], environ: Mapping[str, str]) -> dict[str, Any]:
    """The inputs of the trainer `command` run with `environ` (its `env` prefix applied)."""
    args, changes = launch_args(command)
    env = dict(environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return trainer_inputs(args, env)


def changes(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[str]:
    """What differs between two launches' inputs, in words; [] when nothing both can see did."""
    if not old or not new:
        return []
    out = []
    old_args, new_args = old.get("args"), new.get("args")
    if isinstance(old_args, list) and isinstance(new_args, list) and old_args != new_args:
        gone = [a for a in old_args if a not in new_args]
        added = [a for a in new_args if a not in old_args]
        if gone or added:
            out.append("arguments " + ", ".join([*(f"{a} (was)" for a in gone), *(f"{a} (now)" for a in added)]))
        else:
            out.append("the order of the arguments")
    old_env, new_env = old.get("env"), new.get("env")
    if isinstance(old_env, dict) and isinstance(new_env, dict):
        for key in sorted(set(old_env) | set(new_env)):
            if old_env.get(key, "") != new_env.get(key, ""):
                out.append(f"{key} {old_env.get(key, '')!r} -> {new_env.get(key, '')!r}")
    for field, what in (("config_sha256", "the --config file"), ("data_meta_sha256", "the data's meta.json")):
        if old.get(field) is not None and new.get(field) is not None and old[field] != new[field]:
            out.append(f"{what} (sha256 {old[field][:12]} -> {new[field][:12]})")
    return out
