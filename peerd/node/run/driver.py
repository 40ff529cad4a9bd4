"""The policy driver: real events into the sans-I/O policy, its actions out to the run's pieces.

The policy (peerd.sync) never reads a clock nor does I/O; this is the one place that calls it with
the time, arms the timer a Wait asks for, and hands each action to the piece that carries it out
(an `ActionSink`: the run's coordinator, which delegates). A policy, or the code applying its
actions, that raises is a bug: the run fails at once, loudly (its state can no longer be trusted),
and the daemon serves on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from peerd.sync import events as ev
from peerd.sync.policy import Policy

log = logging.getLogger("peerd.train")


class ActionSink(Protocol):
    def send(self, a: ev.Send) -> None: ...
    def pull(self, a: ev.Pull) -> None: ...
    def grant(self, a: ev.Grant) -> None: ...
    def mix(self, a: ev.Mix) -> None: ...
    def average(self, a: ev.Average) -> None: ...
    def skip(self, a: ev.Skip) -> None: ...
    def drop(self, a: ev.Drop) -> None: ...
    def applied(self) -> None:
        """A batch of actions is applied: a Skip follows its Mix in one batch, so the trainer's
        mix is answered only now."""
    def fed(self) -> None:
        """An event was handled: the incremental mix catches up with what the policy would mix."""


class PolicyDriver:
    def __init__(self, policy: Policy, sink: ActionSink, on_error: Callable[[str], None]) -> None:
        self.policy = policy
        self.sink = sink
        self.on_error = on_error
        self.timer: asyncio.TimerHandle | None = None
        self.broken = False     # a bug was hit: no more events in (the run is failing)

    def feed(self, event: ev.Event) -> None:
        if self.broken:
            return
        try:
            actions = self.policy.on_event(event, time.monotonic())
        except Exception as e:  # noqa: BLE001 - a policy bug must not take the daemon down
            self._bug(f"policy {self.policy.name} failed on {event!r}", e)
            return
        self.apply_all(actions)
        if not self.broken:
            self.sink.fed()

    def decide(self, event: ev.Event) -> list[ev.Action]:
        """The policy's actions for `event`, not applied: the caller takes what it answers itself
        (a pull's reply) and applies the rest with apply_all."""
        if self.broken:
            return []
        try:
            return self.policy.on_event(event, time.monotonic())
        except Exception as e:  # noqa: BLE001
            self._bug(f"policy {self.policy.name} failed on {event!r}", e)
            return []

    def apply_all(self, actions: list[ev.Action]) -> None:
        try:
            for action in actions:
                if self.broken:      # a nested feed hit a bug: nothing more of this batch
                    return
                self.apply(action)
            if not self.broken:
                self.sink.applied()
        except Exception as e:  # noqa: BLE001 - the run layer's bug must not take the daemon down
            self._bug(f"applying {actions!r}", e)

    def _bug(self, doing: str, e: Exception) -> None:
        log.exception("internal error %s", doing)
        self.broken = True
        self.stop()
        self.on_error(f"{type(e).__name__}: {e} while {doing}"[:400])

    def apply(self, a: ev.Action) -> None:
        s = self.sink
        match a:
            case ev.Send():
                s.send(a)
            case ev.Pull():
                s.pull(a)
            case ev.Grant():
                s.grant(a)
            case ev.Mix():
                s.mix(a)       # now: a Drop later in the batch may free its inputs
            case ev.Average():
                s.average(a)   # captured now: the policy drops the carried update in the same batch
            case ev.Skip():
                s.skip(a)
            case ev.Drop():
                s.drop(a)
            case ev.Wait():
                if a.until is not None:
                    self._arm_timer(a.until)

    def _arm_timer(self, until: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        delay = max(0.0, until - time.monotonic())
        self.timer = asyncio.get_running_loop().call_later(delay, lambda: self.feed(ev.Tick()))

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
