#!/usr/bin/env bash
# x1-train: `python -m x1_pretrain.train ARGS`, or the same under torchrun when NPROC > 1.
#
#   NPROC=1 (default)   exec python -m x1_pretrain.train ARGS
#   NPROC=N             torchrun --standalone --nproc_per_node=N ... x1_pretrain.train ARGS
#   X1_TRAIN_EXTRA_ARGS appended to ARGS, split on spaces ("--inject-spike-at-step 12000")
#   X1_PYTHON           the interpreter (default: python on PATH; the process runner gives its own)
#   a final decision in the watchdog's state file: no training, exit with its code
#
# The trainer's exit code is what the watchdog acts on (75 relaunch, 76/77 budget stop, 0 done,
# ...). torchrun reports any failed worker as exit 1, so under torchrun each worker runs through
# this script's --worker mode, which records its exit code in a file per rank; the launcher then
# exits with rank 0's code — or, when torchrun's teardown killed rank 0 after another rank failed
# on its own (a config error on every rank: whichever is first), with that rank's code.
set -euo pipefail

if [[ "${1:-}" == "--worker" ]]; then
  shift
  # torchrun signals the worker's whole process group, so python receives SIGTERM itself and
  # writes its emergency checkpoint. The trap only keeps this shell alive until python has exited
  # and its code is recorded (a trapped signal runs after the foreground child returns).
  trap 'true' TERM INT
  code=0
  "${X1_PYTHON:-python}" -m x1_pretrain.train "$@" || code=$?
  if [[ -n "${X1_EXIT_DIR:-}" ]]; then
    echo "$code" > "$X1_EXIT_DIR/rank${RANK:-0}"
  fi
  exit "$code"
fi

# Compose starts this container on every `docker compose up`; after the watchdog's final decision
# (finished, budget stop, divergence, given up) that start must not train on: exit with the
# decision's code instead (x1_watchdog.gate; the state file is the watchdog's --state-file).
state_file="${X1_WATCHDOG_STATE_FILE:-/workspace/logs/watchdog-state.json}"
if [[ -f "$state_file" ]]; then
  final="$("${X1_PYTHON:-python}" -m x1_watchdog.gate "$state_file")" || exit 2
  if [[ -n "$final" ]]; then
    exit "$final"
  fi
fi

nproc="${NPROC:-1}"
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
  echo "x1-train: NPROC must be a whole number >= 1 (processes, one per GPU), got '$nproc'" >&2
  exit 2
fi

extra=()
if [[ -n "${X1_TRAIN_EXTRA_ARGS:-}" ]]; then
  read -r -a extra <<< "$X1_TRAIN_EXTRA_ARGS"
fi

if [[ "$nproc" == 1 ]]; then
  # One process: python replaces this shell and receives docker's SIGTERM directly.
  exec "${X1_PYTHON:-python}" -m x1_pretrain.train "$@" "${extra[@]}"
fi

X1_EXIT_DIR="$(mktemp -d -t x1-exit.XXXXXX)"
export X1_EXIT_DIR
torchrun --standalone --nproc_per_node="$nproc" --no-python "$0" --worker "$@" "${extra[@]}" &
launcher=$!
# docker stop signals this shell only; torchrun passes the signal on to every worker.
trap 'kill -TERM "$launcher" 2>/dev/null || true' TERM
trap 'kill -INT "$launcher" 2>/dev/null || true' INT
status=0
while :; do
  wait "$launcher" && status=0 || status=$?
  # A trapped signal cuts `wait` short; keep waiting while torchrun shuts the workers down.
  kill -0 "$launcher" 2>/dev/null || break
done

rank0=""
[[ -s "$X1_EXIT_DIR/rank0" ]] && rank0="$(<"$X1_EXIT_DIR/rank0")"
if [[ -n "$rank0" && "$rank0" -lt 128 ]]; then
  status="$rank0"
else
  # Rank 0 was killed (torchrun tears the group down when a peer fails): report the first
  # other rank that exited on its own with an error, else rank 0's signal death.
  own=""
  for ((r = 1; r < nproc; r++)); do
    f="$X1_EXIT_DIR/rank$r"
    [[ -s "$f" ]] || continue
    code="$(<"$f")"
    if [[ "$code" -ne 0 && "$code" -lt 128 ]]; then own="$code"; break; fi
  done
  if [[ -n "$own" ]]; then status="$own"; elif [[ -n "$rank0" ]]; then status="$rank0"; fi
fi
rm -rf "$X1_EXIT_DIR"
exit "$status"
