"""The reward of the tool-use example (``configs/cpu_tool_use.yaml``), in verl's layout.

``solution_str`` is the model's own tokens of the trajectory (the tool's results are left out by
the workflow), so the product counts only when the model wrote it into ``\\boxed{}`` itself:
copying it from the calculator's answer is the skill. ``called`` is logged beside the score
(``reward/called``): whether the model wrote a tool call at all.
"""

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answers = _BOXED.findall(solution_str)
    pred = answers[-1].strip() if answers else None
    correct = pred == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "called": float("<tool_call>" in solution_str),
            "boxed": float(pred is not None)}
