#!/usr/bin/env bash
# Start a throw-away single-node Slurm cluster on this machine, for the real-Slurm tests.
#
#   tests/slurm/start_cluster.sh STATE_DIR [MAX_ARRAY_SIZE]    # then: export SLURM_CONF=STATE_DIR/slurm.conf
#   tests/slurm/stop_cluster.sh STATE_DIR
#
# Needs root. Installs Debian's slurm-wlm and munge when missing (one apt-get update), writes a private
# cgroup-free slurm.conf under STATE_DIR (it never touches /etc/slurm), starts munged (unless one already
# answers), slurmctld and slurmd on private ports, and waits until the node is idle. Every daemon's pid
# lands in STATE_DIR/*.pid for stop_cluster.sh. Exit 77 means "Slurm cannot be installed here" (not root,
# no apt-get); any other failure is a real error. Ports 16817/16818, so a site's own Slurm is not disturbed.
set -euo pipefail

state=${1:?usage: start_cluster.sh STATE_DIR [MAX_ARRAY_SIZE]}
max_array_size=${2:-1001}
mkdir -p "$state"
state=$(cd "$state" && pwd)

if [ "$(id -u)" != 0 ]; then
    echo "start_cluster: needs root to run slurmd (running as $(id -un))" >&2
    exit 77
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
    if ! command -v apt-get >/dev/null; then
        echo "start_cluster: Slurm is not installed and there is no apt-get to install it" >&2
        exit 77
    fi
    echo "start_cluster: installing slurm-wlm and munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    # Keep the packages from starting their services with default configs (slurmctld's would fail
    # without /etc/slurm/slurm.conf and fail the install); the standard policy-rc.d "deny" answer.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends slurm-wlm munge >&2
fi

# munge: reuse a running munged, else start one as the munge user with the package's key.
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
    runuser -u munge -- munged
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    cp /run/munge/munged.pid "$state/munged.pid"
fi

host=$(hostname -s)
cpus=$(nproc)
# Job scripts run from the spool dir, so keep it off /tmp (often mounted noexec on CI runners).
spool=/var/spool/batchinfer-test-slurmd
mkdir -p "$state/ctld" "$state/log" "$spool"
echo "$spool" >"$state/spool_dir"
cat >"$state/slurm.conf" <<CONF
ClusterName=batchinfer-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
MaxArraySize=$max_array_size
KillWait=5
MinJobAge=600
SchedulerParameters=defer_batch
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$state/slurm.conf

slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"

for _ in $(seq 120); do
    if [ "$(sinfo -h -N -o %t 2>/dev/null)" = idle ]; then
        echo "start_cluster: node $host idle; export SLURM_CONF=$SLURM_CONF" >&2
        exit 0
    fi
    sleep 0.5
done
echo "start_cluster: node did not become idle within 60 s; sinfo says: $(sinfo -h -N 2>&1)" >&2
tail -n 20 "$state/log/slurmctld.log" "$state/log/slurmd.log" >&2 || true
exit 1
