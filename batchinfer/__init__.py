"""batchinfer: offline batch inference for Qwen MoE models as resumable Parquet jobs."""

__version__ = "0.1.0"
