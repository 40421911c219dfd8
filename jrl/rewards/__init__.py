"""jrl.rewards: reward functions and the scorer that combines them."""

from jrl.rewards.base import REGISTRY, RewardScorer, ScoredBatch, get_reward_fn, register
from jrl.rewards.math import exact_match, extract_answer, math_answer
