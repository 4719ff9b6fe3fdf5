"""Progress reporting, kept apart from logging: tqdm bars on stderr (rows, and for text jobs generated
tokens with tokens/s), JSON lines on stdout for schedulers (`--progress json`), or nothing (`--progress
none`). An image job's rows are its images.

JSON events, one object per line: `{"event": "start", "rows_total", "shards"}`, `{"event": "chunk",
"shard", "attempt", "chunk", "rows", "errors", "skipped", "output_tokens", "rows_done", "rows_total",
"rows_per_s", "tokens_per_s", "elapsed_s"}` after every commit, `{"event": "shard", "shard", "status"}` and
a final `{"event": "end", "rows_done", "output_tokens", "rows_per_s", "tokens_per_s", "elapsed_s",
"status"}`. Totals are this run's rows (on a resume, the rows left), not the job's.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

MODES = ("bar", "json", "none")


class Progress:
    def __init__(
        self, mode: str = "bar", rows_total: int = 0, shards: int = 0, row_unit: str = "row"
    ) -> None:
        """`row_unit`: what a row is ("image" for image jobs, which generate no tokens: no token bar)."""
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.rows_total = rows_total
        self.rows_done = 0
        self.output_tokens = 0
        self.t0 = time.monotonic()
        self._bars: list[Any] = []
        if mode == "bar":
            from tqdm import tqdm

            rows = tqdm(
                total=rows_total,
                unit=row_unit,
                desc=f"{row_unit}s",
                position=0,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            self._bars = [rows]
            if row_unit == "row":
                self._bars.append(
                    tqdm(
                        unit="tok",
                        desc="tokens",
                        position=1,
                        file=sys.stderr,
                        dynamic_ncols=True,
                        unit_scale=True,
                    )
                )
        self._emit({"event": "start", "rows_total": rows_total, "shards": shards})

    def _emit(self, event: dict[str, Any]) -> None:
        if self.mode == "json":
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    def tokens_per_s(self) -> float:
        return round(self.output_tokens / max(time.monotonic() - self.t0, 1e-9), 2)

    def rows_per_s(self) -> float:
        return round(self.rows_done / max(time.monotonic() - self.t0, 1e-9), 2)

    def tokens(self, n: int) -> None:
        """Called by the engine (on_tokens) as tokens are generated."""
        self.output_tokens += n
        if len(self._bars) > 1:
            self._bars[1].update(n)

    def chunk(self, stats: dict[str, Any]) -> None:
        """A chunk was committed; `stats` is its `batchinfer.chunk` metadata."""
        self.rows_done += stats["rows"]
        if self._bars:
            self._bars[0].update(stats["rows"])
        self._emit(
            {
                "event": "chunk",
                **{
                    k: stats[k]
                    for k in ("shard", "attempt", "chunk", "rows", "errors", "skipped", "output_tokens")
                },
                "rows_done": self.rows_done,
                "rows_total": self.rows_total,
                "rows_per_s": self.rows_per_s(),
                "tokens_per_s": self.tokens_per_s(),
                "elapsed_s": round(time.monotonic() - self.t0, 2),
            }
        )

    def shard(self, shard: int, status: str) -> None:
        self._emit({"event": "shard", "shard": shard, "status": status})

    def close(self, status: str) -> None:
        for bar in self._bars:
            bar.close()
        self._emit(
            {
                "event": "end",
                "status": status,
                "rows_done": self.rows_done,
                "output_tokens": self.output_tokens,
                "rows_per_s": self.rows_per_s(),
                "tokens_per_s": self.tokens_per_s(),
                "elapsed_s": round(time.monotonic() - self.t0, 2),
            }
        )
