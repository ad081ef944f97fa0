#!/bin/bash
# As RunPod's images do: the pod's PUBLIC_KEY authorized for root, sshd in the foreground.
# Host keys are made at the first start and kept by the container across stops and starts.
set -eu
mkdir -p /root/.ssh /run/sshd
chmod 700 /root/.ssh
if [ -n "${PUBLIC_KEY:-}" ]; then
  printf '%s\n' "$PUBLIC_KEY" > /root/.ssh/authorized_keys
  chmod 600 /root/.ssh/authorized_keys
fi
ssh-keygen -A >/dev/null
exec /usr/sbin/sshd -D -e
