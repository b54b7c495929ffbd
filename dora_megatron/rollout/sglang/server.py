"""Start SGLang instances as child processes, capture their logs, wait until they serve.

WHY here and not in the launcher: the local launcher and every SLURM node start instances the same
way: the argv from :mod:`.args`, a log file per instance under the run's ``logs/`` (via
:class:`~dora_megatron.processes.ProcessSet`, so stopping the job stops the server's own
children too), then a health poll (:func:`dora_megatron.rollout.health.wait_ready`; SGLang's ``/health_generate`` runs a one-token
generation in SGLang 0.5.x) that fails fast, with the log tail, when the process exits. Once the
instances serve, :func:`check_versions` warns about any that is not the tested SGLang release.
"""

from __future__ import annotations

import asyncio
import logging

from dora_megatron.processes import Child, ProcessSet, ProcessSpec
from dora_megatron.rollout.health import InstanceNotReady, wait_ready  # noqa: F401 (part of this module's API)


def start_instance(procs: ProcessSet, spec: ProcessSpec, engine: str) -> Child:
    """Start one planned rollout process (``spec.role == "engine"``, ``engine`` as ``rollout.engine``
    names it); its output goes to ``<log_dir>/<name>.log``. An SGLang server of a job also gets the
    job's keys as ``--api-key``/``--admin-api-key`` from a 0600 file (``--config``: never on the command
    line), and since 0.5.23 logs its resolved arguments, keys included, its log shows the secret as
    ``<redacted>``. The embedded engine and vLLM read the secret from the environment."""
    from dora_megatron.comm.auth import secret_from_env, sglang_config_args

    env = {**spec.env, "PYTHONUNBUFFERED": "1"}
    if engine != "sglang":
        return procs.start(spec.name, spec.argv, env, cpus=spec.cpus)
    return procs.start(spec.name, [*spec.argv, *sglang_config_args()], env, cpus=spec.cpus,
                       redact=(secret_from_env() or "",))


log = logging.getLogger(__name__)


def version_warning(url: str, found: str | None) -> str | None:
    """The warning for an instance running another SGLang than the tested one (None: the tested one).

    WHY a warning and not an error: a newer release may well work, but the weight-update protocol
    has changed inside 0.5.x before (sessions since 0.5.22), so the user must know which one was tested."""
    from dora_megatron.comm.sglang_client import TESTED_SGLANG_VERSION

    if found == TESTED_SGLANG_VERSION:
        return None
    return (f"{url} runs SGLang {found or '(version unknown: no /v1/loads version)'}; dora is tested with SGLang "
            f"{TESTED_SGLANG_VERSION} only (pip install 'dora_megatron[gpu]' pins it): weight updates, aborts and "
            "load polling may behave differently")


async def check_versions(urls: list[str], timeout_s: float = 30.0) -> list[str]:
    """Ask every ready instance its SGLang version (``/v1/loads`` reports it); returns the warnings
    (also logged) for those that are not the tested release."""
    from dora_megatron.comm.sglang_client import SGLangClient

    async def one(url: str) -> str | None:
        client = SGLangClient(url, timeout_s=timeout_s)
        try:
            found = await client.server_version()
        except Exception as exc:  # noqa: BLE001 - an unreadable version is reported, not fatal
            log.debug("%s: no version: %s", url, exc)
            found = None
        finally:
            await client.close()
        return version_warning(url, found)

    warnings = [w for w in await asyncio.gather(*(one(u) for u in urls)) if w]
    for w in warnings:
        log.warning("%s", w)
    return warnings
