#!/usr/bin/env bash
# x1-train: `python -m x1_pretrain.train ARGS`, or the same under torchrun when NPROC > 1.
#
#   NPROC=1 (default)   exec python -m x1_pretrain.train ARGS
#   NPROC=N             torchrun --standalone --nproc_per_node=N ... x1_pretrain.train ARGS
#   NNODES=M            one node of M hosts: torchrun --nnodes=M --nproc_per_node=NPROC with the c10d
#                       rendezvous at RDZV_ENDPOINT (HOST:PORT, any of the nodes) under RDZV_ID (the same
#                       on every node); ranks come from the rendezvous. RDZV_MAX_RESTARTS (3): group
#                       restarts after a lost node or a crashed rank; RDZV_JOIN_TIMEOUT (600 s): how long
#                       a node waits for the others to (re)join before it exits 1
#   X1_TRAIN_EXTRA_ARGS appended to ARGS, split on spaces ("--inject-spike-at-step 12000")
#   X1_PYTHON           the interpreter (default: python on PATH; the process runner gives its own)
#   X1_LADDER=1         the scaling ladder first (.env's LADDER): `python -m x1_pretrain.ladder step --dir
#                       X1_LADDER_DIR -- ARGS` trains its rungs (the share X1_LADDER_SHARE of the main run's
#                       hours) and fits DIR/ladder.json; the trainer then runs with --ladder DIR/ladder.json.
#                       The step speaks the trainer's exit codes, so the watchdog supervises it the same way
#                       (a preempted ladder resumes; 78 when it would take the run over its cap)
#   a final decision in the watchdog's state file: no training, exit with its code
#
# The trainer's exit code is what the watchdog acts on (75 relaunch, 76/77 budget stop, 0 done,
# ...). torchrun reports any failed worker as exit 1, so under torchrun each worker runs through
# this script's --worker mode, which records its exit code in a file per local rank; the launcher
# then exits with local rank 0's code — or, when torchrun's teardown killed it after another rank
# failed on its own (a config error on every rank: whichever is first), with that rank's code.
# A decision every rank agreed on (0 finished, 75-79 stops) reaches torchrun as 0: torchrun
# restarts a group whose worker failed (--max-restarts), and a budget stop must not be restarted.
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
    echo "$code" > "$X1_EXIT_DIR/rank${LOCAL_RANK:-0}"
    case "$code" in 0 | 75 | 76 | 77 | 78 | 79) exit 0 ;; esac
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

if [[ "${X1_LADDER:-0}" == 1 ]]; then
  ladder_dir="${X1_LADDER_DIR:-/workspace/ladder}"
  # Done once: a folder that holds ladder.json returns at once. Its exit code is the watchdog's to act on.
  "${X1_PYTHON:-python}" -m x1_pretrain.ladder step --dir "$ladder_dir" --share "${X1_LADDER_SHARE:-0.05}" \
    -- "$@" "${extra[@]}" || exit $?
  if [[ -f "$ladder_dir/ladder.json" ]]; then
    extra+=(--ladder "$ladder_dir/ladder.json")
  else
    echo "x1-train: the ladder in $ladder_dir has no ladder.json (too few rungs for a fit: its log says why); the run keeps the band it is given" >&2
  fi
fi

nnodes="${NNODES:-1}"
if ! [[ "$nnodes" =~ ^[1-9][0-9]*$ ]]; then
  echo "x1-train: NNODES must be a whole number >= 1 (hosts), got '$nnodes'" >&2
  exit 2
fi
launch=(--standalone --nproc_per_node="$nproc")
if [[ "$nnodes" != 1 ]]; then
  for var in RDZV_ENDPOINT RDZV_ID; do
    if [[ -z "${!var:-}" ]]; then
      echo "x1-train: NNODES=$nnodes needs $var (RDZV_ENDPOINT=HOST:PORT of any node, RDZV_ID the same on every node)" >&2
      exit 2
    fi
  done
  # Every node waits for the others for at most join_timeout (then exits 1, not a hang); a node
  # lost mid-run makes torchrun restart the whole group from the last checkpoint, up to
  # RDZV_MAX_RESTARTS times. The c10d store lives in the agent of the node whose address is
  # RDZV_ENDPOINT; which node gets which rank is the rendezvous's choice.
  launch=(--nnodes="$nnodes" --nproc_per_node="$nproc" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
          --rdzv-id="$RDZV_ID" --max-restarts="${RDZV_MAX_RESTARTS:-3}"
          --rdzv-conf="join_timeout=${RDZV_JOIN_TIMEOUT:-600}")
  # Each round of the rendezvous publishes rank 0's store address anew. torch's shared store
  # (the default) keeps the first round's on the other nodes: after rank 0's host was replaced,
  # they would knock at a port that no longer exists until the process group's timeout.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi

if [[ "$nproc" == 1 && "$nnodes" == 1 ]]; then
  # One process: python replaces this shell and receives docker's SIGTERM directly.
  exec "${X1_PYTHON:-python}" -m x1_pretrain.train "$@" "${extra[@]}"
fi

X1_EXIT_DIR="$(mktemp -d -t x1-exit.XXXXXX)"
export X1_EXIT_DIR
torchrun "${launch[@]}" --no-python "$0" --worker "$@" "${extra[@]}" &
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
if [[ "$nnodes" != 1 && "$status" -ge 128 ]]; then
  # Several hosts: a worker ended by a signal is torchrun's teardown after the group broke (a host
  # lost): a crash (exit 1) for the watchdog, whichever of the worker or torchrun failed first.
  status=1
fi
rm -rf "$X1_EXIT_DIR"
exit "$status"
