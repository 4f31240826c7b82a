"""A reward function file for `worker.reward.reward_function=examples/reward_length_penalty.py:reward`.

The answer is the last word of the response; a right answer scores 1, and every response token costs 0.001.
"""


def reward(samples: list[dict]) -> list[dict[str, float]]:
    scores = []
    for sample in samples:
        words = sample["response"].split()
        accuracy = float(bool(words) and words[-1].strip(".") == sample["ground_truth"].strip())
        length_cost = 0.001 * sample["response_length"]
        scores.append({"overall": accuracy - length_cost, "accuracy": accuracy, "length_cost": length_cost})
    return scores
