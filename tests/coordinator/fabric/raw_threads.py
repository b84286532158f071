"""A hand-driven provider socket on its own thread, for the replica tests: it registers with a
replica, records every request and cancel it gets, and answers at once (``answer``) or when the
test says (``chunk``, ``complete``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx

from darkbloom.wire.protocol import Cancel, Heartbeat, InferenceRequest, dump
from tests.support.accounts import Account
from tests.support.processes import Coordinator
from tests.support.raw_provider import RawProvider


def device_token(coord: Coordinator, account: Account) -> str:
    """What `darkbloom login` does, over HTTP: a `dkp-` device token (one new linked machine)."""
    code = httpx.post(coord.api_url + "/device/code").json()
    approved = httpx.post(coord.api_url + "/device/approve", json={"user_code": code["user_code"]},
                          headers={"Authorization": f"Bearer {account.session}"})
    assert approved.status_code == 200, approved.text
    token = httpx.post(coord.api_url + "/device/token", json={"device_code": code["device_code"]}).json()
    assert token["status"] == "authorized", token
    return str(token["token"])


class Raw:
    def __init__(self, coord: Coordinator, owner: Account | None, *, answer: str | None = "served",
                 **options: Any) -> None:
        token = device_token(coord, owner) if owner is not None else None
        self.provider = RawProvider(coord.base_url, token, **options)
        self.answer = answer
        self.requests: dict[str, InferenceRequest] = {}
        self.cancels: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "raw provider did not register"
        assert self.provider.provider_id is not None

    @property
    def session_id(self) -> str:
        assert self.provider.provider_id is not None
        return self.provider.provider_id

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._main())
        try:
            self._loop.run_until_complete(self._task)
        except BaseException:  # noqa: BLE001 - cancelled at close
            pass

    async def _main(self) -> None:
        await self.provider.register()
        self._ready.set()
        beats = asyncio.ensure_future(self._heartbeats())
        try:
            while True:
                frame = await self.provider.recv()
                if isinstance(frame, InferenceRequest):
                    self.requests[frame.request_id] = frame
                    if self.answer is not None:
                        await self.provider.answer(frame, self.answer)
                elif isinstance(frame, Cancel):
                    self.cancels.append(frame.request_id)
        except Exception:  # noqa: BLE001 - the socket closed
            pass
        finally:
            beats.cancel()

    async def _heartbeats(self) -> None:
        assert self.provider.ws is not None
        while True:
            await asyncio.sleep(2)
            await self.provider.ws.send(dump(Heartbeat(models=list(self.provider.models))))

    def _call(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(10)

    def chunk(self, request_id: str, text: str) -> None:
        self._call(self.provider.send_chunk(self.requests[request_id], text))

    def complete(self, request_id: str, prompt_tokens: int = 3, completion_tokens: int = 2) -> None:
        self._call(self.provider.send_complete(self.requests[request_id], prompt_tokens, completion_tokens))

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            await self.provider.close()
            if self._task is not None:
                self._task.cancel()

        asyncio.run_coroutine_threadsafe(shut(), self._loop)
        self._thread.join(10)
