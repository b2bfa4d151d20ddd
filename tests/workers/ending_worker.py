"""How a process ends, for the job server's test (tests/integration/test_zygote.py): its argument picks the
ending. Each leaves lines that show the interpreter's exit order: a non-daemon thread that finishes after the
main code (joined first), an atexit handler (run next), output still in stdout's buffer (flushed last); and
an object only a module holds, whose finalizer only the module teardown after all that runs (which a
process forked from the job server skips)."""

import atexit
import os
import sys
import threading
import time


class SaysWhenFinalized:
    def __del__(
        self, write=os.write
    ):  # bound now: by the teardown, this module's names and sys.stderr are gone
        write(2, b"module teardown: ran\n")


# held by an imported module alone (no cycle through this script's globals): the teardown clearing that
# module's names is what finalizes it
os.held_until_the_module_teardown = SaysWhenFinalized()

atexit.register(lambda: print("atexit: ran after the thread", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread: joined before atexit"))).start()
print("main: done, this line still buffered")  # a pipe: block-buffered until the exit flushes it
how = sys.argv[1]
if how == "exit 3":
    sys.exit(3)
if how == "exit with a message":
    sys.exit("bye: said on stderr, exit 1")
if how == "raises":
    raise ValueError("boom")
