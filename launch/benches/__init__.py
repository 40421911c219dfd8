"""The benchmarks behind `python launch/bench.py <name>`, one module each.

Each module has `add_arguments(parser)` (its command-line flags) and
`run(args)` (the measurement, printed; `--out` writes JSON where offered).
What they share (model sizes, the matmul peak, the FLOPs formula, timing,
the one config-shrinking helper) is in `common`.

    logprobs     chunked vs naive token logprobs (memory and time)
    model        forward / forward+backward throughput and MFU
    sampler      the paged sampler against a static batch or `transformers`
    grpo         seconds per stage of GRPO steps (default, larger, real)
    topology     colocated vs one-step-off step time
    update       one update step: padded vs packed rows, micro-batches
    calibration  the cost model, calibrated, against measured steps
    rewards      math verifier and code sandbox throughput, HumanEval
"""
