"""A server whose tree escapes its process group, as real vLLM's does: it starts a child that
stays in the group (vLLM's EngineCore), a grandchild that daemonises (double fork, own session,
re-parented to init: a resource tracker), then runs ARGV (the emulated server), or sleeps.
Each pid goes to the file named by $TREE_RECORD."""

import os
import sys
import time


def record() -> None:
    with open(os.environ["TREE_RECORD"], "a") as fh:
        fh.write(f"{os.getpid()}\n")


def linger() -> None:
    record()
    while True:
        time.sleep(1)


record()
if os.fork() == 0:
    linger()  # the group's member, outliving the server when only the server is signalled
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        linger()
    os._exit(0)  # the daemon's parent leaves at once: the daemon's parent is init now
os.wait()
if sys.argv[1:]:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])  # noqa: S606
while True:
    time.sleep(1)
