#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the `slurm` tests and for trying
# ddplab's SLURM paths on a laptop (Debian/Ubuntu, as root):
#
#   scripts/slurm_local.sh up      # install slurm-wlm + munge if missing, start munged, slurmctld, slurmd
#   scripts/slurm_local.sh status  # sinfo
#   scripts/slurm_local.sh down    # stop them all; nothing of the cluster keeps running
#
# One node (this host) with all its CPUs in one partition, `debug`. No cgroups (containers rarely
# allow them): processes are tracked by their parent (proctrack/linuxproc), memory is not enforced.
# Idempotent: `up` on a running cluster only checks it; `down` on a stopped one does nothing.
# Its files live in /etc/slurm/slurm.conf and $STATE (state, logs); `down` leaves them for a post-mortem.
set -euo pipefail

STATE=${DDPLAB_SLURM_STATE:-/var/tmp/ddplab-slurm}
CONF=/etc/slurm/slurm.conf

need_root() {
  if [ "$(id -u)" != 0 ]; then echo "slurm_local.sh: run as root (it starts system daemons)" >&2; exit 2; fi
}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  echo "installing slurmctld, slurmd, slurm-client and munge (apt; Debian's slurm-wlm without its plugins)..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm
  cat > "$CONF" <<EOF
# Written by ddplab's scripts/slurm_local.sh: a one-node test cluster.
ClusterName=ddplab-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
# Tests wait on these: a killed job's processes get 10 s between SIGTERM and SIGKILL, and the
# controller looks at time limits and signals often.
KillWait=10
MinJobAge=600
SchedulerParameters=sched_interval=2
# A requeued job may start again at once (the default holds it back).
JobRequeue=1
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start_munge() {
  if pgrep -x munged >/dev/null; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
}

wait_for_node() {
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; then return 0; fi
    sleep 0.5
  done
  echo "slurm_local.sh: the node did not come up; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
  sinfo >&2 || true
  return 1
}

up() {
  need_root
  install
  if sinfo -h -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; then
    echo "cluster already up"; sinfo; return
  fi
  write_conf
  start_munge
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  wait_for_node
  # A node that was down (an earlier run's leftover state) is brought back.
  scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true
  sinfo
}

DAEMONS="slurmstepd slurmd slurmctld munged"

running() {  # the cluster's processes still alive (pgrep -x takes one name at a time)
  local d
  for d in $DAEMONS; do pgrep -x "$d" >/dev/null && echo "$d"; done
  return 0
}

down() {
  need_root
  if pgrep -x slurmctld >/dev/null; then
    scancel --quiet "--user=$(id -un)" 2>/dev/null || true
  fi
  for d in $DAEMONS; do pkill -x "$d" 2>/dev/null || true; done
  for _ in $(seq 60); do
    if [ -z "$(running)" ]; then echo "cluster down"; return 0; fi
    sleep 0.25
  done
  for d in $(running); do pkill -9 -x "$d" 2>/dev/null || true; done
  sleep 0.5
  if [ -n "$(running)" ]; then echo "slurm_local.sh: still running: $(running)" >&2; return 1; fi
  echo "cluster down (killed)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) sinfo ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
