#!/usr/bin/env bash
# Stop the daemons that start_cluster.sh STATE_DIR started (by their pid files), and only those.
set -uo pipefail
state=${1:?usage: stop_cluster.sh STATE_DIR}
# Cancel what is still queued or running there, so no job step outlives slurmd.
if [ -s "$state/slurmctld.pid" ] && kill -0 "$(cat "$state/slurmctld.pid")" 2>/dev/null; then
    SLURM_CONF=$state/slurm.conf scancel --user="$(id -un)" 2>/dev/null
    for _ in $(seq 50); do
        [ -z "$(SLURM_CONF=$state/slurm.conf squeue --noheader 2>/dev/null)" ] && break
        sleep 0.2
    done
fi
for daemon in slurmd slurmctld munged; do
    pidfile=$state/$daemon.pid
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
done
if [ -s "$state/spool_dir" ]; then
    rm -rf "$(cat "$state/spool_dir")"
    rm -f "$state/spool_dir"
fi
