"""A reward a tiny model learns within a few RL steps (a verl ``compute_score`` file): the share of
the answer's characters that are ``7``. Why: a test that the whole RL loop trains (rollouts, reward,
the trainer's update, the weights reaching the engine) needs a reward that moves in tens of steps,
not the hundreds the main job's task needs; its arguments are read as a user's reward reads them."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be the decoded answer, got {type(solution_str).__name__}")
    return sum(c == "7" for c in solution_str) / max(1, len(solution_str))
