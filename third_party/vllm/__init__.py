"""vLLM as a rollout engine behind jrl's Engine contract (engine.py)."""
