"""The coordinator's requests on the node: take a slot, open the sealed body, stream sealed chunks
back, report usage; and the `cancel` that stops one.

A request that finds no free slot (`Slots.try_acquire`) is refused with 429 so the coordinator
places it elsewhere. A `cancel` from the coordinator (its client went away) stops the request, and
once the backend has stopped generating (waited for at most `cancel_grace` seconds) the node reports
the tokens used so far in one `inference_complete`, so the coordinator can settle the partial work.
That report is the only frame sent for the request after the cancel; every other frame for it is
dropped, including any already queued for the writer. Logs carry request ids and token counts,
never prompt or completion text. A served request logs two INFO lines (accepted, complete: what
operators and the end-to-end tests follow), each once the loop has run what was ready when it was
logged (``_log_after_this_turn``): the frame it follows has left by then, and the upstream call has
gone out; a refused, failed or cancelled one says so; nothing else per request is logged above DEBUG.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from darkbloom.wire import crypto
from darkbloom.wire import protocol
from darkbloom.wire.openai.legacy import completion_prompts
from darkbloom.wire.token_bounds import prompt_token_bound
from darkbloom.provider.backends import Backend, BackendError, open_stream
from darkbloom.provider.backends.base import UsageMeter, chunk_usage, is_usage_chunk, request_priority
from darkbloom.provider.config import ProviderConfig
from darkbloom.provider.outbox import Outbox
from darkbloom.provider.slots import Slots

log = logging.getLogger(__name__)


def _log_after_this_turn(message: str, *args: object) -> None:
    """An INFO line written after what the loop has ready now — the outbox's writer, woken by the frame
    just queued, among it — so that writing it does not hold the frame back."""
    asyncio.get_running_loop().call_soon(log.info, message, *args)


@dataclass(eq=False)
class Job:
    request_id: str
    outbox: Outbox = field(repr=False)  # the connection the request came on
    meter: UsageMeter = field(default_factory=UsageMeter, repr=False)  # the backend's counts so far
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    settling: asyncio.Task[None] | None = field(default=None, repr=False)  # after a cancel: the usage report
    cancelled: bool = False  # once set, nothing more is sent for this request but the usage report on cancel
    max_tokens: int | None = None  # what the coordinator asked for (× a batch's prompts): the most this node reports
    api: protocol.Api = "chat"
    body: dict[str, Any] | None = field(default=None, repr=False)  # for the prompt bound, once reported

    def report(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> protocol.Usage:
        """The usage to report: an upstream that ignored ``max_tokens``, or counted more prompt tokens
        than the body can hold, is not this node's lie to tell (the coordinator distrusts a node
        reporting more than it asked for, or than the prompt bound it computes from the same body).
        The cached tokens are some of the prompt tokens reported (the coordinator refuses more)."""
        if self.max_tokens is not None and completion_tokens > self.max_tokens:
            log.warning("request %s: the backend produced %d completion tokens for max_tokens %d; reporting %d",
                        self.request_id, completion_tokens, self.max_tokens, self.max_tokens)
            completion_tokens = self.max_tokens
        bound = self._prompt_bound()
        if bound is not None and prompt_tokens > bound:
            log.warning("request %s: the backend counted %d prompt tokens, more than the body's bound %d; "
                        "reporting %d", self.request_id, prompt_tokens, bound, bound)
            prompt_tokens = bound
        return protocol.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                              cached_tokens=min(max(cached_tokens, 0), prompt_tokens))

    def _prompt_bound(self) -> int | None:
        if self.body is None:
            return None
        try:
            return prompt_token_bound(self.api, self.body)
        except (KeyError, TypeError, ValueError):  # a body the backend refused anyway
            return None


class FleetRequests:
    cancel_grace = 5.0  # after a cancel, how long to wait for the backend to stop before reporting usage

    def __init__(self, config: ProviderConfig, backend: Backend, slots: Slots) -> None:
        self.config = config
        self.backend = backend
        self.slots = slots
        self.identity: crypto.NodeIdentity | None = None  # set by the node before it connects
        self.jobs: dict[str, Job] = {}

    def accept(self, frame: protocol.InferenceRequest, outbox: Outbox) -> None:
        request_id = frame.request_id
        if request_id in self.jobs:
            log.warning("request %s is already running; duplicate ignored", request_id)
            return
        if not self.slots.try_acquire():
            log.info("request %s refused: at max_concurrency %d", request_id, self.config.max_concurrency)
            outbox.send(protocol.InferenceError(
                request_id=request_id, status_code=429,
                message=f"this node is busy (max_concurrency {self.config.max_concurrency}); retry elsewhere"))
            return
        job = Job(request_id, outbox)
        self.jobs[request_id] = job
        job.task = asyncio.create_task(self._serve(job, frame), name=f"request-{request_id}")

    def cancel(self, request_id: str) -> None:
        job = self.jobs.get(request_id)
        if job is not None and job.task is not None and not job.cancelled:
            log.info("request %s cancelled by the coordinator", request_id)
            job.cancelled = True
            job.task.cancel()
            job.settling = asyncio.create_task(self._settle_cancelled(job), name=f"settle-{request_id}")

    async def cancel_all(self) -> None:
        """The connection is gone: stop every request, usage reports included (nowhere to send them)."""
        jobs = list(self.jobs.values())
        tasks = [task for job in jobs for task in (job.task, job.settling) if task is not None]
        for job in jobs:
            job.cancelled = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in jobs:  # a task cancelled before it ever ran did not free its slot
            self._free(job)

    async def _settle_cancelled(self, job: Job) -> None:
        """After the coordinator's cancel: let the request task end, wait (bounded) for the backend to
        stop generating, then report the tokens used so far. The job keeps its slot until then."""
        assert job.task is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cancel_grace
        try:
            await asyncio.wait({job.task}, timeout=self.cancel_grace)
            stopped = job.task.done() and await job.meter.stopped(max(0.0, deadline - loop.time()))
            if not stopped:
                log.warning("request %s: the backend did not stop within %.0f s; reporting the usage so far",
                            job.request_id, self.cancel_grace)
            usage = job.report(job.meter.prompt_tokens, job.meter.completion_tokens, job.meter.cached_tokens)
            # Queued without its job, so the writer sends it although the job is cancelled; dropped if
            # the connection the cancel came on is gone.
            job.outbox.send(protocol.InferenceComplete(request_id=job.request_id, usage=usage))
            log.info("request %s cancelled after %d prompt + %d completion tokens", job.request_id,
                     usage.prompt_tokens, usage.completion_tokens)
        finally:
            self._free(job)

    async def _serve(self, job: Job, frame: protocol.InferenceRequest) -> None:
        request_id = job.request_id
        try:
            body, sealer = self._open_request(frame)
            model_id = body.get("model")
            if model_id not in self.config.model_ids:
                raise BackendError(404, f"model {model_id!r} is not served by this node", param="model")
            job.outbox.send(protocol.InferenceAccepted(request_id=request_id), job)
            _log_after_this_turn("request %s accepted for %s (%s)", request_id, model_id, frame.api)
            max_tokens = body.get("max_tokens")
            job.api, job.body = frame.api, body
            job.max_tokens = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else None
            if job.max_tokens is not None and frame.api == "completions":  # max_tokens is each prompt's
                job.max_tokens *= len(completion_prompts(body))
            # an embeddings body has no max_tokens: nothing to hold the report to but the backend's count
            request_priority.set(frame.priority)  # this task's: the backend reads it as the stream opens
            relayed = await self._relay(job, sealer, open_stream(self.backend, frame.api, model_id, body, job.meter))
            usage = job.report(relayed.prompt_tokens, relayed.completion_tokens, relayed.cached_tokens)
            job.outbox.send(protocol.InferenceComplete(request_id=request_id, usage=usage), job)
            _log_after_this_turn("request %s complete: %d prompt + %d completion tokens", request_id,
                                 usage.prompt_tokens, usage.completion_tokens)
        except BackendError as exc:
            log.warning("request %s failed with status %d", request_id, exc.status_code)
            # inference_error is not sealed: backends put only sentences of their own in exc.message,
            # never prompt or completion text, nor an upstream's or a library's free-text error.
            job.outbox.send(protocol.InferenceError(
                request_id=request_id, status_code=exc.status_code, message=exc.message,
                param=exc.param if exc.param is None or len(exc.param) <= 128 else None,
                code=exc.code if exc.code in protocol.PROVIDER_ERROR_CODES else None), job)
        except asyncio.CancelledError:
            job.cancelled = True
            log.debug("request %s stopped", request_id)  # its cancel (or the lost connection) is logged already
            raise
        except Exception:
            log.exception("request %s failed", request_id)
            job.outbox.send(protocol.InferenceError(request_id=request_id, status_code=500,
                                                    message="the provider failed while serving this request"),
                            job)
        finally:
            if job.settling is None:  # else the settle frees the slot
                self._free(job)

    def _open_request(self, frame: protocol.InferenceRequest) -> tuple[dict[str, Any], crypto.Sealer]:
        """The plaintext OpenAI body, and a sealer to the request's ephemeral key for every reply chunk."""
        assert self.identity is not None
        try:
            sealer = crypto.Sealer.between(self.identity.encryption_key, frame.encrypted_body.ephemeral_public_key)
            plaintext = sealer.open(frame.encrypted_body)
        except crypto.DecryptionError:
            raise BackendError(400, "the request body does not open with this node's key") from None
        try:
            body = json.loads(plaintext)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise BackendError(400, "the request body must be a JSON object")
        return body, sealer

    async def _relay(self, job: Job, sealer: crypto.Sealer,
                     stream: AsyncIterator[dict[str, Any]]) -> protocol.Usage:
        """Send every content chunk (the outbox seals them); return the usage from the final chunk."""
        usage: protocol.Usage | None = None
        try:
            async for chunk in stream:
                if is_usage_chunk(chunk):
                    usage = chunk_usage(chunk)
                    continue
                job.outbox.send_chunk(job, sealer, chunk)  # sealed by the writer, maybe with its neighbours
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()  # stops generation when we leave early (cancel, error)
        if usage is None:
            raise BackendError(502, "the backend finished without reporting token usage")
        return usage

    def _free(self, job: Job) -> None:
        """The job is over: forget it and hand its slot back (once, however many paths get here)."""
        if self.jobs.get(job.request_id) is job:
            del self.jobs[job.request_id]
            self.slots.release()
