"""What a process that forks jobs' ranks imports once for all of them (a self-launch's rank server): the
training modules, rank 0's TensorBoard writer, and torch's wrappers set not to import its compiler stack at a
rank's first optimizer call (compat.defer_dynamo: 2 s of CPU a rank). Importing this module does all of it:
such a server only imports. Its forks freeze what they inherit (their collector never lists it again), so the
wrappers are set here, before the fork. And the server's own exit skips the teardown's collections
(runtime.teardown): 1.8 s to 0.6 s at the end of every self-launched job, measured."""

import torch.utils.tensorboard  # noqa: F401

import ddplab.train.assemble  # noqa: F401
import ddplab.train.loop  # noqa: F401
from ddplab import compat
from ddplab.runtime.teardown import cheap_interpreter_exit

compat.defer_dynamo()
cheap_interpreter_exit()
