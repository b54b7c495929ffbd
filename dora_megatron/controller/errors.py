"""How the controller classifies a failed call: the controller's own shortage, or the instance's fault.

WHY shared: the executor, the weight sync, the migrations and the stats poller all decide the
same way whether a failed call fails the instance (:func:`is_comm_error`) or is only retried
(:func:`is_local`); one definition keeps them agreeing.
"""

from __future__ import annotations

import asyncio

#: back-off between tries of a call that failed for want of a local resource (seconds, doubling)
LOCAL_RETRY_S = (0.05, 1.0)


def is_local(err: BaseException) -> bool:
    """A shortage of the controller's own process (no descriptor, no buffer, no pooled connection
    in time: :func:`~dora_megatron.comm.limits.local_resource_error`): never an instance's fault."""
    from dora_megatron.comm.limits import local_resource_error

    return local_resource_error(err)


def is_comm_error(err: BaseException) -> bool:
    """Errors that mean "this engine cannot be reached or refused to work": the instance is failed."""
    from dora_megatron.comm.engine_client import EngineError, ExtensionUnsupported

    if isinstance(err, (EngineError, ExtensionUnsupported, OSError, asyncio.TimeoutError, ConnectionError)):
        return True
    return type(err).__module__.split(".")[0] == "aiohttp"
