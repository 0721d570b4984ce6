#!/usr/bin/env bash
# Stop what scripts/slurm/start.sh started: the jobs still queued or running are cancelled first (no slurmstepd is
# left behind its slurmd), then the slurmd nodes and slurmctld (by their pid files), munged if start.sh started it,
# and the node names start.sh added to /etc/hosts (--restart: munged and the names stay). The packages stay.
set -uo pipefail

BASE=${TENPLEX_SLURM_BASE:-/tmp/tenplex-slurm}
HOSTS_MARK="# tenplex-megatron test slurm nodes"
RESTART=0
[ "${1:-}" = --restart ] && RESTART=1
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if alive "$BASE/run/slurmctld.pid"; then
  jobs=$(squeue -h -o %i 2>/dev/null || true)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    scancel --full $jobs 2>/dev/null || true
    for _ in $(seq 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi
pids=()
for f in "$BASE"/run/slurmd-*.pid "$BASE"/run/slurmctld.pid; do
  if alive "$f"; then pids+=("$(cat "$f")"); kill -TERM "$(cat "$f")"; fi
done
if [ $RESTART = 0 ] && alive "$BASE/run/munged.ours" \
   && [ "$(cat /run/munge/munged.pid 2>/dev/null)" = "$(cat "$BASE/run/munged.ours")" ]; then
  pids+=("$(cat "$BASE/run/munged.ours")"); kill -TERM "$(cat "$BASE/run/munged.ours")"
fi
for _ in $(seq 100); do
  left=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
  [ $left = 0 ] && break
  sleep 0.1
done
for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && kill -KILL "$p"; done
rm -f "$BASE"/run/slurmd-*.pid "$BASE/run/slurmctld.pid"
[ $RESTART = 1 ] || rm -f "$BASE/run/munged.ours"
# rewritten in place: /etc/hosts may be a mount
if [ $RESTART = 0 ] && grep -qF "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
  kept=$(grep -vF "$HOSTS_MARK" /etc/hosts); printf '%s\n' "$kept" >/etc/hosts
fi
echo "slurm/stop.sh: stopped"
