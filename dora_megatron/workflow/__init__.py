"""Rollout workflows: how one trajectory of a group is generated (single turn, or many turns with tools).

See :mod:`.api` for the interface a user's ``rollout.workflow`` function implements.
"""
