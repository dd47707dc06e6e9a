"""`disconnects.unless_client_gone`, the wrapper every generation route runs its choices in."""

from __future__ import annotations

import asyncio
import gc
import logging

from gyre_inference.disconnects import unless_client_gone


def test_a_cancelled_request_leaves_no_unretrieved_exception_behind(caplog):
    """The route's task cancelled (uvicorn's shutdown deadline): the choices are cancelled with it, and nothing is
    left for asyncio to log. The gather of the choices ended with CancelledError as its exception, which nobody read:
    "_GatheringFuture exception was never retrieved" and a traceback per request."""

    async def scenario():
        async def choice():
            await asyncio.sleep(60)

        async def client_stays():
            await asyncio.sleep(60)

        choices = [asyncio.ensure_future(choice()) for _ in range(2)]
        request = asyncio.create_task(unless_client_gone(asyncio.gather(*choices), client_stays))
        await asyncio.sleep(0.05)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        await asyncio.sleep(0)  # the done callbacks
        assert all(c.cancelled() for c in choices)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()  # asyncio logs an unretrieved exception when the future is collected
    assert "never retrieved" not in caplog.text
