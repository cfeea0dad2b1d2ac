"""Batches across requests: every request's sentences join one queue, and one decoding thread takes batches from it.

A batch waits for more sentences only while it is short of `max_batch_tokens` and has waited less than `max_wait_ms`,
counted from its first sentence's arrival, or from the end of the last batch if that is later, until as many sentences
have arrived since as that batch answered (the clients it answered send their next ones meanwhile); while the thread
decodes, the next batch gathers by itself (`wait_left`). A batch always holds the sentence that has waited longest
(so none waits for ever), with the queued sentences of the same decoding options closest to it in length, as long as
the batch stays within `MAX_PADDING` padded tokens per real one (`pick_batch`), sorted by length as `translate` sorts.
The decoder runs in its own thread, so the event loop keeps taking requests while it decodes; a batch that fails is
decoded again one sentence at a time, so that only the requests whose sentences fail alone fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hf_deep_nmt.serving.decoder import Decoder
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.serving.server.limits import RequestError, ServerLimits
from hf_deep_nmt.serving.server.metrics import Metrics

# The most padded source tokens a batch may hold per real token: a batch decodes until its longest sentence is done,
# and pads every other to it, so a sentence far longer or shorter than the rest costs more than its own work. Measured
# on the trained sample model at concurrency 32 and 128, 1.3 brings the padding near what `translate`'s
# length-sorted batches carry (1.17 per real token) without splitting batches so small that each step's fixed cost
# dominates.
MAX_PADDING = 1.3
# Tokens of work every sentence costs beyond its source tokens (the first steps of its translation, its end), counted
# with the real ones: a batch of very short sentences is not split for a padding that costs little.
SENTENCE_TOKENS = 4


def wait_left(
    queued: int, queued_tokens: int, oldest: float, now: float, limits: ServerLimits, *, freed=0.0, answered=0, back=0
) -> float:
    """Seconds the next batch still waits for more sentences (<= 0: take it now), of `queued` sentences and
    `queued_tokens` source tokens whose first arrived at `oldest`. A full batch goes at once; else the wait counts from
    the first sentence's arrival, or from the end of the last batch (`freed`) if that is later, while fewer sentences
    came `back` since then than that batch `answered`: in a closed loop (clients that send their next request once
    answered) they come back within milliseconds and make the next batch larger, and once they have, waiting longer
    only leaves the decoder idle."""
    if queued >= limits.max_batch_sentences or queued_tokens >= limits.max_batch_tokens:
        return 0.0
    started = oldest if back >= answered else max(oldest, freed)
    return started + limits.max_wait_ms / 1000 - now


def pick_batch(lengths: list[int], budget: int, most: int) -> list[int]:
    """Indices of `lengths` for one batch: the first (the sentence that has waited longest) and its neighbours in
    length, at most `most` sentences and `budget` padded tokens (sentences x longest; the first alone may pass it),
    and at most `MAX_PADDING` padded tokens per real one (`SENTENCE_TOKENS` more a sentence); each step takes the
    neighbour that adds the fewest padding tokens. A sentence left out waits for a batch of its own length (the
    queue keeps filling meanwhile)."""
    order = sorted(range(len(lengths)), key=lambda index: (lengths[index], index))
    low = high = order.index(0)
    longest = real = lengths[0]
    while high - low + 1 < most:
        count = high - low + 1
        steps = []  # (padding tokens added, side, length)
        if low > 0 and (count + 1) * longest <= budget:
            steps.append((longest - lengths[order[low - 1]], -1, lengths[order[low - 1]]))
        if high + 1 < len(order) and (count + 1) * lengths[order[high + 1]] <= budget:
            steps.append((count * (lengths[order[high + 1]] - longest), 1, lengths[order[high + 1]]))
        if not steps:
            break
        _, side, length = min(steps)
        if (count + 1) * max(longest, length) > MAX_PADDING * (real + length + (count + 1) * SENTENCE_TOKENS):
            break
        real += length
        if side < 0:
            low -= 1
        else:
            high += 1
            longest = length
    return order[low : high + 1]


@dataclass(eq=False)
class _Sentence:
    ids: list[int]
    options: DecodingOptions
    future: asyncio.Future
    arrived: float  # the event loop's clock


class Batcher:
    """The queue and the decoding thread of one server. `start` decodes a warm-up batch then takes batches until
    `stop`; `submit` queues the sentences of one request (`RequestError` 503 with Retry-After when the queue is full)
    and returns a future for each."""

    def __init__(self, decoder: Decoder, tokenizer, limits: ServerLimits, metrics: Metrics):
        self.decoder, self.tokenizer, self.limits, self.metrics = decoder, tokenizer, limits, metrics
        self.pending: list[_Sentence] = []
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-deep-nmt-decoder")
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.seconds_per_sentence = 0.0  # a running average, for Retry-After
        self.freed = 0.0  # when the decoding thread last finished a batch (the event loop's clock)
        self.answered = 0  # the sentences that batch answered

    async def warm_up(self, ids: list[int], options: DecodingOptions) -> str:
        """Decode one sentence (ids) in the decoding thread: the first batch pays for what is built lazily."""
        loop = asyncio.get_running_loop()
        return (await loop.run_in_executor(self.executor, self._translate, [ids], options, False))[0]

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="hf-deep-nmt-batcher")

    async def stop(self) -> None:
        """Stop taking batches (the server has answered every request it accepted by now) and end the thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sentence in self.pending:
            sentence.future.cancel()
        self.pending.clear()
        await asyncio.get_running_loop().run_in_executor(None, self.executor.shutdown)

    def fail_pending(self, error: BaseException) -> None:
        """Answer every queued sentence with `error` (the warm-up failed: no batch will be decoded)."""
        for sentence in self.pending:
            if not sentence.future.done():
                sentence.future.set_exception(error)
        self.pending.clear()
        self.metrics.queued.set(0)

    def submit(self, sources: list[list[int]], options: DecodingOptions) -> list[asyncio.Future]:
        self.pending = [sentence for sentence in self.pending if not sentence.future.done()]
        if len(self.pending) + len(sources) > self.limits.max_queue:
            wait = max(1, round(len(self.pending) * self.seconds_per_sentence))
            raise RequestError(
                503,
                "queue_full",
                f"The queue is full ({len(self.pending)} sentences wait, --max-queue {self.limits.max_queue}); try "
                f"again in {wait} s.",
                {"Retry-After": str(wait)},
            )
        loop = asyncio.get_running_loop()
        now = loop.time()
        queued = [_Sentence(ids, options, loop.create_future(), now) for ids in sources]
        self.pending.extend(queued)
        self.metrics.queued.set(len(self.pending))
        if self._wakeup is not None:
            self._wakeup.set()
        return [sentence.future for sentence in queued]

    async def _run(self) -> None:
        while True:
            await self._gather()
            batch = self._take()
            if batch:
                await self._decode(batch)

    async def _gather(self) -> None:
        """Until a batch is worth taking: a sentence is queued, and either its batch is full or its wait is over
        (`wait_left`)."""
        loop = asyncio.get_running_loop()
        while True:
            self.pending = [sentence for sentence in self.pending if not sentence.future.done()]
            if self.pending:
                queued_tokens = sum(len(sentence.ids) for sentence in self.pending)
                back = sum(sentence.arrived >= self.freed for sentence in self.pending)
                count, oldest, now = len(self.pending), self.pending[0].arrived, loop.time()
                last = dict(freed=self.freed, answered=self.answered, back=back)
                left = wait_left(count, queued_tokens, oldest, now, self.limits, **last)
                if left <= 0:
                    return
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), left if self.pending else None)

    def _take(self) -> list[_Sentence]:
        """The next batch, out of the queue (`pick_batch` among the sentences of the first one's options)."""
        options = self.pending[0].options
        alike = [sentence for sentence in self.pending if sentence.options == options]
        chosen = pick_batch(
            [len(sentence.ids) for sentence in alike], self.limits.max_batch_tokens, self.limits.max_batch_sentences
        )
        batch = [alike[index] for index in chosen]
        taken = set(map(id, batch))
        self.pending = [sentence for sentence in self.pending if id(sentence) not in taken]
        self.metrics.queued.set(len(self.pending))
        now = asyncio.get_running_loop().time()
        for sentence in batch:
            self.metrics.queue_wait.observe(now - sentence.arrived)
        return sorted(batch, key=lambda sentence: len(sentence.ids))

    async def _decode(self, batch: list[_Sentence]) -> None:
        loop = asyncio.get_running_loop()
        try:
            texts = await loop.run_in_executor(
                self.executor, self._translate, [sentence.ids for sentence in batch], batch[0].options
            )
        except Exception as error:
            self.freed = loop.time()
            if len(batch) > 1:  # alone, each sentence fails only its own request
                for sentence in batch:
                    await self._decode([sentence])
            elif not batch[0].future.done():
                batch[0].future.set_exception(error)
            return
        self.freed, self.answered = loop.time(), len(batch)
        for sentence, text in zip(batch, texts):
            if not sentence.future.done():  # a request past its deadline no longer waits
                sentence.future.set_result(text)

    def _translate(self, sources: list[list[int]], options: DecodingOptions, counted: bool = True) -> list[str]:
        """One batch, in the decoding thread: the decoder's memory check, its translations, the batch's metrics
        (unless not `counted`: the warm-up)."""
        started = time.perf_counter()
        longest = max(map(len, sources))
        self.decoder.check_fits([(len(sources), longest)], options)
        texts = self.decoder.translate_batch(self.tokenizer, sources, options)
        seconds = time.perf_counter() - started
        if not counted:
            return texts
        self.seconds_per_sentence = 0.9 * self.seconds_per_sentence + 0.1 * seconds / len(sources)
        metrics = self.metrics
        metrics.batch_seconds.observe(seconds)
        metrics.batch_sentences.observe(len(sources))
        metrics.batch_tokens.observe(len(sources) * longest)
        metrics.sentences.inc(len(sources))
        metrics.source_tokens.inc(sum(map(len, sources)))
        metrics.target_tokens.inc(sum(len(ids) for ids in self.tokenizer(texts)["input_ids"]) if texts else 0)
        return texts
