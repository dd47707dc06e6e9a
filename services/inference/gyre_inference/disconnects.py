"""A request's generation stops when nobody is left to read it: the client's disconnect cancels a non-streaming
request's choices (`unless_client_gone`), and one failing choice cancels its siblings (`all_or_none`), instead of
sequences generating for nobody while they hold batch rows. Used by the routes (api.py, and tokens_in.py's
`/inference/v1/generate`) and by the chat / completions engine (serving.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import Request


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


def client_gone(request: Request):
    """async () -> None that returns once the client of `request` has disconnected. Once the route has read
    the body, the server's `receive()` blocks until the connection closes and then says `http.disconnect`
    (vLLM's listen_for_disconnect): one waiting task per request instead of polling the connection."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


async def unless_client_gone(work: Awaitable, client_gone):
    """The result of `work`, unless the client goes away first: then `work` is cancelled (its sequences leave the
    batch at the next step, instead of generating for nobody) and ClientGone is raised. `client_gone`: async () ->
    None that returns when the client disconnects (nothing polls: at 256 requests in flight, polling each one's
    connection cost a fifth of the event loop), or None."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone()) if client_gone is not None else None
    try:
        await asyncio.wait({work} if gone is None else {work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and gone.exception() is not None:  # cannot tell: the request runs to its end
            await work
    except BaseException:
        work.cancel()
        # a cancelled gather() ends with CancelledError as its exception, which asyncio logs ("_GatheringFuture
        # exception was never retrieved", with a traceback) unless someone reads it
        work.add_done_callback(_read_outcome)
        raise
    finally:
        if gone is not None:
            gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientGone


async def all_or_none(*aws: Awaitable) -> list:
    """The results of `aws` run together (a request's choices), in order; when one fails, the others are cancelled
    before its error is raised. asyncio.gather leaves them running: the other choices of a request that had already
    answered its error kept generating for nobody."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # each closes its backend stream, which aborts its sequence
        raise


def _read_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
