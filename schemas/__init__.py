"""Versioned Arrow schemas of every file batchinfer reads or writes (installed as batchinfer.schemas)."""
