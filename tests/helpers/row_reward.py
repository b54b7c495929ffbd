"""A verl-style reward that reads every argument a dataset row hands it (the own-model job test's).

The example reward (``examples/own_model/reward.py``) ignores ``data_source`` and ``extra_info``, so a
job that dropped them would pass with it. This one scores -1 when the row's ``data_source`` or
``extra_info["index"]`` is missing, and otherwise adds a part that depends on the row's index to the
ground-truth check, so a reward handed another row's arguments scores differently from the row the
prompt came from.
"""

from dora_megatron.models.example import DATA_SOURCE


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != DATA_SOURCE or "index" not in (extra_info or {}):
        return -1.0
    index = int(extra_info["index"])
    return {"score": (0.5 if str(ground_truth) in solution_str else 0.0) + 0.01 * (index % 10),
            "row_index": float(index)}
