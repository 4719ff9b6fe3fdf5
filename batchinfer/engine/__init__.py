"""Engines: the interface the job layer uses, sampling, and the text engines."""
