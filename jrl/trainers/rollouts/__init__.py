"""The rollout side of the trainers: what produces a batch of scored samples.

`rollout` (the Rollout container and the single-turn RolloutWorker, the
`reward` section), `episodes` (the agent's multi-turn EpisodeWorker),
`engines` (the engine `sampler.engine` names), `contracts` (the typed
Engine and RolloutWorker protocols), `topology` (where and when rollouts
run: colocated, disaggregated, one-step-off, async) and `correction` (the
trainer's logprobs of a stale or outside engine's rollout). The update side,
the algorithms and the controller are the modules of `jrl.trainers`; nothing
here imports them.
"""
