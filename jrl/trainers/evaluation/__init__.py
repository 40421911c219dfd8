"""Held-out evaluation, in one place.

scores.py      pure functions: mean@n and unbiased pass@k of [P, n] scores
held_out.py    HeldOut: greedy and sampled accuracy of a policy's
               parameters during training, through the run's engine
standalone.py  the same without a trainer: of a Hugging Face directory or
               of a run's checkpoint (`launch/eval.py`)
"""
