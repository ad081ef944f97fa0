"""X1 watchdog: relaunches the trainer after a preemption, a crash or a stall; never after a
budget stop, a divergence, a bad config or a finished run; can terminate the instance at the end.

    python -m x1_watchdog --help

Pieces: `supervisor` (the decision loop shared by the modes), `handles` (process mode's child,
the trainer handle interface), `docker` (docker mode's handle over the Engine API, exercised on
the GPU host), `provider` (provider mode: bring a preempted instance back), `policy` (stall and
relaunch rules), `records` (events and state files), `finish` (--terminate-on-finish),
`metrics` (Prometheus).
"""
