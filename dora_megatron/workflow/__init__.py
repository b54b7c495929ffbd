"""Rollout workflows: how one trajectory of a group is generated (single turn, or many turns with tools).

:mod:`.api` is the interface a user's ``rollout.workflow`` function implements; :mod:`.runner` runs
one for a sample, pinned to the sample's weight version; :mod:`.single_turn` is the default;
:mod:`.tool_calling` and :mod:`.tools` are the Qwen3-style tool-using workflow and its example tools.
"""
