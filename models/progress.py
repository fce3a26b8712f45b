"""What a training run prints while it runs (rank 0 only).

With ``progress`` on: a tqdm bar on stderr when stderr is a terminal, with messages written
above it; and when stdout is not a terminal — a log file, a batch job, CI — one line on stdout
every ``progress_interval`` seconds (``step 120/600: train 1.9134, 5,432 tok/s, MFU 41.0%,
optimizer 12%``), so that the log of a job that runs for hours shows it is alive. Messages
(evaluations, the end) are printed in every case.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress", "describe_rates"]


def describe_rates(row: dict) -> str:
    """``"5,432 tok/s, MFU 41.0%, optimizer 12%"`` of a metrics row (the parts it has)."""
    parts = [f"{row['tokens_per_s']:,.0f} tok/s"] if "tokens_per_s" in row else []
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("optimizer_share") is not None:
        parts.append(f"optimizer {100 * row['optimizer_share']:.0f}%")
    return ", ".join(parts)


class Progress:
    """The bar or the periodic line, and messages.

    Args:
        enabled: print at all (rank 0 and ``echo``).
        bar: show progress (``TrainConfig.progress``).
        interval: seconds between lines when stdout is not a terminal (``0``: every step).
        start, total: the first and the last step of this invocation.
    """

    def __init__(self, enabled: bool, bar: bool, interval: float, start: int, total: int
                 ) -> None:
        self.enabled, self.interval, self.total = enabled, interval, total
        self.bar = _make_bar(start, total) if enabled and bar and sys.stderr.isatty() else None
        self.lines = enabled and bar and not sys.stdout.isatty()
        self.last_line = time.perf_counter()

    def say(self, text: str) -> None:
        """Print a message (above the bar, if any)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def update(self, step: int, loss: float, rates: dict) -> None:
        """After every step: advance the bar; print a line when ``interval`` has passed.

        Args:
            step: the step just taken.
            loss: its training loss.
            rates: the last logged row's throughput (:func:`describe_rates`).
        """
        if self.bar is not None:
            self.bar.update(1)
            if "tokens_per_s" in rates:
                self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rates['tokens_per_s']:.0f}")
        now = time.perf_counter()
        if self.lines and now - self.last_line >= self.interval:
            self.last_line = now
            rate = describe_rates(rates)
            print(f"step {step}/{self.total}: train {loss:.4f}" + (f", {rate}" if rate else ""),
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _make_bar(start: int, total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a nicety: train without it
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

