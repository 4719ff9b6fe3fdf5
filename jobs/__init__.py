"""The job layer: plans, shards, commits, resume, executors (installed as batchinfer.jobs)."""
