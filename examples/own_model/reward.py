"""A reward function in verl's layout, for the example data of ``tools/make_example_model.py``.

dora calls it as verl does: ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)``, in worker processes (``data.reward_workers``), each call limited to
``data.reward_timeout_s``. ``solution_str`` is the response decoded with special tokens skipped;
``ground_truth``, ``data_source`` and ``extra_info`` are the dataset row's. Return a number, or a
dict with ``score`` (what trains) and extra numbers (logged as ``reward/<key>``; strings such as
``pred`` are left out of the logs).
"""

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answers = _BOXED.findall(solution_str)
    pred = answers[-1].strip() if answers else None
    correct = pred == str(ground_truth).strip()
    # a little credit for the right number anywhere, so a tiny model from random weights sees signal
    near = not correct and str(ground_truth) in solution_str
    return {"score": 1.0 if correct else (0.1 if near else 0.0), "acc": float(correct),
            "boxed": float(pred is not None), "pred": pred or ""}
