"""jrl.rewards.server: the reward service over HTTP, so that verifiers can run
on other CPU hosts.

    python -m jrl.rewards.server --port 8123 --functions math_answer,format_think_answer \\
        --mode process --workers 8 --timeout_s 10

`make_server(service)` serves a `RewardService` (POST /score, GET /health);
`RemoteRewardService(url)` is the client, with the interface of
`RewardService`, and raises nothing into the caller. See README.md beside
this file for the protocol, the error answers, the server's limits and the
client's retries.
"""

from jrl.rewards.server.app import (
  BACKLOG,
  CONNECTION_LIMIT,
  MAX_BODY_BYTES,
  MAX_COMPLETIONS,
  MAX_HEADER_BYTES,
  READ_TIMEOUT_S,
  THREADS,
  RewardServer,
  make_app,
  make_server,
)
from jrl.rewards.server.cli import main
from jrl.rewards.server.client import RemoteRewardService
from jrl.rewards.server.validation import BadRequest, parse_score_request
