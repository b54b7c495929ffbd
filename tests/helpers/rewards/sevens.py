"""A reward a tiny model learns within a few RL steps (a verl ``compute_score`` file): the share of
the answer's characters that are ``7``. Why: a test that the whole RL loop trains (rollouts, reward,
the trainer's update, the weights reaching the engine) needs a reward that moves in tens of steps,
not the hundreds the main job's task needs. Each argument is checked as the row hands it (a
``data_source`` string, the row's non-empty ground truth, its ``extra_info`` mapping): one dropped
or mangled on the way raises, and the job counts it in ``reward_errors``."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not isinstance(data_source, str):
        raise TypeError(f"data_source must be the row's string, got {type(data_source).__name__}")
    if not isinstance(ground_truth, str) or not ground_truth:
        raise ValueError(f"ground_truth must be the row's answer, got {ground_truth!r}")
    if not isinstance(extra_info, dict):
        raise TypeError(f"extra_info must be the row's mapping, got {type(extra_info).__name__}")
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be the decoded answer, got {type(solution_str).__name__}")
    return sum(c == "7" for c in solution_str) / max(1, len(solution_str))
