"""User-facing errors. Each message names the file, row, column or tensor and what was expected.

The CLI prints a BatchinferError as one line and exits 2; anything else is a bug (traceback, exit 1).
"""


class BatchinferError(Exception):
    """Base class of every error caused by input the user gave us."""


class ConfigError(BatchinferError):
    """A model config.json (or generation/tokenizer config) we cannot run."""


class CheckpointError(BatchinferError):
    """A checkpoint file, tensor or quantization config that is missing, misshaped or unsupported."""


class InputError(BatchinferError):
    """A job input file, column or row that does not match its schema."""


class PlanMismatchError(BatchinferError):
    """A rerun whose inputs or parameters differ from the plan already on disk."""
