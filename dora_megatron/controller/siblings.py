"""Group siblings as speculative drafts (``rollout.speculative: group``).

WHY: the responses of one group answer the same prompt with the same weights, so a finished
sibling's tokens are good drafts for the ones still running, which are the group's long tail. A
request gets the siblings finished when it is submitted (``dora_draft_sources`` of its
``/generate``), and each sibling that finishes later is pushed to the running ones
(``/dora/draft_sources``). Drafts only speed decoding up: a lost push changes no token, so pushes
are best effort and their failures are logged, never raised.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

from dora_megatron.controller.records import Engine, SampleRecord

log = logging.getLogger(__name__)


def finished_sources(rec: SampleRecord, siblings: Iterable[SampleRecord | None]) -> list[list[int]]:
    """Prompt + output of the finished ones among ``rec``'s ``siblings`` (``rec`` itself skipped)."""
    return [rec.prompt_ids + s.output_ids for s in siblings if s is not None and s is not rec and s.finished]


def running_targets(rec: SampleRecord, siblings: Iterable[SampleRecord | None]) -> list[tuple[str, str]]:
    """``(instance, sample_id)`` of the siblings of ``rec`` still generating somewhere."""
    return [(s.gen_instance, s.sample_id) for s in siblings
            if s is not None and s is not rec and not s.finished and s.gen_instance is not None]


async def push_source(engines: Mapping[str, Engine], targets: list[tuple[str, str]], source: list[int]) -> int:
    """Send ``source`` to each running sibling; returns how many engines took it."""
    taken = 0
    for instance, sample_id in targets:
        engine = engines.get(instance)
        if engine is None:
            continue
        try:
            taken += bool(await engine.add_draft_sources(sample_id, [source]))
        except Exception as err:  # noqa: BLE001 - a lost draft costs speed only
            log.debug("draft push of a sibling to %s on %s failed: %s", sample_id, instance, err)
    return taken
