#!/usr/bin/env bash
# Two "hosts" on this one machine, built from Linux network namespaces, and a two-node SLURM
# cluster on them: for testing ddplab's multi-node paths (rendezvous across hosts, SLURM_NODEID,
# per-node ranks) without a second machine. Debian/Ubuntu, as root:
#
#   scripts/netns_cluster.sh up          # network + SLURM cluster (installs slurm/munge if missing)
#   scripts/netns_cluster.sh up net      # network only: namespaces, bridge, hostnames
#   scripts/netns_cluster.sh exec a CMD  # run CMD "on" node-a (b: node-b); exit code and signals pass through
#   scripts/netns_cluster.sh status      # namespaces, addresses, sinfo of this cluster; exit 3 if not up
#   scripts/netns_cluster.sh env         # `eval "$(scripts/netns_cluster.sh env)"` points slurm commands here
#   scripts/netns_cluster.sh down        # cancel jobs, stop daemons, remove namespaces/links/files
#
# The layout:
#
#   root namespace:  bridge ddpbr0 10.77.0.254/24, slurmctld (hostname ddplab-ctl, port 6837)
#   ddplab-a:        eth0 10.77.0.1/24, hostname node-a, slurmd -N node-a (port 6838)
#   ddplab-b:        eth0 10.77.0.2/24, hostname node-b, slurmd -N node-b (port 6838)
#
# A "host" is a network namespace plus a UTS namespace (for its hostname); both are kept alive by
# bind mounts (/run/netns/ddplab-X by `ip netns`, /run/ddplab-netns/X by us), so every process
# started on node-a shares one hostname and one network stack. The mount namespace is not shared
# per host: `ip netns exec` gives each command a fresh one with /etc/netns/ddplab-X/hosts over
# /etc/hosts, so node-a/node-b/ddplab-ctl resolve inside the hosts (not in the root namespace).
#
# It coexists with scripts/slurm_local.sh's one-node cluster: own config
# (/etc/ddplab-netns-slurm/slurm.conf, used only through SLURM_CONF), own ports, own state dir
# ($STATE), and daemons started under other process names (ddpl-slurmctld, ddpl-slurmd) so that
# slurm_local.sh's `pgrep -x slurmd`/`pkill -x slurmd` neither mistake them for its own nor kill
# them. munged is shared; `down` stops it only if `up` started it and no other slurm daemon is left.
#
# Idempotent: `up` on a running cluster only checks it (and restarts a daemon that died);
# `down` on nothing does nothing. A failed `up` leaves what it made for a look; `down` removes it.
# `down` keeps $STATE (logs) for a post-mortem; `up` starts slurmctld with a clean job state.
set -euo pipefail

PROG=netns_cluster.sh
SELF=$(readlink -f "$0")
STATE=${DDPLAB_NETNS_STATE:-/var/tmp/ddplab-netns}
CONF_DIR=/etc/ddplab-netns-slurm
CONF=$CONF_DIR/slurm.conf
UTS_DIR=/run/ddplab-netns
BIN=$STATE/bin
BR=ddpbr0
BR_ADDR=10.77.0.254
CTL_HOST=ddplab-ctl
CTLD_PORT=6837
SLURMD_PORT=6838
NODES="a b"
FW_TAG=ddplab-netns            # comment on our iptables rules, so `down` removes exactly those

die() { echo "$PROG: $*" >&2; exit 1; }
note() { echo "$PROG: $*" >&2; }

ns_of() { echo "ddplab-$1"; }
host_of() { echo "node-$1"; }
veth_of() { echo "ddpveth-$1"; }
addr_of() { case $1 in a) echo 10.77.0.1 ;; b) echo 10.77.0.2 ;; esac; }

node_arg() {  # accepts a, b, node-a, node-b
  case ${1:-} in
    a | node-a) echo a ;;
    b | node-b) echo b ;;
    *) die "unknown host '${1:-}': use a or b (node-a, node-b)" ;;
  esac
}

need_root() {
  [ "$(id -u)" = 0 ] || die "run as root (it creates namespaces, links and system daemons): sudo $0 ${*:-up}"
}

ensure_tools() {  # $1=slurm: the SLURM/munge daemons are needed too
  local missing="" pkgs="" t
  for t in ip:iproute2 unshare:util-linux nsenter:util-linux mountpoint:util-linux flock:util-linux \
           runuser:util-linux timeout:coreutils pgrep:procps; do
    command -v "${t%%:*}" >/dev/null || { missing="$missing ${t%%:*}"; pkgs="$pkgs ${t#*:}"; }
  done
  if [ "${1:-}" = slurm ]; then
    for t in slurmctld:slurmctld slurmd:slurmd sinfo:slurm-client munged:munge; do
      command -v "${t%%:*}" >/dev/null || [ -x "/usr/sbin/${t%%:*}" ] || {
        missing="$missing ${t%%:*}"; pkgs="$pkgs ${t#*:}"; }
    done
  fi
  [ -z "$missing" ] && return
  pkgs=$(echo "$pkgs" | tr ' ' '\n' | sort -u | tr '\n' ' ')
  note "missing:$missing; installing $pkgs(apt)..."
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends $pkgs >/dev/null; } \
    || die "could not install$missing; install them by hand: apt-get install $pkgs"
  for t in $missing; do
    command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || die "$t still missing after apt-get install $pkgs"
  done
}

lock() {
  # Parallel test workers may all call `up`; one at a time. The fd must not leak into daemons
  # (they would hold the lock forever): every daemon start below closes it with 9>&-.
  mkdir -p "$STATE"
  exec 9>"$STATE/.lock"
  flock -w 120 9 || die "another $PROG up/down holds $STATE/.lock for over 120 s; is one stuck?"
}

pid_alive() {  # pid_alive PIDFILE COMM: print the PID if that process is alive and still is COMM
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  echo "$pid"
}

# ---------------------------------------------------------------------------------------------
# network

check_namespaces_allowed() {
  local err
  if ! err=$(unshare --net --uts true 2>&1); then
    die "network/UTS namespaces are not permitted here (unshare: ${err##*: }); run on a VM or in a container started with --privileged (CAP_SYS_ADMIN)"
  fi
}

check_subnet_free() {
  # A 10.77.0.0/24 on some other interface would make routing to our hosts ambiguous.
  local other
  other=$(ip -4 -o addr show to 10.77.0.0/24 | awk -v br="$BR" '$2 != br {print $2}' | sort -u | tr '\n' ' ')
  [ -z "$other" ] || die "10.77.0.0/24 is already used on: $other; remove it (or that interface) first"
}

make_bridge() {
  local err
  if ! ip link show "$BR" >/dev/null 2>&1; then
    err=$(ip link add "$BR" type bridge 2>&1) \
      || die "cannot create bridge $BR ($err); load the kernel's bridge module on the host: modprobe bridge"
  fi
  ip addr replace "$BR_ADDR/24" dev "$BR"
  ip link set "$BR" up
}

make_host() {  # make_host a|b
  local n=$1 ns veth addr err tmp
  ns=$(ns_of "$n"); veth=$(veth_of "$n"); addr=$(addr_of "$n"); tmp=ddptmp-$n
  if [ ! -e "/run/netns/$ns" ]; then
    err=$(ip netns add "$ns" 2>&1) \
      || die "cannot create network namespace $ns ($err); namespaces need CAP_SYS_ADMIN (a --privileged container or a VM)"
  fi
  if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
    # Half-made pair from an interrupted `up`: start that host's link over.
    ip link del "$veth" 2>/dev/null || true
    ip link del "$tmp" 2>/dev/null || true
    # The peer gets a temporary name: "eth0" would clash with the root namespace's own eth0.
    err=$(ip link add "$veth" type veth peer name "$tmp" 2>&1) \
      || die "cannot create veth pair $veth ($err); the kernel needs veth support: modprobe veth"
    ip link set "$tmp" netns "$ns"
    ip -n "$ns" link set "$tmp" name eth0
  fi
  ip link set "$veth" master "$BR" up
  ip -n "$ns" addr replace "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up

  mkdir -p "/etc/netns/$ns"
  write_if_changed "/etc/netns/$ns/hosts" <<EOF
# Written by ddplab's scripts/netns_cluster.sh; \`ip netns exec $ns\` mounts it over /etc/hosts.
127.0.0.1	localhost
::1		localhost ip6-localhost ip6-loopback
$BR_ADDR	$CTL_HOST
10.77.0.1	node-a
10.77.0.2	node-b
EOF
  make_uts "$n" "$(host_of "$n")"
}

make_uts() {  # make_uts NAME HOSTNAME: a UTS namespace that outlives its processes
  local f=$UTS_DIR/$1
  mkdir -p "$UTS_DIR"
  if ! mountpoint -q "$f" 2>/dev/null; then
    touch "$f"
    unshare --uts="$f" true || die "cannot create a UTS namespace at $f; namespaces need CAP_SYS_ADMIN"
  fi
  [ "$(nsenter --uts="$f" hostname)" = "$2" ] || nsenter --uts="$f" hostname "$2"
}

stash_cgroup() {  # a view of the root namespace's cgroup mounts for on_host (see there)
  local d=$UTS_DIR/cgroup
  mountpoint -q /sys/fs/cgroup || return 0
  mountpoint -q "$d" 2>/dev/null && return 0
  mkdir -p "$d"
  mount --rbind /sys/fs/cgroup "$d" || die "cannot bind /sys/fs/cgroup to $d (slurmd needs it on the hosts)"
  # A slave copy: unmounting it at `down` can never take the real /sys/fs/cgroup with it.
  mount --make-rslave "$d"
}

write_if_changed() {  # so a second `up` rewrites nothing
  local tmp
  tmp=$(mktemp)
  cat >"$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; chmod 644 "$1"; fi
}

open_firewall() {
  # With br_netfilter loaded and bridge-nf-call-iptables=1, frames between node-a and node-b
  # cross the bridge through iptables' FORWARD chain, where a DROP policy (Docker sets one)
  # silently eats them. We open exactly our bridge instead of flipping the global sysctl, which
  # other bridges (Docker's) depend on. INPUT: slurmd -> slurmctld on 10.77.0.254 is ordinary
  # routed traffic that a host firewall may drop as well.
  local brnf=/proc/sys/net/bridge/bridge-nf-call-iptables
  command -v iptables >/dev/null || return 0   # no iptables: nothing of ours to open (probe checks)
  if [ -r "$brnf" ] && [ "$(cat "$brnf")" = 1 ]; then
    iptables -w -C FORWARD -i "$BR" -o "$BR" -m comment --comment "$FW_TAG" -j ACCEPT 2>/dev/null \
      || iptables -w -I FORWARD 1 -i "$BR" -o "$BR" -m comment --comment "$FW_TAG" -j ACCEPT 2>/dev/null \
      || note "warning: could not add an iptables FORWARD rule for $BR"
  fi
  iptables -w -C INPUT -i "$BR" -m comment --comment "$FW_TAG" -j ACCEPT 2>/dev/null \
    || iptables -w -I INPUT 1 -i "$BR" -m comment --comment "$FW_TAG" -j ACCEPT 2>/dev/null \
    || note "warning: could not add an iptables INPUT rule for $BR"
}

close_firewall() {
  command -v iptables >/dev/null || return 0
  while iptables -w -D FORWARD -i "$BR" -o "$BR" -m comment --comment "$FW_TAG" -j ACCEPT 2>/dev/null; do :; done
  while iptables -w -D INPUT -i "$BR" -m comment --comment "$FW_TAG" -j ACCEPT 2>/dev/null; do :; done
}

reach() {  # reach FROM(a|b|root) ADDR: a SYN to closed port 9 must come back as "refused"
  # Needs no ping/nc: "Connection refused" proves the packet got there and the answer came back;
  # a firewall that drops shows as a timeout instead.
  local out rc=0 pre=()
  [ "$1" = root ] || pre=(ip netns exec "$(ns_of "$1")")
  out=$("${pre[@]}" timeout 3 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1) || rc=$?
  [ "$rc" = 0 ] && return 0
  case $out in *"Connection refused"*) return 0 ;; esac
  return 1
}

probe_network() {
  local from to hint=""
  if [ "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0)" = 1 ]; then
    hint="; br_netfilter passes bridged frames through the host firewall: allow $BR there, or sysctl -w net.bridge.bridge-nf-call-iptables=0"
  fi
  for from in a b; do
    for to in 10.77.0.1 10.77.0.2 "$BR_ADDR"; do
      [ "$to" = "$(addr_of "$from")" ] && continue
      reach "$from" "$to" || die "node-$from cannot reach $to over $BR (TCP probe timed out)$hint"
    done
  done
  reach root 10.77.0.1 || die "the root namespace cannot reach node-a (10.77.0.1) over $BR$hint"
}

net_up() {
  check_namespaces_allowed
  check_subnet_free
  make_bridge
  local n
  for n in $NODES; do make_host "$n"; done
  make_uts ctl "$CTL_HOST"
  stash_cgroup
  open_firewall
  probe_network
}

net_is_up() {
  local n
  ip link show "$BR" >/dev/null 2>&1 || return 1
  for n in $NODES; do
    [ -e "/run/netns/$(ns_of "$n")" ] && mountpoint -q "$UTS_DIR/$n" 2>/dev/null || return 1
  done
}

# ---------------------------------------------------------------------------------------------
# running commands on a host

on_host() {  # on_host a|b CMD...: replaces this process (no wrapper left to eat signals or codes)
  local n=$1; shift
  [ -e "/run/netns/$(ns_of "$n")" ] && mountpoint -q "$UTS_DIR/$n" 2>/dev/null \
    || die "host node-$n is not up; run: $SELF up"
  # `ip netns exec` mounts a fresh sysfs (so /sys/class/net shows the host's own eth0), which hides
  # the cgroup mounts under /sys/fs/cgroup; slurmd refuses to start without them, and a real host
  # has them, so they come back from the copy `up` keeps. sh execs the command: no shell stays.
  exec ip netns exec "$(ns_of "$n")" nsenter --uts="$UTS_DIR/$n" -- sh -c \
    'if mountpoint -q "$0"; then mount --rbind "$0" /sys/fs/cgroup || echo "netns_cluster.sh: no /sys/fs/cgroup here" >&2; fi; exec "$@"' \
    "$UTS_DIR/cgroup" "$@"
}

# ---------------------------------------------------------------------------------------------
# SLURM

write_conf() {
  local cpus mem
  cpus=${DDPLAB_NETNS_CPUS:-$(nproc)}
  # Both nodes share this machine's memory: each gets half, less a margin for the daemons.
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 - 512 ))
  mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/spool/node-a" "$STATE/spool/node-b" "$BIN"
  # Other process names than slurm_local.sh's daemons (see the header); a symlink is enough,
  # the kernel names a process after the path it was exec'd by.
  ln -sfn /usr/sbin/slurmctld "$BIN/ddpl-slurmctld"
  ln -sfn /usr/sbin/slurmd "$BIN/ddpl-slurmd"
  write_if_changed "$CONF" <<EOF
# Written by ddplab's scripts/netns_cluster.sh: a two-node test cluster on network namespaces.
# Used only through SLURM_CONF=$CONF; /etc/slurm/slurm.conf is the one-node cluster's.
ClusterName=ddplab-netns
# slurmctld runs in a UTS namespace named $CTL_HOST (it refuses to start on a host whose name
# is not SlurmctldHost); the address is given so nobody has to resolve the name.
SlurmctldHost=$CTL_HOST($BR_ADDR)
# Not the defaults (6817/6818): the one-node cluster's daemons hold those in the root namespace.
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
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
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
# Two slurmds share this machine's filesystem: each its own spool, pid and log file.
SlurmdSpoolDir=$STATE/spool/%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/slurmd-%n.log
# Tests wait on these: 5 s from SIGTERM to SIGKILL, finished jobs stay queryable for 10 min.
KillWait=5
MinJobAge=600
SchedulerParameters=sched_interval=2
# No mail on this machine; the default (/bin/mail) only adds an error to the log.
MailProg=/bin/true
JobRequeue=1
NodeName=node-a NodeAddr=10.77.0.1 NodeHostname=node-a CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=node-b NodeAddr=10.77.0.2 NodeHostname=node-b CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=netns Nodes=node-a,node-b Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
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
  runuser -u munge -- /usr/sbin/munged </dev/null >"$STATE/munged.out" 2>&1 9>&- \
    || die "munged did not start: $(tail -n1 "$STATE/munged.out"); see /var/log/munge/munged.log"
  # Only a munged we started is ours to stop at `down`.
  cat /run/munge/munged.pid >"$STATE/munged.ours" 2>/dev/null || pgrep -x -n munged >"$STATE/munged.ours"
}

start_slurm() {
  export SLURM_CONF=$CONF
  if ! pid_alive "$STATE/slurmctld.pid" ddpl-slurmctld >/dev/null; then
    # -c: a cluster restarted after `down` has no jobs worth recovering, and stale node states
    # (DOWN after a killed slurmd) would otherwise need a resume.
    nsenter --uts="$UTS_DIR/ctl" -- "$BIN/ddpl-slurmctld" -c -f "$CONF" </dev/null \
      >"$STATE/slurmctld.out" 2>&1 9>&- \
      || die "slurmctld did not start: $(tail -n1 "$STATE/slurmctld.out"); see $STATE/slurmctld.log"
  fi
  local n
  for n in $NODES; do
    if ! pid_alive "$STATE/slurmd-node-$n.pid" ddpl-slurmd >/dev/null; then
      "$SELF" exec "$n" "$BIN/ddpl-slurmd" -f "$CONF" -N "node-$n" -d /usr/sbin/slurmstepd \
        </dev/null >"$STATE/slurmd-node-$n.out" 2>&1 9>&- \
        || die "slurmd on node-$n did not start: $(tail -n1 "$STATE/slurmd-node-$n.out"); see $STATE/slurmd-node-$n.log"
    fi
  done
}

nodes_ready() {  # both nodes idle/mixed/allocated and responding
  [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -Ec '^node-[ab] (idle|mixed|allocated)$')" = 2 ]
}

wait_for_nodes() {
  local i resumed=""
  for i in $(seq 80); do
    nodes_ready && return 0
    # A node drained/down by an earlier life is brought back once it has registered.
    if [ -z "$resumed" ] && sinfo -h -N -o '%N %T' 2>/dev/null | grep -Eq '^node-[ab] (down|drain|drained|draining)$'; then
      scontrol update nodename=node-a,node-b state=resume 2>/dev/null || true
      resumed=1
    fi
    sleep 0.5
  done
  die "nodes not idle after 40 s ($(sinfo -h -N -o '%N=%T' 2>&1 | tr '\n' ' ')); see $STATE/slurmctld.log, $STATE/slurmd-node-a.log, $STATE/slurmd-node-b.log"
}

slurm_is_up() {
  # munged too: slurm_local.sh's `down` kills it by name, and without it nothing here authenticates.
  pgrep -x munged >/dev/null \
    && pid_alive "$STATE/slurmctld.pid" ddpl-slurmctld >/dev/null \
    && pid_alive "$STATE/slurmd-node-a.pid" ddpl-slurmd >/dev/null \
    && pid_alive "$STATE/slurmd-node-b.pid" ddpl-slurmd >/dev/null \
    && SLURM_CONF=$CONF nodes_ready
}

# ---------------------------------------------------------------------------------------------
# commands

up() {
  local what=${1:-all}
  case $what in all | net) ;; *) die "usage: $0 up [net]" ;; esac
  need_root up
  if [ "$what" = net ]; then ensure_tools; else ensure_tools slurm; fi
  lock
  if net_is_up && { [ "$what" = net ] || slurm_is_up; }; then
    echo "netns cluster already up"
    status || [ "$what" = net ]
    return
  fi
  net_up
  if [ "$what" != net ]; then
    write_conf
    start_munge
    start_slurm
    wait_for_nodes
  fi
  status || [ "$what" = net ]   # after `up net`, status reports slurm as not running
}

our_pids() {  # every process on one of our hosts: in its network or its UTS namespace
  {
    local n ino p link want=""
    for n in $NODES; do
      [ -e "/run/netns/$(ns_of "$n")" ] && ip netns pids "$(ns_of "$n")" 2>/dev/null
    done
    for n in $NODES ctl; do
      mountpoint -q "$UTS_DIR/$n" 2>/dev/null || continue
      ino=$(stat -L -c %i "$UTS_DIR/$n")
      want="$want uts:[$ino]"
    done
    if [ -n "$want" ]; then
      for p in /proc/[0-9]*; do
        # Some links are unreadable (PID 1 here): an empty one must not match anything.
        link=$(readlink "$p/ns/uts" 2>/dev/null) && [ -n "$link" ] || continue
        case "$want " in *" $link "*) echo "${p#/proc/}" ;; esac
      done
    fi
  } | sort -un | grep -vx -e 1 -e "$$" || true   # never init, never ourselves
}

kill_and_wait() {  # kill_and_wait PID...: TERM, up to 5 s, then KILL
  local i p alive
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for i in $(seq 20); do
    alive=""
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
    [ -z "$alive" ] && return 0
    sleep 0.25
  done
  # shellcheck disable=SC2086
  kill -KILL $alive 2>/dev/null || true
  sleep 0.2
}

down() {
  need_root down
  lock
  export SLURM_CONF=$CONF
  local pid pids n i
  if pid_alive "$STATE/slurmctld.pid" ddpl-slurmctld >/dev/null; then
    pids=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
      # shellcheck disable=SC2086
      scancel --quiet $pids 2>/dev/null || true
      # Jobs get KillWait (5 s) to end on their own before their processes are killed below.
      for i in $(seq 40); do
        [ -z "$(squeue -h -t running,completing,pending -o %A 2>/dev/null)" ] && break
        sleep 0.25
      done
    fi
  fi
  # All daemons at once: each takes 1-2 s to shut down, and no order matters since the next `up`
  # starts slurmctld with a clean state anyway.
  pids=""
  for n in $NODES; do
    pid=$(pid_alive "$STATE/slurmd-node-$n.pid" ddpl-slurmd) && pids="$pids $pid"
  done
  pid=$(pid_alive "$STATE/slurmctld.pid" ddpl-slurmctld) && pids="$pids $pid"
  # shellcheck disable=SC2086
  kill_and_wait $pids
  # Whatever else runs on our hosts (slurmstepds, job tasks, `exec` leftovers) goes too:
  # a namespace cannot be removed while a process keeps it.
  # shellcheck disable=SC2046
  kill_and_wait $(our_pids)

  close_firewall
  for n in $NODES; do
    # The pair first: deleting the namespace alone frees the root-side end only asynchronously.
    ip link del "$(veth_of "$n")" 2>/dev/null || true
    ip link del "ddptmp-$n" 2>/dev/null || true
    [ -e "/run/netns/$(ns_of "$n")" ] && ip netns delete "$(ns_of "$n")"
    rm -rf "/etc/netns/$(ns_of "$n")"
  done
  rmdir /etc/netns 2>/dev/null || true
  ip link del "$BR" 2>/dev/null || true
  for n in $NODES ctl; do
    mountpoint -q "$UTS_DIR/$n" 2>/dev/null && umount "$UTS_DIR/$n"
    rm -f "$UTS_DIR/$n"
  done
  mountpoint -q "$UTS_DIR/cgroup" 2>/dev/null && umount -R "$UTS_DIR/cgroup"
  # rmdir, not rm -rf: should an unmount have failed, rm would walk into the live cgroup tree.
  rmdir "$UTS_DIR/cgroup" "$UTS_DIR" 2>/dev/null || true
  rm -f "$STATE/slurmctld.pid" "$STATE"/slurmd-node-?.pid

  if [ -s "$STATE/munged.ours" ]; then
    pid=$(cat "$STATE/munged.ours")
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = munged ]; then
      if pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || pgrep -x slurmstepd >/dev/null; then
        note "leaving munged (pid $pid) running: the one-node cluster (scripts/slurm_local.sh) uses it now"
      else
        kill_and_wait "$pid"
      fi
    fi
    rm -f "$STATE/munged.ours"
  fi

  local left=""
  ip link show "$BR" >/dev/null 2>&1 && left="$left $BR"
  for n in $NODES; do
    [ -e "/run/netns/$(ns_of "$n")" ] && left="$left $(ns_of "$n")"
    ip link show "$(veth_of "$n")" >/dev/null 2>&1 && left="$left $(veth_of "$n")"
  done
  pgrep -f "$BIN/ddpl-slurm" >/dev/null && left="$left $(pgrep -f "$BIN/ddpl-slurm" | tr '\n' ' ')"
  [ -z "$left" ] || die "down left behind:$left"
  echo "netns cluster down"
}

status() {
  local n ns pid up=1
  for n in $NODES; do
    ns=$(ns_of "$n")
    if [ -e "/run/netns/$ns" ] && mountpoint -q "$UTS_DIR/$n" 2>/dev/null; then
      # slurmctld notices a dead slurmd only after minutes, so sinfo alone would still say idle.
      pid=$(pid_alive "$STATE/slurmd-node-$n.pid" ddpl-slurmd) && pid="slurmd pid $pid" || { pid="no slurmd"; up=0; }
      printf '%s  %s  %s  %s\n' "$ns" "$(nsenter --uts="$UTS_DIR/$n" hostname)" \
        "$(ip -n "$ns" -4 -o addr show dev eth0 2>/dev/null | awk '{print $2, $4}')" "$pid"
    else
      printf '%s  (not up)\n' "$ns"; up=0
    fi
  done
  if ip link show "$BR" >/dev/null 2>&1; then
    printf 'root  %s  %s\n' "$(mountpoint -q "$UTS_DIR/ctl" 2>/dev/null && nsenter --uts="$UTS_DIR/ctl" hostname)" \
      "$(ip -4 -o addr show dev "$BR" | awk '{print $2, $4}')"
  else
    printf '%s  (not up)\n' "$BR"; up=0
  fi
  if pid=$(pid_alive "$STATE/slurmctld.pid" ddpl-slurmctld); then
    echo "slurmctld pid $pid, SLURM_CONF=$CONF"
    SLURM_CONF=$CONF sinfo || up=0
  else
    echo "slurm: not running ($CONF)"; up=0
  fi
  [ "$up" = 1 ] || return 3
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) need_root status; status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  exec)
    [ $# -ge 3 ] || die "usage: $0 exec a|b COMMAND [ARG...]"
    need_root exec
    n=$(node_arg "$2"); shift 2
    on_host "$n" "$@"
    ;;
  *) echo "usage: $0 up [net] | down | status | env | exec a|b COMMAND [ARG...]" >&2; exit 2 ;;
esac
