#!/usr/bin/env bash
# A real Slurm on this machine for the tests and docs/slurm.md: munged, slurmctld and two slurmd "nodes" (n1, n2),
# every daemon on localhost, no systemd and no cgroups. Idempotent: what already runs with this configuration is
# left alone. Installs Debian's slurmctld, slurmd, slurm-client and munge first when they are missing (as root).
#
# Knobs (environment): TENPLEX_SLURM_BASE (state, logs, pid files; /tmp/tenplex-slurm), TENPLEX_SLURM_NODES (2),
# TENPLEX_SLURM_CPUS (CPUs each node advertises; 2), TENPLEX_SLURM_WAIT (seconds to wait for idle nodes; 120).
# The configuration is /etc/slurm/slurm.conf, where sbatch and srun look without SLURM_CONF.
#
# Short timers for tests: a requeued job may start again cred_expire + 1 s after it ended (Slurm's default: 121 s),
# and the backfill scheduler looks every second (default 30 s): a requeue is running again in about 11 s.
set -euo pipefail

BASE=${TENPLEX_SLURM_BASE:-/tmp/tenplex-slurm}
NODES=${TENPLEX_SLURM_NODES:-2}
CPUS=${TENPLEX_SLURM_CPUS:-2}
WAIT=${TENPLEX_SLURM_WAIT:-120}
CONF=/etc/slurm/slurm.conf
HOSTS_MARK="# tenplex-megatron test slurm nodes"
say() { echo "slurm/start.sh: $*"; }
fail() { echo "slurm/start.sh: error: $*" >&2; exit 1; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  local need=() cmd
  for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || need+=("$cmd"); done
  [ ${#need[@]} = 0 ] && return 0
  [ "$(id -u)" = 0 ] || fail "missing ${need[*]}: as root, apt-get install slurmctld slurmd slurm-client munge"
  say "installing slurmctld slurmd slurm-client munge (missing: ${need[*]})"
  local rcd=/usr/sbin/policy-rc.d made=0   # no service started by the packages' scripts: this file starts them
  if [ ! -e $rcd ]; then printf '#!/bin/sh\nexit 101\n' >$rcd; chmod +x $rcd; made=1; fi
  local pkgs=(slurmctld slurmd slurm-client munge) ok=0
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 && ok=1
  if [ $ok = 0 ]; then  # stale package lists: update once and try again
    apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null && ok=1
  fi
  [ $made = 1 ] && rm -f $rcd
  [ $ok = 1 ] || fail "apt-get install ${pkgs[*]} failed"
}

start_munge() {
  mkdir -p /run/munge && chown munge:munge /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  fi
  munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 100); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n </dev/null | unmunge >/dev/null || fail "munged does not answer"
  cp /run/munge/munged.pid "$BASE/run/munged.ours"  # stop.sh stops only a munged this script started
}

write_conf() {
  local nodes="" i
  for i in $(seq 1 "$NODES"); do
    nodes+="NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$CPUS State=UNKNOWN"$'\n'
  done
  cat <<CONF
# written by tenplex-megatron's scripts/slurm/start.sh: a test cluster on localhost
ClusterName=tenplex
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$BASE/ctld
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
SlurmctldTimeout=60
SlurmdTimeout=60
MessageTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
JobRequeue=1
${nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

resolvable_nodes() {  # node names resolve, as on a real cluster (batch scripts take the head node from them)
  local names="" i
  for i in $(seq 1 "$NODES"); do getent hosts "n$i" >/dev/null || names+=" n$i"; done
  [ -z "$names" ] && return 0
  printf '127.0.0.1%s %s\n' "$names" "$HOSTS_MARK" >>/etc/hosts
}

wait_idle() {  # every node idle, each slurmd started now registered since it started
  local deadline=$(( $(date +%s) + WAIT )) idle n st fresh
  while :; do
    idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2=="idle"' | sort -u | wc -l)
    fresh=1
    for n in "${STARTED[@]}"; do
      st=$(scontrol show node -o "${n%%:*}" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)
      { [ -n "$st" ] && [ "$(date -d "$st" +%s 2>/dev/null || echo 0)" -ge "${n##*:}" ]; } || fresh=0
    done
    [ "$idle" -ge "$NODES" ] && [ $fresh = 1 ] && return 0
    if [ "$(date +%s)" -ge "$deadline" ]; then
      sinfo -N >&2 || true; tail -n 20 "$BASE"/log/*.log >&2 || true
      fail "the $NODES nodes are not idle after $WAIT s (logs in $BASE/log)"
    fi
    sleep 0.5
  done
}

install_packages
mkdir -p /etc/slurm "$BASE"/{log,run,ctld,spool}
start_munge
resolvable_nodes
conf=$(write_conf)
if [ ! -f $CONF ] || [ "$(cat $CONF)" != "$conf" ]; then
  if alive "$BASE/run/slurmctld.pid"; then
    say "configuration changed: restarting the daemons"
    "$(dirname "$0")/stop.sh" --restart
  fi
  rm -rf "$BASE/ctld" "$BASE/spool" && mkdir -p "$BASE/ctld" "$BASE/spool"
  printf '%s\n' "$conf" >$CONF
fi
# a fresh controller starts clean (-c): jobs of a run that ended without stop.sh (a killed test session) would
# otherwise be recovered from its state and keep the nodes allocated
alive "$BASE/run/slurmctld.pid" || { say "starting slurmctld"; slurmctld -c -f $CONF; }
STARTED=()
for i in $(seq 1 "$NODES"); do
  if ! alive "$BASE/run/slurmd-n$i.pid"; then
    mkdir -p "$BASE/spool/n$i"
    STARTED+=("n$i:$(date +%s)")
    slurmd -f $CONF -N "n$i"   # -N always: without it slurmd takes the first local node's name and pid file
  fi
done
[ ${#STARTED[@]} = 0 ] || say "started slurmd ${STARTED[*]%%:*}"
wait_idle
say "ready: $(sinfo -h -o '%D nodes %t (%N)' | tr '\n' ' ')"
