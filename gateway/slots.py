"""On a Redis Cluster, what a submission's one script does across slots on one Redis, as steps
(fngate.queue.slots) in the order that keeps its guarantees (docs/faults.md):

- the caller's limits are taken first, on the API key's slot (ADMIT), and only then is the
  invocation queued on its function's; they are released as on one Redis, once it is answered, so
  that they hold in total across gateways;
- a pipeline's cached answer is looked up on the pipeline's slot before its first step is queued
  on its function's; its other first steps are queued after the first (FORWARD, slot by slot);
- an Idempotency-Key is claimed on its API key's slot (CLAIM) before the invocation it names is
  submitted, and freed again when the submission is refused;
- the key's result quota is checked on the key's slot (QUOTA) before the submission; whoever stores
  the result charges it there afterwards (CHARGE: fngate.delivery, or the gateway for an answer
  found in the cache);
- an asynchronous pipeline's first steps on other slots are recorded on its result's slot once
  queued, and a cancellation sets them aside slot by slot before CANCEL decides on the result's
  (SlotSteps.cancel);
- the callback of an asynchronous answer found in the cache is queued by the gateway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from fngate import delivery, keys, queue
from fngate.errors import Overloaded, Unavailable
from fngate.fastredis import FastRedis, Script
from fngate.plan import Plan
from fngate.queue import slots
from fngate.repository import FunctionVersion
from fngate.wire import Fields
from gateway import limits, submission
from gateway.cache import SeparateCache
from gateway.call import Call
from gateway.submission import Entries

CLAIM_ATTEMPTS = 3
"""Reads of an Idempotency-Key that another submission changes meanwhile, before a 503."""


class SlotSteps:
    """The per-slot steps, on the enqueue's connection (fngate.fastredis_cluster routes each by its slot)."""

    def __init__(self, redis: FastRedis) -> None:
        self._redis = redis
        self._admit = Script(redis, limits.ADMIT_SCRIPT)
        self._claim = Script(redis, slots.CLAIM)
        self._submit = Script(redis, queue.SUBMIT_ASYNC)
        self._cancel = Script(redis, queue.CANCEL)
        self._quota = Script(redis, slots.QUOTA)
        self._run = delivery.scripts(redis)

    async def admit(self, call: Call) -> None:
        """Take the call's place in its key's limits (call.admission): raises RateLimited when they
        refuse it (it then holds no place), Unavailable when Redis fails."""
        admission = call.admission
        assert admission is not None
        try:
            outcome = await self._admit(list(admission.keys), list(admission.args))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        limits.admitted(call.principal, call.function.manifest.name, outcome)

    async def get(self, entry: str) -> Fields | None:
        """A cached answer on its own slot (a pipeline's), as gateway.cache.SeparateCache.get: one
        that cannot be read is a miss (the enqueue that follows meets the same Redis)."""
        try:
            found: Any = await self._redis.execute("HMGET", entry, "h", "b")
        except (RedisError, OSError):
            return None
        if not found or found[0] is None:
            return None
        return {queue.HEADER: found[0], queue.BODY: found[1] or b""}

    async def forward(
        self, entries: Entries, asynchronous: bool = False, queued: list[tuple[int, bytes]] | None = None
    ) -> None:
        """Queue a pipeline's other first steps (entries.rest); raises Overloaded naming the step
        a full queue refused (the slots before it stay queued), Unavailable when Redis fails.
        `queued` gets (index in entries.rest, entry id) of each step queued."""
        try:
            refused = await delivery.forward(self._run, entries.rest, queued)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        if refused is not None:
            index, limit = refused
            raise Overloaded(queue.full_message(entries.names[index + 1], limit, asynchronous))

    async def submit(
        self,
        call: Call,
        record: bytes,
        invocation_id: str,
        deadline_ms: int,
        plan: Plan | None,
        steps: dict[str, FunctionVersion] | None,
        cache: SeparateCache | None,
        check: Callable[[Entries], None],
        quota: queue.ResultQuota | None = None,
    ) -> tuple[Entries, queue.SubmitOutcome]:
        """An asynchronous call's submission (gateway.dispatch.Dispatcher.submit), its answer looked
        up first (a pipeline's in the queue, a function's in `cache` when it has one of its own),
        `check` run on its entries before anything is queued; `quota`: the result bytes the
        caller's key may hold."""
        later = call.later
        assert later is not None
        entry, _ = submission.cache_keys(call)
        cached = None
        if entry and call.use_cache:
            cached = await (cache.get(entry) if cache is not None and plan is None else self.get(entry))
        entries = submission.asynchronous(
            call, record, invocation_id, deadline_ms, None, "", cached, False, plan, steps, quota, split=True
        )
        check(entries)
        held = ""
        if later.idempotency_key:
            earlier, held = await self._claim_key(call, invocation_id)
            if earlier is not None:
                return entries, earlier
        try:
            outcome = await self._submit_claimed(call, entries, cached, quota)
        except BaseException:
            await self._free(call, held)
            raise
        if not isinstance(outcome, queue.Queued | queue.Done):
            await self._free(call, held)
        return entries, outcome

    async def _submit_claimed(
        self, call: Call, entries: Entries, cached: Fields | None, quota: queue.ResultQuota | None
    ) -> queue.SubmitOutcome:
        later = call.later
        assert later is not None
        if quota is not None:  # before the limits, as on one Redis: a refusal spends no token
            held = await self._check_quota(quota)
            if held is not None:
                return held
        if call.admission is not None:
            await self.admit(call)
        try:
            outcome = queue.parse_submit_async(await self._submit(entries.script.keys, entries.script.args))
            if isinstance(outcome, queue.Done) and outcome.charge is not None:
                await delivery.charge(self._run, [outcome.charge])
            if isinstance(outcome, queue.Done) and cached is not None and later.callback_url:
                await self._redis.execute(
                    *("XADD", keys.callbacks(), "NOMKSTREAM", "*", "h", cached[queue.HEADER]),
                    *("b", cached.get(queue.BODY, b""), "for", entries.id),
                )
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        if isinstance(outcome, queue.Queued) and entries.rest:
            queued: list[tuple[int, bytes]] = []
            try:
                try:
                    await self.forward(entries, asynchronous=True, queued=queued)
                finally:  # before the 202: a cancellation finds every first step queued
                    await self._record(entries, queued)
            except (Overloaded, Unavailable):
                # Not runnable as a whole: cancelled while no runner took its first steps.
                await self.cancel(entries.id, whole=False)
                raise
        return outcome

    async def _check_quota(self, quota: queue.ResultQuota) -> queue.Limited | None:
        """QUOTA on the key's slot: Limited('quota') while the key holds its quota, else None."""
        call = slots.quota_call(quota)
        try:
            wait_ms = int(await self._quota(*_args(call)))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        return queue.Limited("quota", wait_ms) if wait_ms else None

    async def _record(self, entries: Entries, queued: list[tuple[int, bytes]]) -> None:
        """The first steps of other slots that were queued, on the result's slot (`f`)."""
        if not queued:
            return
        rest = entries.rest
        steps = [slots.FirstStep(index, rest[index].stream, entry.decode()) for index, entry in queued]
        try:
            await self._note(entries.id, steps)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc

    async def _note(self, invocation_id: str, steps: Sequence[slots.FirstStep]) -> None:
        await self._redis.execute(
            "XADD", keys.result(invocation_id), "NOMKSTREAM", "*", "f", slots.record(steps)
        )

    async def cancel(self, invocation_id: str, whole: bool = True) -> str:
        """CANCEL across slots: 'gone', 'done', 'cancelled' or 'running', as on one Redis. A
        pipeline's first steps on other slots are looked at (one taken: 'running', nothing moves),
        then set aside (out of their streams: no runner can take them); CANCEL on the result's slot
        then cancels it while its own entry is not taken either. What was set aside is dropped
        once cancelled, else queued again (at the end of its stream) and recorded anew. `whole`:
        False for the submission's own cancellation, after a slot refused its steps. Raises
        Unavailable when Redis fails (what was set aside stays aside when CANCEL's answer is lost:
        a repeat of the cancellation cancels it, or puts it back once a step was taken)."""
        result = [keys.result(invocation_id)]
        group = keys.RUNNER_GROUP
        try:
            found = slots.parse_first_steps(
                await self._run(slots.FIRST_STEPS, result, [group, "0" if whole else "1"])
            )
            if isinstance(found, str):
                return found
            if not found.others:
                return "running" if found.taken else queue.cancel_outcome(await self._cancel(result, [group]))
            grouped, ttl_ms = slots.by_slot(found.others), found.ttl_ms
            if found.taken:  # too late; what a cancellation that stopped midway set aside goes back
                await self._put_back(invocation_id, grouped, quietly=True)
                return "running"
            if b"running" in await self._aside(grouped, False, ttl_ms):  # looked at first
                return "running"
            try:
                moved = await self._aside(grouped, True, ttl_ms)
            except BaseException:
                await self._put_back(invocation_id, grouped, quietly=True)
                raise
            if b"running" in moved:  # one was taken meanwhile
                await self._put_back(invocation_id, grouped)
                return "running"
            outcome = queue.cancel_outcome(await self._cancel(result, [group]))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        if outcome == "cancelled":
            with contextlib.suppress(RedisError, OSError):  # else they expire with the result
                await self._drop(grouped)
        else:
            await self._put_back(invocation_id, grouped)
        return outcome

    async def _aside(self, grouped: list[list[slots.FirstStep]], set_aside: bool, ttl_ms: int) -> list[Any]:
        """ASIDE on each slot at once: each slot's answer. Raises the first error, once all answered."""
        calls = [slots.aside_call(steps, keys.RUNNER_GROUP, set_aside, ttl_ms) for steps in grouped]
        return await delivery.all_answered(self._run(slots.ASIDE, *_args(call)) for call in calls)

    async def _put_back(
        self, invocation_id: str, grouped: list[list[slots.FirstStep]], quietly: bool = False
    ) -> None:
        """PUT_BACK what was set aside, on each slot at once, and record where each step is now."""
        try:
            calls = [slots.put_back_call(steps, True) for steps in grouped]
            answers = await delivery.all_answered(self._run(slots.PUT_BACK, *_args(call)) for call in calls)
            moved = [
                slots.FirstStep(step.index, step.stream, entry.decode())
                for steps, ids in zip(grouped, answers, strict=True)
                for step, entry in zip(steps, ids, strict=True)
                if entry
            ]
            if moved:
                await self._note(invocation_id, moved)
        except (RedisError, OSError) as exc:
            if not quietly:
                raise Unavailable(f"the queue is unavailable: {exc}") from exc

    async def _drop(self, grouped: list[list[slots.FirstStep]]) -> None:
        calls = [slots.put_back_call(steps, False) for steps in grouped]
        await delivery.all_answered(self._run(slots.PUT_BACK, *_args(call)) for call in calls)

    async def _claim_key(
        self, call: Call, invocation_id: str
    ) -> tuple[queue.Again | queue.Conflict | None, str]:
        """Claim the call's Idempotency-Key for `invocation_id`: (None, what it holds now), or the
        earlier invocation it holds whose result still exists (Again, or Conflict for another
        request). A key whose invocation's result is gone is free, as on one Redis."""
        later = call.later
        assert later is not None
        key = keys.idempotency(call.principal.key_id, later.idempotency_key)
        mine = f"{invocation_id} {later.request_digest}"
        seen = ""
        try:
            for _ in range(CLAIM_ATTEMPTS):
                claim = slots.claim_call(key, mine, submission.pending_ttl_ms(call), seen)
                found = await self._claim(*_args(claim))
                if not found:
                    return None, mine
                seen = found.decode()
                earlier, _, digest = seen.partition(" ")
                result = keys.result(earlier)  # pending, or done and stored beside it
                if await self._redis.execute("EXISTS", result, queue.stored_result(result)):
                    again = digest == later.request_digest
                    return (queue.Again(earlier) if again else queue.Conflict(earlier)), ""
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        raise Unavailable("the Idempotency-Key is being changed by other submissions; retry")

    async def _free(self, call: Call, held: str) -> None:
        """The Idempotency-Key of a submission that was refused, free again if it still holds it."""
        if not held or call.later is None:
            return
        key = keys.idempotency(call.principal.key_id, call.later.idempotency_key)
        # One that stays lapses with its TTL, and a repeat finds no result behind it: free.
        with contextlib.suppress(RedisError, OSError):
            await self._claim(*_args(slots.claim_call(key, "", 1, held)))


def _args(call: queue.ScriptCall) -> tuple[list[str], list[Any]]:
    return call.keys, list(call.args)
