"""`peerd train --budget swarm`: the run's iterations are a budget for all its hosts together.

world x iterations, as asynchronous algorithms count them: a fast host does more than a slow one
instead of stopping early and leaving the slow ones to finish alone. Every train_budget_interval
the live members are asked their iteration (each member's highest answer is kept: a finished or
lost host still counts what it did); once the sum reaches the budget, our trainer is stopped as
`peerd ctl stop` does. The built-in trainer is started with world x iterations as its own cap.
"""
from __future__ import annotations

import asyncio
import logging

from peerd.node.run.context import RunContext
from peerd.node.run.resume import Resume
from peerd.node.run.trainer_api import TrainerApi
from peerd.v1 import control_pb2 as cpb

log = logging.getLogger("peerd.train")


async def watch_swarm_budget(ctx: RunContext, resume: Resume, api: TrainerApi, done: asyncio.Event) -> None:
    budget = ctx.spec.iterations * ctx.spec.world
    seen: dict[int, int] = {}
    while not done.is_set() and not api.stop_requested:
        await asyncio.sleep(ctx.cfg.train.budget_interval)
        k = ctx.policy.k
        if k < 0:
            continue
        # Every member, the ones the policy does not wait for included (silent, finished): they count.
        for i, ki in (await resume.member_iterations(quiet=True, every=True)).items():
            seen[i] = max(seen.get(i, 0), ki + 1)
        total = ctx.policy.k + 1 + sum(seen.values())
        if total >= budget and not api.stop_requested:
            log.info("the swarm's budget is spent: %d iterations done of %d (this host %d); stopping the trainer",
                     total, budget, ctx.policy.k + 1)
            await api.direct(cpb.Directive(kind=cpb.Directive.KIND_STOP,
                                           reason="the swarm's iteration budget is spent"))
            return
