"""A pull that goes unanswered must not hold a pull policy (NetMax, AD-PSGD) until the trainer's
mix timeout: on PullFailed the policy pulls another live peer, or takes the local step when none is
left; a late or stale PullFailed changes nothing; the failed peer is pulled again after pull_backoff."""
from __future__ import annotations

import pytest

from peerd.sync import netmax as nm
from peerd.sync import topology as T
from peerd.sync.baselines import ADPSGD
from peerd.sync.policy import PullBackoff
from peerd.sync.events import Mix, MixRequested, Published, Pull, PullFailed, UpdateArrived, Wait


def make(algo: str, n: int, seed: int = 3):
    if algo == "netmax":
        return nm.NetMax(0, T.complete(n), seed=seed)
    return ADPSGD(0, T.complete(n), seed=seed)     # worker 0 is active; odd ids are its partners


def only(acts, kind):
    found = [a for a in acts if isinstance(a, kind)]
    assert len(found) == 1, acts
    return found[0]


@pytest.mark.parametrize("algo", ["netmax", "ad-psgd"])
def test_unanswered_pull_is_bounded_without_new_events(algo):
    """The reported stall: the pulled peer never answers. Before PullFailed existed, nothing but a
    reply or PeerDown released the mix; now the driver's bounded PullFailed does."""
    p = make(algo, 2)
    first = only(p.on_event(Published(0), 0.0), Pull)
    assert isinstance(p.on_event(MixRequested(0), 0.1)[0], Wait)
    acts = p.on_event(PullFailed(first.dst, 0), 5.1)
    mix = only(acts, Mix)                          # the only partner failed: local step
    assert mix.k == 0 and mix.entries == ((0, 0, 1.0),)
    assert p.waiting.reason == ""
    # Within pull_backoff (10 s) the failed peer is not pulled: iterations step locally, no wait.
    assert not any(isinstance(a, Pull) for a in p.on_event(Published(1), 6.0))
    assert only(p.on_event(MixRequested(1), 6.1), Mix).entries == ((0, 1, 1.0),)
    # After it, the peer is pulled again (a hiccup does not remove a link).
    assert only(p.on_event(Published(2), 15.2), Pull).dst == first.dst


@pytest.mark.parametrize("algo", ["netmax", "ad-psgd"])
def test_failed_pull_goes_to_another_peer_then_mixes_its_reply(algo):
    p = make(algo, 6)
    first = only(p.on_event(Published(0), 0.0), Pull)
    p.on_event(MixRequested(0), 0.1)
    second = only(p.on_event(PullFailed(first.dst, 0), 5.0), Pull)
    assert second.dst != first.dst
    if algo == "ad-psgd":
        assert second.carry_k == 0 and second.dst % 2 == 1
    # A late answer from the failed peer is not mixed; the new peer's is.
    assert not any(isinstance(a, Mix) for a in p.on_event(UpdateArrived(first.dst, 0), 5.5))
    mix = only(p.on_event(UpdateArrived(second.dst, 0), 6.0), Mix)
    assert mix.entries[1][0] == second.dst


@pytest.mark.parametrize("algo", ["netmax", "ad-psgd"])
def test_every_peer_failing_ends_in_the_local_step(algo):
    n = 6
    p = make(algo, n)
    pulls = [only(p.on_event(Published(0), 0.0), Pull).dst]
    p.on_event(MixRequested(0), 0.1)
    for t in range(1, n + 1):
        acts = p.on_event(PullFailed(pulls[-1], 0), float(t))
        mixes = [a for a in acts if isinstance(a, Mix)]
        if mixes:
            assert mixes[0].entries == ((0, 0, 1.0),)
            break
        pulls.append(only(acts, Pull).dst)
    else:
        pytest.fail(f"no local step after {n} failed pulls: {pulls}")
    assert len(set(pulls)) == len(pulls)           # each peer tried at most once per iteration
    assert len(pulls) == (n - 1 if algo == "netmax" else n // 2)


@pytest.mark.parametrize("algo", ["netmax", "ad-psgd"])
def test_stale_pull_failure_is_ignored(algo):
    p = make(algo, 6)
    first = only(p.on_event(Published(0), 0.0), Pull)
    p.on_event(UpdateArrived(first.dst, 0), 0.5)
    only(p.on_event(MixRequested(0), 0.6), Mix)
    again = only(p.on_event(Published(1), 1.0), Pull)
    # The failure of iteration 0's pull (or of a pull already answered) reaches us late.
    assert p.on_event(PullFailed(first.dst, 0), 1.2) == []
    assert p.on_event(PullFailed(again.dst, 1), 1.3) != [] and p.pulling != again.dst
    assert p.on_event(PullFailed(again.dst, 1), 1.4) == []    # that pull is already given up



def test_pull_backoff_doubles_per_failure_in_a_row_up_to_its_bound_and_an_answer_resets_it():
    b = PullBackoff(1.0, 10.0)
    assert b.ready(3, 0.0)
    b.failed(3, 0.0)
    assert not b.ready(3, 0.99) and b.ready(3, 1.0)
    b.failed(3, 1.0)
    assert not b.ready(3, 2.99) and b.ready(3, 3.0)
    for _ in range(5):
        b.failed(3, 3.0)
    assert not b.ready(3, 12.99) and b.ready(3, 13.0)      # 64 s capped at 10
    b.answered(3)
    b.failed(3, 20.0)
    assert b.ready(3, 21.0)                                 # back to the first rest
    assert b.ready(4, 20.0)                                 # per peer
    with pytest.raises(ValueError, match="pull_backoff"):
        PullBackoff(0.0, 1.0)


@pytest.mark.parametrize("algo", ["netmax", "ad-psgd"])
def test_a_peer_still_starting_is_pulled_again_after_the_first_rest(algo):
    """The commonest failure: the peer's trainer has not published yet. It is pulled again after
    pull_backoff_first (1 s), not pull_backoff (10 s); once it answered, a new failure rests 1 s."""
    p = make(algo, 2)
    peer = only(p.on_event(Published(0), 0.0), Pull).dst
    p.on_event(MixRequested(0), 0.1)
    only(p.on_event(PullFailed(peer, 0), 5.0), Mix)
    assert not any(isinstance(a, Pull) for a in p.on_event(Published(1), 5.5))   # resting
    only(p.on_event(MixRequested(1), 5.6), Mix)
    assert only(p.on_event(Published(2), 6.1), Pull).dst == peer
    p.on_event(MixRequested(2), 6.2)
    only(p.on_event(UpdateArrived(peer, 2), 6.3), Mix)   # answered: its rest resets
    only(p.on_event(Published(3), 6.4), Pull)
    p.on_event(MixRequested(3), 6.5)
    only(p.on_event(PullFailed(peer, 3), 11.5), Mix)
    p.on_event(Published(4), 12.0)
    p.on_event(MixRequested(4), 12.1)
    assert only(p.on_event(Published(5), 12.5), Pull).dst == peer
