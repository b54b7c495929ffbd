"""The runtime controller: drives the sans-IO orchestrator with real engines and a real trainer.

Lives outside the package table of DESIGN section 5 on purpose: ``launch/`` starts
processes, ``rollout/`` talks to one engine, ``orchestrator/`` decides; this package
is the asyncio loop that turns decisions into HTTP calls and events back into the
orchestrator.
"""
