"""The privileged half of `jrl.rewards.sandbox`: what runs inside the namespaces.

Run as `python -I -S .../launcher/__main__.py --config-fd N` by
`jrl.rewards.sandbox.runner` (never imported for its side effects: importing
it only defines functions and constants, which the caller's side uses). The
config (JSON) comes on fd N, not in argv, so that nothing of it shows in
/proc/PID/cmdline. Depends on the standard library only, since it runs with
-I -S; its modules import each other relatively, as `__main__.py` loads the
package outside `jrl`. Every module is imported here, before the init
leaves the host's filesystem for the new root.

    launcher  enters the user (if not root), PID, network and IPC namespaces,
      |       opens the cgroup files the program joins, forks:
      init    PID 1: enters a mount namespace, builds the new root
      |       (`enter_new_root`), forks the program, reaps orphans, and (no
      |       cgroup) watches the memory of all processes; reports on the
      |       status pipe and exits, so the kernel kills what is left
      program joins the cgroup, sets rlimits, drops to the sandbox uid,
              sets no_new_privs and execs Python.

`--zygote` runs the warm launcher instead (zygote.py): the new root built
once, then a run forked per request, each with the same init and program.

See README.md in the sandbox package for what each mechanism guarantees.
"""

import sys

from .linux import CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER
from .new_root import enter_new_root, proc_mount_options, setup_filesystem
from .probe import probe, uid_range
from .process import launch, read_config, remove_tree, sweep
from .zygote import serve


def main(argv):
  """The command line: --probe | --sweep UID | --config-fd FD | --zygote FD SOCKET_FD.
  Returns the exit code."""
  if argv[:1] == ['--probe']:
    return probe()
  if argv[:1] == ['--sweep']:
    sweep(int(argv[1]))
    return 0
  if argv[:1] == ['--config-fd']:
    return launch(read_config(int(argv[1])))
  if argv[:1] == ['--zygote']:
    return serve(read_config(int(argv[1])), int(argv[2]))
  print(
    f'usage: {sys.argv[0]} --probe | --sweep UID | --config-fd FD | --zygote FD SOCKET_FD',
    file=sys.stderr,
  )
  return 2
