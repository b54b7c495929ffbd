"""Discrete-event simulator that drives the production orchestrator on a virtual clock.

Modules: :mod:`.cost` (analytic instance cost model), :mod:`.workload` (deterministic lengths),
:mod:`.instance` (continuous batching advanced in jumps), :mod:`.events` (heap queue),
:mod:`.engine` (the loop: actions -> timed effects -> orchestrator events), :mod:`.summary`
(the DESIGN section 11 summary as a pure function, shared with the real runtime),
:mod:`.plots` (PNG output; imports matplotlib lazily). Entry point: ``dora simulate``.
"""
