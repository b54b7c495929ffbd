"""How one process reads big ``/generate`` answers: its receive budget and its decoder thread, held
together.

WHY one object: the two bound the same thing, an answer from its first byte read to the end of its
decode (the budget's bytes are given back only once the decoder is done with them), and every
client of a process shares both. Passed as one, a client cannot be handed one without the other,
and the decoder thread has one owner, who closes it (:meth:`AnswerReader.close`) once its clients
are closed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from dora_megatron.comm.generate_codec import BIG_ANSWER_BYTES, decode_generate
from dora_megatron.comm.protocol import GenerateResponse
from dora_megatron.comm.receive_budget import RECEIVE_BUDGET_BYTES, ReceiveBudget


class AnswerReader:
    """A process's :class:`~dora_megatron.comm.receive_budget.ReceiveBudget` of ``max_bytes`` and
    its one decoder thread (``decode-answers``). Used on one event loop; made by whoever owns the
    process's clients, which closes it after them.

    WHY one decoder thread: the decode holds the GIL (orjson, array conversion, base64), so more
    threads add no throughput, only more threads the event loop waits behind to retake the GIL
    after every socket call (:func:`~dora_megatron.comm.generate_codec.decode_generate`)."""

    def __init__(self, max_bytes: int = RECEIVE_BUDGET_BYTES) -> None:
        self.budget = ReceiveBudget(max_bytes)
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-answers")

    @staticmethod
    def budgeted(size: int) -> bool:
        """Whether an answer of ``size`` bytes (its Content-Length) is read under the budget: one of
        at most :data:`~dora_megatron.comm.generate_codec.BIG_ANSWER_BYTES` is decoded on the loop
        and never waits."""
        return size > BIG_ANSWER_BYTES

    async def acquire(self, size: int) -> int:
        """Wait until an answer of ``size`` bytes may be read; returns the bytes granted, to be
        handed back to :meth:`release` once it is decoded (0 for one not :meth:`budgeted`). A
        cancelled wait takes nothing."""
        if not self.budgeted(size):
            return 0
        return await self.budget.acquire(size)

    def release(self, n: int) -> None:
        """Give back ``n`` bytes granted by :meth:`acquire` (0: nothing was held)."""
        if n:
            self.budget.release(n)

    async def decode(self, body: bytes | list[bytes]) -> GenerateResponse:
        """A ``/generate`` answer's bytes (or the pieces it arrived in) -> :class:`GenerateResponse`:
        a big one joined and decoded on this reader's thread, a small one on the loop."""
        return await decode_generate(body, self._decoder)

    def close(self) -> None:
        """Stop the decoder thread once it is idle; call after the clients using it are closed (a
        decode still queued then runs, none can be added)."""
        self._decoder.shutdown(wait=False)
