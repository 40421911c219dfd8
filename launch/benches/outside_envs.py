"""`outside_envs`: what the outside-environment adapters cost and guard
(`jrl.envs.gym_env`, `jrl.envs.openenv_env`); no model, only the adapters.

    python launch/bench.py outside_envs [--games 8 --trials 20 --episodes 256]

Figures:
- textarena diverged runs, without / with the random guard: `--trials` runs
  of `--games` Blackjack games (which draw cards from the global `random`
  at every step) played at once in threads with random pauses; a run
  counts when any game's transcript differs from its game played alone.
- the guard's cost: a GuessTheNumber step (µs, median of 5 x 2000) without
  the guard, with it (`random`'s state swapped), and with numpy's state too.
- OpenEnv: the adapter's step (ms, median of 50, the chat rendering
  included) in process and on a uvicorn server on 127.0.0.1 over its
  WebSocket route; `--episodes` 3-step episodes on one server with 1, 16 and
  64 in flight (episodes/s). The environment is tests/envs/openenv_guess.py's.
"""

import concurrent.futures
import os
import random
import statistics
import threading
import time

HELP = 'the textarena random guard and the OpenEnv adapter: divergence and cost'
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(parser):
  parser.add_argument('--games', type=int, default=8, help='textarena games at once')
  parser.add_argument('--trials', type=int, default=20, help='runs of them')
  parser.add_argument('--episodes', type=int, default=256, help='OpenEnv episodes per figure')
  parser.add_argument('--app', default='tests.envs.openenv_guess:app', help='the OpenEnv app')


def _blackjack(seed, isolate, pause=None):
  from jrl.envs.gym_env import TextArenaGame

  game = TextArenaGame('Blackjack-v0', isolate_random=isolate)
  transcript = [game.reset(seed=seed)[0]]
  for i in range(12):
    if pause is not None:
      time.sleep(pause.random() * 0.002)
    observation, reward, done, _, _ = game.step('[Hit]' if i % 3 else '[Stand]')
    transcript.append((observation, reward))
    if done:
      break
  return transcript


def diverged_runs(games, trials, isolate):
  """Runs (of `trials`) in which a game played among others differed from itself alone."""
  alone = {s: _blackjack(s, isolate) for s in range(games)}
  diverged = 0
  for trial in range(trials):
    together = {}

    def play(s, trial=trial, together=together):
      together[s] = _blackjack(s, isolate, random.Random(1000 * trial + s))

    threads = [threading.Thread(target=play, args=(s,)) for s in range(games)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    diverged += any(together[s] != alone[s] for s in range(games))
  return diverged


def _median_us(fn, calls):
  runs = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(calls):
      fn()
    runs.append((time.perf_counter() - start) / calls * 1e6)
  return statistics.median(runs)


def guard_cost():
  from jrl.envs.gym_env import TextArenaGame

  out = {}
  for name, options in (
    ('none', dict(isolate_random=False)),
    ('random', dict(isolate_random=True)),
    ('random+numpy', dict(isolate_random=True, isolate_numpy=True)),
  ):
    game = TextArenaGame('GuessTheNumber-v0', max_number=10**9, max_turns=10**9, **options)
    game.reset(seed=1)
    out[name] = _median_us(lambda game=game: game.step('[5]'), 2000)
  return out


def openenv_figures(app, episodes):
  from jrl.envs.openenv_env import OpenEnvEnv, OpenEnvServer
  from launch.benches.envs_chat import chat_tokenizer
  from tests.envs.openenv_guess import GuessAction, GuessEnvironment

  tok = chat_tokenizer(512)
  server = OpenEnvServer(app, cwd=ROOT)
  out = {}
  try:
    for where, make in (('in process', GuessEnvironment), ('server', lambda: server.url)):
      times = []
      for _ in range(50):
        env = OpenEnvEnv(tok, make(), action=GuessAction)
        env.reset({'seed': 9})
        turn = env.model_turn('{"guess": 1}')
        start = time.perf_counter()
        env.step(turn)
        times.append(time.perf_counter() - start)
        env.finish('done', [])
      out[f'step ms, {where}'] = statistics.median(times) * 1e3

    def episode(i):
      env = OpenEnvEnv(tok, server.url, action=GuessAction)
      env.reset({'seed': i})
      for guess in range(3):
        if env.step(env.model_turn(f'{{"guess": {guess}}}')).done:
          break
      env.finish('done', [])

    for at_once in (1, 16, 64):
      start = time.perf_counter()
      with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        list(pool.map(episode, range(episodes)))
      out[f'episodes/s, {at_once} at once'] = episodes / (time.perf_counter() - start)
  finally:
    server.close()
  return out


def run(args):
  for isolate in (False, True):
    n = diverged_runs(args.games, args.trials, isolate)
    guard = 'with' if isolate else 'without'
    print(f'textarena: {n} of {args.trials} runs of {args.games} games diverged {guard} the guard')
  for name, us in guard_cost().items():
    print(f'GuessTheNumber step, guard {name}: {us:.1f} µs')
  for name, value in openenv_figures(args.app, args.episodes).items():
    print(f'OpenEnv {name}: {value:.2f}')
