"""jrl.rewards: reward functions, the registry, and the service that runs them."""

from jrl.rewards.base import REGISTRY, ScoredBatch, get_reward_fn, register
from jrl.rewards.math import exact_match, extract_answer, math_answer
from jrl.rewards.service import RewardService
