#!/usr/bin/env bash
# A one-node Slurm cluster on this machine for the launcher tests. Prints the name of its partition on stdout, and
# nothing else.
#
# Idempotent, run by `make test` before pytest:
# - PREREG_TEST_SLURM_PARTITION already set: prints it and touches nothing (the tests submit to that partition);
# - otherwise installs Debian's `slurm-wlm` and `munge` when slurmctld is missing (root only), writes a one-node
#   slurm.conf for this machine (its hostname, CPUs and memory; no cgroups, so it runs in a container too), a munge
#   key when there is none, starts munged, slurmctld and slurmd when they are not running, and waits until the
#   partition is up.
# The partition `prereg` holds this machine alone; `prereg-remote` holds it and a second node, `prereg-faraway`,
# declared DOWN, which never runs anything: a partition whose node list names another host (the SQLite ledger is
# refused for it).
# When it cannot (not root and no cluster, apt unreachable, a daemon that does not start), it prints ONE line on
# stderr saying the Slurm tests will be skipped and why, prints no partition, and exits 0; with REQUIRE_SLURM=1
# (CI: `make test REQUIRE_SLURM=1`) it prints that line as an error and exits 1.
set -uo pipefail

PARTITION=prereg
CONF=/etc/slurm/slurm.conf
# How long the daemons get to bring the partition up: they take a second or two; a stale state file a few more.
UP_WITHIN_S=30

say() { echo "tests/slurm_cluster.sh: $*" >&2; }

give_up() {
  if [[ "${REQUIRE_SLURM:-}" == 1 ]]; then
    say "error: no Slurm cluster for the launcher tests, and REQUIRE_SLURM=1: $1"
    exit 1
  fi
  say "the Slurm launcher tests will be skipped: $1"
  exit 0
}

last_line() { grep -v '^[[:space:]]*$' "$1" | tail -n 1; }

if [[ -n "${PREREG_TEST_SLURM_PARTITION:-}" ]]; then
  printf '%s\n' "$PREREG_TEST_SLURM_PARTITION"
  exit 0
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
is_root=0
[[ $(id -u) == 0 ]] && is_root=1

partition_up() {
  [[ $(sinfo -h -p "$PARTITION" -o '%a' 2>/dev/null) == up ]] \
    && sinfo -h -p "$PARTITION" -t idle,mixed,allocated -o '%n' 2>/dev/null | grep -qx "$(hostname -s)"
}

# A cluster already up (this script ran before, or the machine has one): nothing to do.
if command -v sinfo >/dev/null 2>&1 && partition_up; then
  printf '%s\n' "$PARTITION"
  exit 0
fi

(( is_root )) || give_up "no Slurm partition '$PARTITION' is up, and starting one needs root; or set PREREG_TEST_SLURM_PARTITION to a partition you have"

# --- install ------------------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  command -v apt-get >/dev/null 2>&1 || give_up "Slurm is not installed and there is no apt-get to install it"
  say "installing Debian's slurm-wlm and munge packages (apt-get, once)"
  if ! { apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; } >"$log" 2>&1; then
    give_up "apt-get could not install slurm-wlm and munge: $(last_line "$log")"
  fi
  command -v slurmctld >/dev/null 2>&1 || give_up "apt-get installed slurm-wlm but slurmctld is still missing"
fi

# --- slurm.conf ---------------------------------------------------------------------------------------------------
host=$(hostname -s)
# slurmd -C: "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105".
node=$(slurmd -C 2>/dev/null | head -n 1 | sed -E 's/^NodeName=[^ ]+ //; s/ UpTime.*//')
[[ -n "$node" ]] || give_up "slurmd -C could not describe this machine"
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm /run/slurm
conf=$(cat <<EOF
# Written by tests/slurm_cluster.sh: a one-node cluster on this machine for prereg's launcher tests.
ClusterName=prereg-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# No cgroups: a container has none to give. Processes are tracked by their parent links, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
ReturnToService=2
# Ended jobs stay in the controller (scontrol show job) this long: the launcher reads their state there when
# there is no accounting database.
MinJobAge=600
# SIGTERM to SIGKILL at scancel: a rung needs a second or two to write its end.
KillWait=10
InactiveLimit=0
SchedulerType=sched/backfill
NodeName=$host NodeAddr=127.0.0.1 $node State=UNKNOWN
NodeName=prereg-faraway NodeAddr=127.0.0.2 CPUs=1 RealMemory=1000 State=DOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
PartitionName=$PARTITION-remote Nodes=$host,prereg-faraway MaxTime=INFINITE State=UP
EOF
)
restart=0
if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$conf" ]]; then
  printf '%s\n' "$conf" >"$CONF"
  restart=1
fi

# --- munge --------------------------------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none || give_up "cannot write /etc/munge/munge.key"
fi
chown munge:munge /etc/munge/munge.key 2>/dev/null
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged >"$log" 2>&1 || give_up "munged did not start: $(last_line "$log")"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || give_up "munged started but munge -n | unmunge fails"
fi

# --- slurmctld and slurmd -----------------------------------------------------------------------------------------
running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if (( restart )); then
  for pidfile in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid; do
    running "$pidfile" && kill "$(cat "$pidfile")" && sleep 1
  done
fi
if ! running /run/slurm/slurmctld.pid; then
  slurmctld >"$log" 2>&1 || give_up "slurmctld did not start: $(last_line "$log") (see /var/log/slurm/slurmctld.log)"
fi
if ! running /run/slurm/slurmd.pid; then
  slurmd >"$log" 2>&1 || give_up "slurmd did not start: $(last_line "$log") (see /var/log/slurm/slurmd.log)"
fi

for _ in $(seq $((UP_WITHIN_S * 10))); do
  partition_up && break
  sleep 0.1
done
if ! partition_up; then
  # A node left DOWN by an earlier crash of its slurmd comes back when told to.
  scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1
  sleep 1
  partition_up || give_up "partition $PARTITION is not up after ${UP_WITHIN_S}s: $(sinfo -h -p "$PARTITION" -o '%a %t %n' 2>&1 | head -n 1)"
fi
printf '%s\n' "$PARTITION"
