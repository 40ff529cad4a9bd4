"""Peers' updates held for the mix, and the checks an update must pass before it is held.

An update is held until the policy Drops it (or the run ends). One that fails a check is never
held nor shown to the policy as parameters: its sender is counted (peerd.node.offences flags a
peer that keeps sending them), and the policy hears that it arrived, so a wait for it ends.
"""
from __future__ import annotations

import collections
from typing import Callable

import torch

from peerd.config import Config
from peerd.net import tensorwire as tw
from peerd.net.dataplane import Received

Key = tuple[int, int]                      # (source rank, iteration)


class HeldUpdates:
    """Received updates by (source rank, iteration), and those that came before our trainer attached."""

    def __init__(self, early_limit: int, on_discard: Callable[[Key, torch.Tensor], None],
                 release: Callable[[Received], None] = Received.release) -> None:
        self.received: dict[Key, Received] = {}
        self.early: list[Received] = []    # arrived before our trainer attached: replayed at attach
        self.early_limit = early_limit
        self.on_discard = on_discard       # a held buffer is about to be freed (the running mix sum)
        self.release = release             # frees a buffer once the passes that read it are done

    def hold_early(self, rec: Received) -> None:
        if len(self.early) < self.early_limit:
            self.early.append(rec)
        else:
            rec.release()

    def take_early(self) -> list[Received]:
        early, self.early = self.early, []
        return early

    def put(self, src: int, rec: Received) -> None:
        """Hold `rec`; a duplicate of (src, iteration) is replaced by the newest copy."""
        self.drop(src, rec.iteration)
        self.received[(src, rec.iteration)] = rec

    def drop(self, src: int, k: int) -> None:
        rec = self.received.pop((src, k), None)
        if rec is not None:
            self.on_discard((src, k), rec.buffer)
            self.release(rec)

    def buffer(self, src: int, k: int) -> torch.Tensor | None:
        """The parameters held whole (None for an update summed as it arrived: peerd.node.run.eagersum)."""
        rec = self.received.get((src, k))
        return rec.buffer if rec is not None and not rec.sunk else None

    def release_all(self) -> None:
        for rec in [*self.received.values(), *self.early]:
            rec.release()
        self.received.clear()
        self.early.clear()


class UpdateCheck:
    """Why a peer's update must not be mixed ("" when it may): size not the run's layout, NaN/Inf,
    a value beyond update_max_abs, or a norm beyond update_max_norm_ratio times ours.

    O(1) on the event loop: the data plane measured the update as it finished receiving it
    (`Received.stats`, in a worker thread), and our own parameters were measured at publish."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dropped_nonfinite = 0
        self.dropped_bad: collections.Counter[str] = collections.Counter()   # per sender node id

    def __call__(self, rec: Received, wire: tw.Layout, own: tw.ParamStats | None) -> str:
        if rec.nbytes != wire.nbytes:
            return f"{rec.nbytes} bytes, this run's layout has {wire.nbytes}"
        stats = rec.stats if rec.stats is not None else tw.param_stats(wire, rec.buffer)
        if not stats.finite:
            self.dropped_nonfinite += 1
            return "NaN/Inf in the parameters"
        cfg = self.cfg.train
        if cfg.update_max_abs > 0 and stats.max_abs > cfg.update_max_abs:
            return f"|value| {stats.max_abs:.3g} beyond update_max_abs {cfg.update_max_abs:g}"
        if cfg.update_max_norm_ratio > 0 and own is not None:
            if stats.norm > cfg.update_max_norm_ratio * max(own.norm, 1.0):
                return (f"parameter norm {stats.norm:.3g} beyond update_max_norm_ratio "
                        f"{cfg.update_max_norm_ratio:g} x ours {own.norm:.3g} (floor 1)")
        return ""
