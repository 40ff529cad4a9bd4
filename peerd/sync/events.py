"""Events into and actions out of a sync policy: the whole contract between the algorithm core and
whatever drives it (the daemon, the simulator, the property tests).

Design:
- Plain frozen dataclasses, no behaviour. Time never appears in an event; it is the `now` argument
  of `Policy.on_event`.
- Iterations are ints >= 0. `CURRENT` (-1) as the iteration of a self entry means "my working
  parameters as they are now" (asynchronous in-place averaging, AD-PSGD's passive side).
- One worker's iteration k means: the trainer published x_k, computes its gradient at x_k, asks for
  the mix of iteration k, then sets x_{k+1} = mix_k - lr * d(x_k) and publishes the next iteration
  (k+1, or k' > k+1 when the policy said Skip).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CURRENT = -1  # iteration tag of "my working parameters now" (only in self entries / live sends)


# --- events (driver -> policy) ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Published:
    """The trainer published its parameters of iteration k (gradient computation starts now)."""
    k: int


@dataclass(frozen=True, slots=True)
class MixRequested:
    """The trainer has its gradient of iteration k and asks for the mix of iteration k."""
    k: int


@dataclass(frozen=True, slots=True)
class UpdateArrived:
    """The parameters of `src` tagged with iteration k are in hand (pushed or pulled)."""
    src: int
    k: int


@dataclass(frozen=True, slots=True)
class TokensArrived:
    """`src` granted n tokens on the edge me -> src: I may run n more iterations ahead of it."""
    src: int
    n: int


@dataclass(frozen=True, slots=True)
class PullRequested:
    """`src` asks for my parameters. With `carried` it sent its own iteration-k parameters along
    (they are in hand as UpdateArrived(src, k) would be) and expects pairwise averaging."""
    src: int
    k: int = CURRENT
    carried: bool = False


@dataclass(frozen=True, slots=True)
class PullFailed:
    """My Pull(peer) issued at iteration k got no answer within the driver's bound (the pull
    failed, was refused, or the peer answered nothing). The pull is over: a late answer may
    still arrive and is treated as any unasked-for update."""
    peer: int
    k: int


@dataclass(frozen=True, slots=True)
class UpdateLost:
    """`src`'s update of iteration k will not come: it failed on its way (cut by its deadline on a
    slow link, stalled) and its sender does not send it again. The mix of k (or of an earlier
    iteration: links are FIFO) does not wait for it; `src` stays a neighbour and is waited on again
    from iteration k + 1 (unlike PeerDown, which re-links the graph around it: one host's loss is
    not its neighbours' view). See Policy.excused."""
    src: int
    k: int


@dataclass(frozen=True, slots=True)
class PeerDown:
    peer: int


@dataclass(frozen=True, slots=True)
class PeerUp:
    """`peer` is (back) up, working at iteration k."""
    peer: int
    k: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class LinkEstimates:
    """Measured expected times, times[i][j] (seconds; see each policy for what it expects: arrival
    delay of j's model at i, or i's iteration time when it syncs with j), as nested tuples or a
    read-only numpy array (one shared array for many policies in one process). `effective_k` is the
    iteration from which a policy that needs agreement between workers (AAU) applies them."""
    times: Any
    effective_k: int = 0


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed (a Wait deadline was reached, or the driver's periodic timer)."""


Event = Published | MixRequested | UpdateArrived | UpdateLost | TokensArrived | PullRequested | PullFailed \
    | PeerDown | PeerUp | LinkEstimates | Tick


# --- actions (policy -> driver) -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    """Send my parameters of iteration k to dst. With `live`, send the working parameters as they
    are now, tagged k (used to answer pulls for pairwise averaging)."""
    dst: int
    k: int
    live: bool = False


@dataclass(frozen=True, slots=True)
class Pull:
    """Ask dst for its newest parameters; they come back as UpdateArrived(dst, k'). With `carry_k`
    >= 0, my iteration-carry_k parameters travel with the request (pairwise averaging)."""
    dst: int
    carry_k: int = CURRENT


@dataclass(frozen=True, slots=True)
class Grant:
    """Give n tokens to dst (for its edge dst -> me)."""
    dst: int
    n: int


@dataclass(frozen=True, slots=True)
class Mix:
    """The mix of iteration k: sum of weight * params(src, iteration) over entries (weights sum to
    1; my own entry is (me, k) or (me, CURRENT)). The trainer then applies its step and publishes
    the next iteration. `waited` names the peers this mix waited for (observability, AAU checks)."""
    k: int
    entries: tuple[tuple[int, int, float], ...]
    waited: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Average:
    """Replace my working parameters now by the weighted sum of entries (asynchronous, outside the
    iteration structure: AD-PSGD's passive side)."""
    entries: tuple[tuple[int, int, float], ...]


@dataclass(frozen=True, slots=True)
class Skip:
    """After the mix just emitted, publish iteration `to` instead of k+1."""
    to: int


@dataclass(frozen=True, slots=True)
class Drop:
    """I no longer need the parameters (src, k) I received; the driver may free them."""
    src: int
    k: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until an event arrives (or until `until`, then deliver a Tick)."""
    reason: str
    until: float | None = None


Action = Send | Pull | Grant | Mix | Average | Skip | Drop | Wait


@dataclass
class WaitInfo:
    """Why a policy is waiting, for state()."""
    reason: str = ""
    since: float | None = None
    on: list[int] = field(default_factory=list)
