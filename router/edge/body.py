"""Reading a request's body, bounded: how many clients may be part-way through sending one, how
large it may be (before and after decompression), and what a broken one answers.

The body is read before the request is admitted (counted against ``max_in_flight``): a client
that sends its body slowly holds no in-flight slot.  Bodies still arriving are bounded separately,
in number (``max_body_reads``) and in the memory they may come to (``max_body_read_bytes``: each
reserves its Content-Length, or ``max_body_bytes`` when chunked or compressed, until it is read);
each is cut at the server's body timeout.  A body that arrived whole with its head, as nearly
every API request does, needs no reservation at all, so clients stalling part-way through their
bodies cannot keep well-behaved ones from being served.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from kvroute.common.errors import ApiError

from kvroute.router.edge.server import close_after_answer


class BodyReader:
    def __init__(self, max_body_bytes: int, max_partial: int, max_partial_bytes: int, retry_after_s: int):
        self.max_body_bytes = max_body_bytes
        self.max_partial = max_partial
        self.max_partial_bytes = max_partial_bytes
        self.retry_after_s = retry_after_s
        self.partial = 0  # bodies being received right now
        self.reserved = 0  # the bytes they may come to

    async def read(self, request: web.Request) -> bytes:
        """The whole body (decompressed), or an ApiError / 413 the error middleware renders."""
        length = request.content_length
        if length is not None and length > self.max_body_bytes:  # refused before reading a byte
            close_after_answer(request)
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=length)
        if request.content.is_eof():  # arrived with the head: nothing to wait for
            return await self._read(request)
        # what this body may come to in memory (decompressed, a compressed one may reach the limit)
        size = length if length is not None and not request.headers.get("Content-Encoding") else self.max_body_bytes
        if self.partial >= self.max_partial or self.reserved + size > self.max_partial_bytes:
            close_after_answer(request)
            raise ApiError(
                503,
                f"the router is receiving {self.partial} request bodies ({self.reserved} bytes), its limit; "
                "retry shortly",
                code="server_busy",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.partial += 1
        self.reserved += size
        try:
            return await self._read(request)
        finally:
            self.partial -= 1
            self.reserved -= size

    @staticmethod
    async def _read(request: web.Request) -> bytes:
        try:
            return await request.read()  # aiohttp enforces client_max_size on the decompressed bytes
        except RequestPayloadError as exc:  # corrupt gzip/deflate, a broken chunked encoding
            cause = exc.__cause__ or exc
            detail = (getattr(cause, "message", "") or str(cause)).strip().splitlines() or ["malformed"]
            raise ApiError(400, f"request body could not be read: {detail[0][:200]}", code="invalid_request_body") from None
